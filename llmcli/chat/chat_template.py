"""Chat templates: where the template comes from, and rendering it safely.

A template stored in a GGUF is code written by a stranger. It is rendered in an
`ImmutableSandboxedEnvironment` with no loader, without Jinja's `cycler`,
`joiner` and `lipsum` globals, with caps on template size, on the size of the
values `*`, `**` and `+` build, on the rendered size, and with a time budget.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmcli.answer.tool_calls import ToolCall, ToolSpec, call_markup, describe_tools, template_reads_tools
from llmcli.errors import TemplateError

MAX_TEMPLATE_CHARS = 64 * 1024
MAX_RENDERED_CHARS = 4 * 1024 * 1024
MAX_VALUE_LEN = 1024 * 1024  # longest string or list that an operator may build
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
            with _time_budget(RENDER_SECONDS):
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
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox blocks attribute escapes, not work: bound what operators may build."""

    intercepted_binops = frozenset({"*", "**", "+"})

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
        return super().call_binop(context, operator, left, right)


def _environment() -> jinja2.Environment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, loader=None)
    for gadget in ("cycler", "joiner", "lipsum"):
        env.globals.pop(gadget, None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


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


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Interrupt rendering that runs longer than `seconds` (main thread only, via SIGALRM)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    def on_alarm(signum: int, frame: Any) -> None:
        raise _TemplateLimit(f"rendering took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
