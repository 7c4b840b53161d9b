"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages), both ways: a body -> an AnswerRequest,
llmcli's events -> a message, or its event stream (message_start, content_block_start / _delta / _stop for each
thinking, text and tool_use block, message_delta, message_stop; a ping after the start). No HTTP here.

Taken: system (a string or text blocks), messages of text, tool_use and tool_result blocks, max_tokens (required, as
Anthropic requires it), stop_sequences, temperature, top_k, top_p, tools with tool_choice (auto, any, tool, none;
disable_parallel_tool_use), thinking (enabled, adaptive or disabled: the template's switch), output_config.format (a
JSON schema), images (base64 blocks). Earlier thinking blocks are left
out of the prompt, as Anthropic's own models drop them. Refused, saying so: documents, server tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.events import DecodeEvent, Done, Token
from llmcli.answer.finish import finish_reason
from llmcli.answer.images import MARKER as IMAGE_MARKER
from llmcli.answer.images import MAX_IMAGES, ImageInput
from llmcli.answer.message import Message
from llmcli.answer.openai_wire import WireError, image_from, text_of
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.tool_calls import ToolCall
from llmcli.serve.answer_request import AnswerRequest, ApiError, Prompter
from llmcli.serve.request_fields import (
    check_fields,
    checked,
    constraint_of,
    max_tokens_of,
    stops_of,
    tools_of,
)
from llmcli.serve.wire import Item

KINDS = {"server_error": "api_error"}  # llmcli's kind -> Anthropic's, where they differ
SAMPLING = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p"}
# read and left on purpose: who asks, which tier or region, cache hints (every prompt is cached in the slots), beta
# switches and billing, context management (edits that clear old thinking or tool results to save a remote context:
# the conversation is answered as sent), fallbacks (there is one model here)
LEFT = frozenset({"metadata", "service_tier", "inference_geo", "cache_control", "speed", "diagnostics",
                  "workspace_id", "user_profile_id", "context_management", "betas", "billing_policy", "compaction",
                  "fallback_credit_token", "fallbacks", "thread"})
BILLING_HEADER = "x-anthropic-billing-header:"  # a system block Anthropic's API takes for itself (Claude Code sends it)
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}) | LEFT
MESSAGE_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "stream", *SAMPLING}
NOT_HERE = {"container": "no code execution", "mcp_servers": "give the tools themselves"}


