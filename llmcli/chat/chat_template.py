"""Chat templates: where the template comes from, and rendering it safely.

A template stored in a GGUF is code written by a stranger. It is rendered in an
`ImmutableSandboxedEnvironment` with no loader, without Jinja's `cycler`,
`joiner` and `lipsum` globals, with caps on template size, on the rendered size,
on every value it builds — with `*`, `**`, `+`, `~`, `%`, the filters and the string
methods that can make a value larger than their inputs (a width, a separator, a
replacement) — and on all it builds in one rendering, and with a time budget that holds
on any thread: the rendering thread traces the template's own code (and nothing else)
and stops it at the first line run after its deadline (`serve` renders on worker
threads, where SIGALRM never fires).
"""

from __future__ import annotations

import json
import re
import string
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmcli.answer.tool_calls import ToolCall, ToolSpec, call_markup, describe_tools, template_reads_tools
from llmcli.errors import TemplateError

MAX_TEMPLATE_CHARS = 64 * 1024
MAX_RENDERED_CHARS = 4 * 1024 * 1024
MAX_VALUE_LEN = 1024 * 1024  # longest string or list that an operator, a filter or a method may build
MAX_BUILT_CHARS = 64 * 1024 * 1024  # all that one rendering may build with them together
RENDER_SECONDS = 2.0


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    interrupted: bool = False  # a reply cut short by Ctrl-C (kept in the history, marked in records)
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    name: str | None = None  # ... and the tool's name

    def openai_dict(self) -> dict[str, Any]:
        """As OpenAI's chat API takes a message (a call's arguments as JSON text)."""
        found = self.template_dict()
        if self.tool_calls:  # (content stays a string: OpenAI takes "", and some servers refuse null)
            found["tool_calls"] = [call.openai() for call in self.tool_calls]
        return found

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Message:
        """A message saved with dataclasses.asdict (/save, conversation records)."""
        calls = tuple(ToolCall(str(c["id"]), str(c["name"]), str(c.get("arguments") or "{}"), c.get("error"))
                      for c in record.get("tool_calls") or ())
        return cls(record["role"], record["content"], bool(record.get("interrupted")), calls,
                   record.get("tool_call_id"), record.get("name"))

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read a message (OpenAI's shape: a call's arguments as an object, as templates expect)."""
        found: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            found["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments_value()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            found["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            found["name"] = self.name
        return found


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # where it came from: "gguf" or a file path

    def render(
        self,
        messages: Sequence[Message],
        bos_token: str = "",
        eos_token: str = "",
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """`variables`: more the template may read (e.g. `enable_thinking`); they never replace the ones above."""
        template = _compile(self.source, self.origin)
        context = {
            **(variables or {}),
            "messages": [m.template_dict() for m in messages],
            "bos_token": bos_token,
            "eos_token": eos_token,
            "add_generation_prompt": add_generation_prompt,
        }
        chunks: list[str] = []
        size = 0
        try:
            with _budget(RENDER_SECONDS):
                for chunk in template.generate(**context):
                    size += len(chunk)
                    if size > MAX_RENDERED_CHARS:
                        raise _TemplateLimit(f"output exceeds {MAX_RENDERED_CHARS} characters")
                    chunks.append(chunk)
        except TemplateError:
            raise
        except _TemplateLimit as exc:
            raise TemplateError(f"chat template ({self.origin}) stopped: {exc}", hint=_HINT) from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template ({self.origin}) failed: {exc}", hint=_HINT) from None
        except Exception as exc:  # a template can raise anything the sandbox lets it reach
            raise TemplateError(
                f"chat template ({self.origin}) failed: {type(exc).__name__}: {exc}", hint=_HINT
            ) from None
        return "".join(chunks)


def tools_in_prompt(messages: Sequence[Message], spec: ToolSpec | None,
                    template_source: str | None) -> tuple[list[Message], dict[str, Any]]:
    """The messages and template variables of a conversation with tools. A template that reads `tools` gets them,
    and the calls and `tool` messages as they are; for one that knows no tools, the tools are described in the system
    prompt, a call is written in its format's markup and a result is a user message in a <tool_response> block."""
    if spec is None or not spec.tools:
        if not any(m.tool_calls or m.role == "tool" for m in messages):
            return list(messages), {}
        spec = ToolSpec((), format="generic")  # calls and results of an earlier turn, without tools now
    if template_reads_tools(template_source):
        return list(messages), {"tools": [tool.openai() for tool in spec.tools]} if spec.tools else {}
    description = describe_tools(spec.tools, spec.format) if spec.active else ""
    shown: list[Message] = []
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            markup = "\n".join(call_markup(call, spec.format) for call in message.tool_calls)
            shown.append(Message("assistant", (message.content + "\n" if message.content else "") + markup))
        elif message.role == "tool":
            shown.append(Message("user", f"<tool_response>\n{message.content}\n</tool_response>"))
        else:
            shown.append(message)
    if description:
        if shown and shown[0].role == "system":
            shown[0] = Message("system", f"{shown[0].content}\n\n{description}")
        else:
            shown.insert(0, Message("system", description))
    return shown, {}


