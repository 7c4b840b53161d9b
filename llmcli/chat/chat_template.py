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
            "messages": [{"role": m.role, "content": m.content} for m in messages],
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
