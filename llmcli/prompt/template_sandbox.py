"""The sandbox a stranger's chat template runs in: Jinja's `ImmutableSandboxedEnvironment` with no loader, without
the `cycler`, `joiner` and `lipsum` gadgets, and bounded in what it may do besides reaching attributes.

- Every value it builds is capped (MAX_VALUE_LEN) before it is built — with `*`, `**`, `+`, `~`, `%`, the filters and
  string methods that can make a value larger than their inputs (a width, a separator, a replacement) — and all it
  builds in one rendering together (MAX_BUILT_CHARS).
- A time budget that holds on any thread (`rendering_budget`): the rendering thread traces the template's own compiled
  code (and nothing else) and stops it at the first line run after its deadline (`serve` renders on worker threads,
  where SIGALRM never fires).

A limit reached is a `TemplateLimit`; llmcli/prompt/chat_template.py turns it into the one-line TemplateError.
"""

from __future__ import annotations

import json
import re
import string
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmcli.errors import TemplateError

MAX_VALUE_LEN = 1024 * 1024  # longest string or list that an operator, a filter or a method may build
MAX_BUILT_CHARS = 64 * 1024 * 1024  # all that one rendering may build with them together
RENDER_SECONDS = 2.0
HINT = "Use --raw to send the prompt as-is, or --chat-template-file FILE to supply a template."


class TemplateLimit(Exception):
    """A template asked for more than its rendering may do (time, or the size of what it builds)."""


class _RaisedByTemplate(TemplateError):
    pass


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(f"chat template refused the conversation: {message}", hint=HINT)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
        raise TemplateLimit(f"tojson indent {indent!r} (at most 16)")
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
        raise TemplateLimit(f"a value of more than {MAX_VALUE_LEN} characters or items")
    _BUDGET.built += size
    if _BUDGET.built > MAX_BUILT_CHARS:
        raise TemplateLimit(f"it built more than {MAX_BUILT_CHARS} characters")
    return value


def _planned(size: int, what: str) -> None:
    """Refuse, before it is built, a value that would be larger than MAX_VALUE_LEN."""
    if size > MAX_VALUE_LEN:
        raise TemplateLimit(f"{what} would build more than {MAX_VALUE_LEN} characters or items")


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    return _trace_lines if frame.f_code.co_filename == _TEMPLATE_FILE else None


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    _BUDGET.lines += 1
    if _BUDGET.lines % 64 == 0 and time.monotonic() > _BUDGET.deadline:
        raise TemplateLimit(f"rendering took longer than {RENDER_SECONDS:g} s")
    return _trace_lines


@contextmanager
def rendering_budget(seconds: float) -> Iterator[None]:
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
                raise TemplateLimit(f"exponent {right} is too large")
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > MAX_VALUE_LEN:
                        raise TemplateLimit("a value built with '*' is too large")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_VALUE_LEN:
                raise TemplateLimit("a value built with '+' is too large")
        elif operator == "%":
            _check_percent(left, right)
        return _built(super().call_binop(context, operator, left, right))


def environment() -> jinja2.Environment:
    """A fresh bounded sandbox with the globals and filters chat templates use."""
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