def default_system(template: ChatTemplate, bos_token: str = "", eos_token: str = "") -> str | None:
    """The system prompt a template writes itself when the messages bring none (SmolLM2's "You are a helpful AI
    assistant named SmolLM…"), found by rendering with and without one; None when it adds none."""
    mark, given = "\ue000", "\ue001"  # private-use characters: no template writes them
    alone = template.render([Message("user", mark)], bos_token, eos_token, add_generation_prompt=False)
    with_one = template.render([Message("system", given), Message("user", mark)], bos_token, eos_token,
                               add_generation_prompt=False)
    if mark not in alone or given not in with_one:
        return None
    before, _, after = with_one[: with_one.index(mark)].partition(given)
    prefix = alone[: alone.index(mark)]
    if not prefix.startswith(before) or not prefix.endswith(after) or len(prefix) <= len(before) + len(after):
        return None
    return prefix[len(before) : len(prefix) - len(after)].strip() or None


_HINT = "Use --raw to send the prompt as-is, or --chat-template-file FILE to supply a template."


class _TemplateLimit(Exception):
    pass


class _RaisedByTemplate(TemplateError):
    pass


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(f"chat template refused the conversation: {message}", hint=_HINT)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
        raise _TemplateLimit(f"tojson indent {indent!r} (at most 16)")
    return _built(json.dumps(value, indent=indent, ensure_ascii=ensure_ascii))


# -- what one rendering may do: time and characters built, per thread ------------------------------------------


class _Budget(threading.local):
    deadline = float("inf")
    built = 0
    lines = 0


_BUDGET = _Budget()
_TEMPLATE_FILE = "<template>"  # the file name Jinja gives the code it compiles from a string


_Value = TypeVar("_Value")


def _built(value: _Value) -> _Value:
    """`value`, counted against the rendering's budget of characters built (a string's or a list's length)."""
    size = len(value) if isinstance(value, (str, list, tuple)) else 0
    if size > MAX_VALUE_LEN:
        raise _TemplateLimit(f"a value of more than {MAX_VALUE_LEN} characters or items")
    _BUDGET.built += size
    if _BUDGET.built > MAX_BUILT_CHARS:
        raise _TemplateLimit(f"it built more than {MAX_BUILT_CHARS} characters")
    return value


def _planned(size: int, what: str) -> None:
    """Refuse, before it is built, a value that would be larger than MAX_VALUE_LEN."""
    if size > MAX_VALUE_LEN:
        raise _TemplateLimit(f"{what} would build more than {MAX_VALUE_LEN} characters or items")


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    return _trace_lines if frame.f_code.co_filename == _TEMPLATE_FILE else None


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    _BUDGET.lines += 1
    if _BUDGET.lines % 64 == 0 and time.monotonic() > _BUDGET.deadline:
        raise _TemplateLimit(f"rendering took longer than {RENDER_SECONDS:g} s")
    return _trace_lines


@contextmanager
def _budget(seconds: float) -> Iterator[None]:
    """Bound one rendering on this thread, whichever it is: its time (the template's own lines are traced, each 64th
    looks at the clock) and the characters it builds."""
    previous = sys.gettrace()
    _BUDGET.deadline, _BUDGET.built, _BUDGET.lines = time.monotonic() + seconds, 0, 0
    sys.settrace(_trace_calls)
    try:
        yield
    finally:
        sys.settrace(previous)
        _BUDGET.deadline = float("inf")


def _str_join(pieces: Any) -> str:
    """`a ~ b` (Jinja's concatenation), bounded."""
    texts = [str(piece) for piece in pieces]
    _planned(sum(map(len, texts)), "'~'")
    return _built("".join(texts))


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with `~` going through the environment's bounded join."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_WIDTHS = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(fmt: Any, values: Any) -> None:
    """`fmt % values` (and the `format` filter): no width or precision that builds more than MAX_VALUE_LEN."""
    if not isinstance(fmt, str):
        return
    for width, precision in _WIDTHS.findall(fmt):
        for number in (width, precision):
            if number.isdigit():
                _planned(int(number), "a % width")
    if "*" in fmt:
        for value in values if isinstance(values, tuple) else (values,):
            if isinstance(value, int):
                _planned(abs(value), "a % width")