def error_body(error: WireError) -> dict[str, Any]:
    kind = "overloaded_error" if error.status == 503 else KINDS.get(error.kind, error.kind)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def parse_messages(body: Any, prompter: Prompter, counting: bool = False) -> list[AnswerRequest]:
    """A Messages body (`counting`: a count_tokens body, which has no max_tokens)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, COUNT_FIELDS if counting else MESSAGE_FIELDS, NOT_HERE)
    prompter.check_model(body.get("model"), lambda name: f"model: {name} (this server has {prompter.model_names[0]})")
    if not counting and body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    system = body.get("system")
    if isinstance(system, list):  # Claude Code's first block is billing metadata that changes every session, not
        system = [block for block in system if not (isinstance(block, dict) and str(block.get("text", ""))  # words
                                                     .startswith(BILLING_HEADER))]  # for the model: left out, so
    systems = [text_of(system, "system", "system")] if system else []  # the prompt's prefix stays the same
    conversation: list[Message] = []
    calls: dict[str, str] = {}  # tool_use id -> its tool's name
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":  # Claude Code's mid-conversation system
            systems.append(text_of(message.get("content"), f"messages.{index}.content", "messages"))  # messages: joined
            continue  # to the system prompt, where every chat template takes one
        conversation.extend(_message(message, index, calls))
    conversation[:0] = [Message("system", "\n\n".join(systems))] if systems else []
    choice, parallel = _choice(body.get("tool_choice"))
    tools = tools_of(_tools(body.get("tools")), choice, prompter, parallel, grammar=not counting)
    settings = {name: checked(name, body[wire], wire) for wire, name in SAMPLING.items() if body.get(wire) is not None}
    budget = body["thinking"].get("budget_tokens") if isinstance(body.get("thinking"), dict) else None
    if budget is not None:  # after this many tokens of thinking the block is closed (--think-budget)
        settings["think_budget"] = checked("think_budget", budget, "thinking.budget_tokens")
    if settings.get("temp", 0) > 1:
        raise ApiError(400, "temperature: must be in [0, 1]", param="temperature")
    return [AnswerRequest(messages=conversation, settings=settings, constraint=_format(body.get("output_config")),
                          max_tokens=None if counting else max_tokens_of(body.get("max_tokens"), "max_tokens"),
                          stops=stops_of(body.get("stop_sequences"), "stop_sequences"), tools=tools,
                          think=_thinking(body.get("thinking")), stream=bool(body.get("stream")))]


def _message(message: Any, index: int, calls: dict[str, str]) -> list[Message]:
    """One message: its text, an assistant's tool_use blocks as calls, a user's tool_result blocks as tool messages
    (before the user's own text, in the order given)."""
    where = f"messages.{index}"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: must be user or assistant", param="messages")
    content = message.get("content")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: must be a string or a list of content blocks", param="messages")
    texts: list[str] = []
    images: list[ImageInput] = []
    uses: list[ToolCall] = []
    results: list[Message] = []
    for number, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.content.{number}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"].replace(IMAGE_MARKER, "<__media _>"))
        elif kind == "tool_use" and role == "assistant":
            call_id, name, given = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(given, dict):
                raise ApiError(400, f"{here}: a tool_use block has an id, a name and an input object", param="messages")
            calls[call_id] = name
            uses.append(ToolCall(call_id, name, json.dumps(given, ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"{here}: a tool_result block needs its tool_use_id", param="messages")
            result = block.get("content") or ""
            text = text_of(result, here, "messages")
            results.append(Message("tool", ("Error: " + text) if block.get("is_error") else text,
                                   tool_call_id=call_id, name=calls.get(call_id)))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "image" and role == "user":
            images.append(image_from(_image_data(block.get("source"), here), here, "messages"))
            texts.append(IMAGE_MARKER)
        elif kind == "document":
            raise ApiError(400, f"{here}: documents are not supported (send their text)", param="messages")
        else:
            raise ApiError(400, f"{here}: a {role} message cannot hold a {kind!r} block here", param="messages")
    if role == "assistant":
        return [Message("assistant", "".join(texts), tool_calls=tuple(uses))]
    if len(images) > MAX_IMAGES:
        raise ApiError(400, f"{where}: {len(images)} images; a message takes at most {MAX_IMAGES}", param="messages")
    return results + ([Message("user", "".join(texts), images=tuple(images))] if texts or not results else [])


def _image_data(source: Any, where: str) -> str:
    """An image block's `source`: base64 with its media type (a URL is not fetched by this server)."""
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise ApiError(400, f"{where}.source: an image's source is {{type: base64, media_type, data}}", param="messages")
    if source["type"] == "url":
        raise ApiError(400, f"{where}.source: image URLs are not fetched by this server; send the image as base64",
                       param="messages")
    data = source.get("data")
    return data if isinstance(data, str) else ""


def _tools(tools: Any) -> Any:
    """Anthropic's custom tools ({name, description, input_schema}) as the function tools llmcli reads."""
    if tools is None or not isinstance(tools, list):
        return tools
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools.{index}: only custom tools are supported here (not {kind!r})", param="tools")
        converted.append({"name": tool.get("name"), "description": tool.get("description") or "",
                          "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}})
    return converted


def _choice(choice: Any) -> tuple[Any, bool]:
    """tool_choice -> llmcli's choice and whether several calls may come at once."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not choice.get("disable_parallel_tool_use", False) if isinstance(choice, dict) else True
    if kind == "tool":
        return choice.get("name"), parallel
    if kind in ("auto", "any", "none"):
        return {"any": "required"}.get(kind, kind), parallel
    raise ApiError(400, "tool_choice.type: must be auto, any, tool or none", param="tool_choice")


def _format(output_config: Any) -> Any:
    """output_config.format: a JSON schema the answer must match (structured outputs)."""
    given = output_config.get("format") if isinstance(output_config, dict) else None
    if given is None:
        return constraint_of(None)
    if not isinstance(given, dict) or given.get("type") != "json_schema":
        raise ApiError(400, "output_config.format.type: must be json_schema", param="output_config")
    return constraint_of("json_schema", given.get("schema"), param="output_config.format")


def _thinking(thinking: Any) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise ApiError(400, "thinking.type: must be enabled, adaptive or disabled", param="thinking")
    return bool(kind != "disabled")


# -- replies ---------------------------------------------------------------------------------------------


def usage(done: Done) -> dict[str, Any]:
    stats = done.stats
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens, "output_tokens": stats.completion_tokens,
            "cache_read_input_tokens": stats.cached_tokens, "cache_creation_input_tokens": 0}


@dataclass
class MessagesReply:
    model: str
    prompt_tokens: int
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])
    block: int = -1  # the index of the content block now open (-1: none yet)
    kind: str | None = None  # its type: thinking, text or tool_use (None: closed)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    def _message(self, content: list[Any], done: Done | None) -> dict[str, Any]:
        reason = finish_reason(done.finish_reason).anthropic if done else None
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": done.stop_sequence if done else None,
                "usage": usage(done) if done else {"input_tokens": self.prompt_tokens, "output_tokens": 0}}

    def opening(self) -> list[Item]:
        return [("message_start", {"type": "message_start", "message": self._message([], None)}),
                ("ping", {"type": "ping"})]

    def keepalive(self) -> list[Item]:
        return [("ping", {"type": "ping"})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[Item]:
        items = self._close()
        self.block += 1
        self.kind = kind
        return [*items, ("content_block_start", {"type": "content_block_start", "index": self.block,
                                                 "content_block": block})]

    def _close(self) -> list[Item]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _delta(self, delta: dict[str, Any]) -> Item:
        return "content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta}

    def on_event(self, index: int, event: DecodeEvent) -> list[Item]:
        if isinstance(event, Token):
            kind = "thinking" if event.reasoning else "text"
            items = [] if self.kind == kind else self._open(kind, {"type": "thinking", "thinking": "", "signature": ""}
                                                               if event.reasoning else {"type": "text", "text": ""})
            delta = {"type": "thinking_delta", "thinking": event.text} if event.reasoning else \
                {"type": "text_delta", "text": event.text}
            return [*items, self._delta(delta)]
        if isinstance(event, CallStarted):
            return self._open("tool_use", {"type": "tool_use", "id": _use_id(event.id), "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        reason = finish_reason(event.finish_reason).anthropic
        return [*self._close(), ("message_delta", {"type": "message_delta", "usage": usage(event),
                                                   "delta": {"stop_reason": reason,
                                                             "stop_sequence": event.stop_sequence}}),
                ("message_stop", {"type": "message_stop"})]

    def closing(self, dones: list[Done]) -> list[Item]:
        return []

    def failed(self, error: ApiError) -> list[Item]:
        return [("error", error_body(error))]

    def whole(self, dones: list[Done]) -> dict[str, Any]:
        done = dones[0]
        content: list[dict[str, Any]] = []
        if done.reasoning:
            content.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
        if done.text or not done.tool_calls:
            content.append({"type": "text", "text": done.text})
        content += [{"type": "tool_use", "id": _use_id(call.id), "name": call.name, "input": call.arguments_value()}
                    for call in done.tool_calls]
        return self._message(content, done)


def _use_id(call_id: str) -> str:
    """Anthropic's ids of tool uses begin `toolu_`."""
    return "toolu_" + call_id.removeprefix("call_")


def count_reply(n_tokens: int) -> Mapping[str, int]:
    return {"input_tokens": n_tokens}
