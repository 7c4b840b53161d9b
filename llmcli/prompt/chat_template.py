"""Chat templates: the messages they read, rendering one safely, and the tools in a prompt.

A template stored in a GGUF is code written by a stranger: it is compiled and rendered in the bounded sandbox of
llmcli/prompt/template_sandbox.py (its size capped here, its output capped here, everything else there).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from llmcli.answer.message import Message
from llmcli.answer.tool_calls import ToolSpec, call_markup, describe_tools, template_reads_tools
from llmcli.errors import TemplateError
from llmcli.prompt.template_sandbox import HINT as _HINT
from llmcli.prompt.template_sandbox import RENDER_SECONDS, TemplateLimit, environment, rendering_budget

MAX_TEMPLATE_CHARS = 64 * 1024
MAX_RENDERED_CHARS = 4 * 1024 * 1024


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
            with rendering_budget(RENDER_SECONDS):
                for chunk in template.generate(**context):
                    size += len(chunk)
                    if size > MAX_RENDERED_CHARS:
                        raise TemplateLimit(f"output exceeds {MAX_RENDERED_CHARS} characters")
                    chunks.append(chunk)
        except TemplateError:
            raise
        except TemplateLimit as exc:
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


def too_long(origin: str, length: str) -> TemplateError:
    """A chat template over MAX_TEMPLATE_CHARS (`length`: how long it is, in words)."""
    return TemplateError(f"chat template ({origin}) is {length} characters; the limit is {MAX_TEMPLATE_CHARS}",
                         hint=_HINT)


def _compile(source: str, origin: str) -> jinja2.Template:
    if len(source) > MAX_TEMPLATE_CHARS:
        raise too_long(origin, str(len(source)))
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template ({origin}) has a syntax error on line {exc.lineno}: {exc.message}",
            hint=_HINT,
        ) from None


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """A template's compiled code, once a process: every prompt of a chat or a server renders with it (compiling a
    real model's template takes 3-30 ms; a compiled one holds no state of a rendering, and its sandbox none either)."""
    return environment().from_string(source)


def check(template: ChatTemplate) -> None:
    """Compile without rendering; raises TemplateError on a syntax error."""
    _compile(template.source, template.origin)