def _check_format_string(fmt: str, args: Any, kwargs: Any) -> None:
    """`str.format`: no width in a field's spec (or given as an argument to a nested field) larger than MAX_VALUE_LEN."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format says so itself
    for _, _, spec, _ in fields:
        for number in re.findall(r"\d+", spec or ""):
            _planned(int(number), "a format width")
        if spec and "{" in spec:
            for value in (*args, *kwargs.values()):
                if isinstance(value, int):
                    _planned(abs(value), "a format width")


def _check_arguments(args: Any, kwargs: Any, what: str) -> None:
    """A count or width given to a filter or a method: none may ask for more than MAX_VALUE_LEN."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _planned(abs(value), what)


def _check_str_method(method: Any, args: Any, kwargs: Any) -> None:
    """The string methods whose result can outgrow their inputs: join, replace, expandtabs."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "join" and args:
        items = args[0]
        count = len(items) if hasattr(items, "__len__") else 0
        _planned(len(owner) * max(count - 1, 0), "join")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _planned(len(owner) + (owner.count(args[0]) if args[0] else len(owner) + 1) * len(args[1]), "replace")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _planned(owner.count("\t") * size, "expandtabs")


def _bounded_filter(name: str, original: Any) -> Any:
    """A built-in filter with its counts and widths checked first, and what it builds counted."""
    def sized(value: Any) -> Any:  # an iterator to join: its items first (bounded as whatever made them)
        return list(value) if name == "join" and not hasattr(value, "__len__") and hasattr(value, "__iter__") else value

    def check(value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_arguments(args, kwargs, f"the {name} filter")
        if name == "format":
            _check_percent(value, tuple(args) or tuple(kwargs.values()))
        elif name == "join":
            separator = args[0] if args else kwargs.get("d", "")
            count = len(value) if hasattr(value, "__len__") else 0
            _planned(len(str(separator)) * max(count - 1, 0), "the join filter")
        elif name == "replace" and len(args) >= 2:
            _check_str_method(str(value).replace, (str(args[0]), str(args[1])), {})
        elif name == "indent":
            width = args[0] if args else kwargs.get("width", 4)
            lines = str(value).count("\n") + 1
            _planned(lines * (len(width) if isinstance(width, str) else width if isinstance(width, int) else 0),
                     "the indent filter")
        elif name == "wordwrap":
            wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring") or ""
            _planned(len(str(value)) * len(str(wrap)), "the wordwrap filter")

    if getattr(original, "jinja_pass_arg", None) is not None:  # takes the context or eval context first
        def passing(first: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            value = sized(value)
            check(value, args, kwargs)
            return _built(original(first, value, *args, **kwargs))

        passing.jinja_pass_arg = original.jinja_pass_arg  # type: ignore[attr-defined]
        return passing

    def plain(value: Any, *args: Any, **kwargs: Any) -> Any:
        value = sized(value)
        check(value, args, kwargs)
        return _built(original(value, *args, **kwargs))

    return plain


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox blocks attribute escapes, not work: bound what operators, filters and methods may build."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def bounded_join(self, pieces: Any) -> str:
        return _str_join(pieces)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's names)
        _check_arguments(args, kwargs, f"{getattr(__obj, '__name__', 'a call')}()")
        _check_str_method(__obj, args, kwargs)
        return _built(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_string(fmt, args, kwargs if value.__name__ == "format" else (args[0] if args else {}))
            return str(wrapped(*args, **kwargs))

        return checked

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Touching an unsafe attribute (`__class__`, `__globals__`, …) is an error, not a silent blank."""
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise _TemplateLimit(f"exponent {right} is too large")
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > MAX_VALUE_LEN:
                        raise _TemplateLimit("a value built with '*' is too large")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_VALUE_LEN:
                raise _TemplateLimit("a value built with '+' is too large")
        elif operator == "%":
            _check_percent(left, right)
        return _built(super().call_binop(context, operator, left, right))


def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, loader=None)
    for gadget in ("cycler", "joiner", "lipsum"):
        env.globals.pop(gadget, None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    for name in _AMPLIFYING_FILTERS:
        env.filters[name] = _bounded_filter(name, env.filters[name])
    env.filters["tojson"] = _tojson
    return env


# The built-in filters whose result can be larger than their input, or that take a count or a width.
_AMPLIFYING_FILTERS = ("format", "join", "replace", "center", "indent", "wordwrap", "truncate", "batch", "slice",
                       "list", "string", "pprint", "urlize", "xmlattr")


def _compile(source: str, origin: str) -> jinja2.Template:
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateError(
            f"chat template ({origin}) is {len(source)} characters; the limit is {MAX_TEMPLATE_CHARS}",
            hint=_HINT,
        )
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template ({origin}) has a syntax error on line {exc.lineno}: {exc.message}",
            hint=_HINT,
        ) from None


def check(template: ChatTemplate) -> None:
    """Compile without rendering; raises TemplateError on a syntax error."""
    _compile(template.source, template.origin)
