"""OpenAI's Responses API (POST /v1/responses), both ways: a body -> an AnswerRequest, llmcli's events -> a response
object, or its typed event stream (response.created, response.in_progress, output items added and done, text,
reasoning and call-argument deltas, response.completed or response.incomplete), each with its sequence_number.
No HTTP here.

Taken: input (a string, or messages and the function_call / function_call_output items of earlier turns),
instructions, tools (function tools) with tool_choice and parallel_tool_calls, max_output_tokens, temperature, top_p,
text.format (text, json_object, json_schema), reasoning (its effort: the template's thinking switch), stream, store
and previous_response_id: a stored response's conversation continues (kept while the server runs, the latest
MAX_KEPT; one that is not kept is a 400 saying so). Refused, saying so: built-in tools and files.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.events import DecodeEvent, Done, Token
from llmcli.answer.finish import finish_reason
from llmcli.answer.message import Message
from llmcli.answer.openai_wire import content_of, text_of
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.tool_calls import ToolCall
from llmcli.serve.answer_request import AnswerRequest, ApiError, Prompter
from llmcli.serve.openai_api import error_body
from llmcli.serve.request_fields import (
    check_fields,
    checked,
    constraint_of,
    max_tokens_of,
    tools_of,
)
from llmcli.serve.wire import Item

MAX_KEPT = 256  # responses kept for previous_response_id
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# cannot change a local answer, read and left on purpose: who asks, which tier, caching and moderation hints,
# `include` (nothing here has more to include: no encrypted reasoning, no sources), client metadata (Codex), options
# of features not asked for (background, image generation, compaction)
LEFT = frozenset({"metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
                  "include", "client_metadata", "prompt_cache_options", "prompt_cache_retention", "moderation",
                  "access_programs", "background_options", "context_management", "image"})
FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
                    "temperature", "top_p", "stream", "store", "previous_response_id", "text", "reasoning",
                    "truncation"}) | LEFT
NOT_HERE = {"background": "answers are not run in the background",
            "max_tool_calls": "tool calls are the client's to run", "top_logprobs": "logprobs: use /v1/chat/completions",
            "conversation": "use previous_response_id or send the input", "prompt": "no stored prompts"}


@dataclass(frozen=True)
class ResponsesRequest:
    answer: AnswerRequest
    echo: Mapping[str, Any]  # what the response object repeats of the request
    conversation: list[Message]  # the whole conversation this response answers (kept with it)
    store: bool


def parse_response_request(body: Any, prompter: Prompter, kept: Mapping[str, list[Message]]) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, FIELDS, NOT_HERE)
    if body.get("truncation", "disabled") not in ("disabled", "auto"):  # (auto: a prompt that does not fit is a 400)
        raise ApiError(400, "truncation must be disabled or auto", param="truncation")
    prompter.check_model(body.get("model"))
    earlier: list[Message] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "previous_response_id must be a string", param="previous_response_id")
        if previous not in kept:
            raise ApiError(400, f"previous_response_id: {previous!r} is not kept here (a server keeps the latest "
                           f"{MAX_KEPT} stored responses while it runs; send the conversation as input instead)",
                           param="previous_response_id", code="previous_response_not_found")
        earlier = [m for m in kept[previous] if m.role != "system"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", param="instructions")
    conversation = ([Message("system", instructions)] if instructions else []) + earlier + _input(body.get("input"))
    tools = tools_of(_tools(body.get("tools")), _choice(body.get("tool_choice")), prompter,
                     body.get("parallel_tool_calls", True))
    settings = {name: checked(name, body[wire], wire) for wire, name in (("temperature", "temp"), ("top_p", "top_p"))
                if body.get(wire) is not None}
    text = body.get("text") or {}
    text_format = text.get("format") if isinstance(text, dict) else None
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if text_format is not None and kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format")
    if tools is not None and tools.active and kind in ("json_object", "json_schema"):
        raise ApiError(400, "tools cannot be combined with a JSON text.format", param="tools")
    constraint = constraint_of("json" if kind == "json_object" else kind,
                               text_format.get("schema") if isinstance(text_format, dict) else None,
                               param="text.format")
    store = body.get("store", True)
    answer = AnswerRequest(messages=conversation, settings=settings,
                           max_tokens=max_tokens_of(body.get("max_output_tokens"), "max_output_tokens"),
                           constraint=constraint, tools=tools, think=_effort(body.get("reasoning")),
                           stream=bool(body.get("stream")), prompt_param="input", limit_param="max_output_tokens")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "store": bool(store),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": text_format or {"type": "text"}}, "metadata": body.get("metadata") or {},
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None}, "truncation": "disabled"}
    return ResponsesRequest(answer, echo, conversation, bool(store))


def _input_image(part: dict[str, Any]) -> str | None:
    """The Responses API's `{"type": "input_image", "image_url": "data:…"}` (a `file_id` is not kept here)."""
    if part.get("type") != "input_image":
        return None
    url = part.get("image_url")
    return url if isinstance(url, str) else ""


def _input(given: Any) -> list[Message]:
    """A string (one user message), or items: messages, and the calls and their outputs of earlier turns."""
    if isinstance(given, str):
        return [Message("user", given)]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input must be a string or a non-empty list of items", param="input")
    messages: list[Message] = []
    names: dict[str, str] = {}
    for index, item in enumerate(given):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            text, images = content_of(item.get("content"), where, "input", TEXT_PARTS,
                                      _input_image if item["role"] == "user" else None)
            messages.append(Message(ROLES[item["role"]], text, images=images))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise ApiError(400, f"{where}: a function_call has call_id, name and arguments", param="input")
            if isinstance(item.get("namespace"), str):  # a namespace's tool, as the model saw its name
                name = f"{item['namespace']}{NAMESPACED}{name}"
            names[call_id] = name
            call = ToolCall(call_id, name, arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the calls of one turn: one assistant message
                messages[-1] = Message("assistant", last.content, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(Message("assistant", "", tool_calls=(call,)))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiError(400, f"{where}: a function_call_output needs its call_id", param="input")
            messages.append(Message("tool", text_of(output, where, "input", TEXT_PARTS), tool_call_id=call_id,
                                    name=names.get(call_id)))
        elif kind == "reasoning":
            continue  # earlier reasoning is left out of the prompt
        else:
            raise ApiError(400, f"{where}: a {kind!r} item is not supported here", param="input")
    return messages


NAMESPACED = "__"  # a namespace's tool as the model sees it: NAMESPACE__NAME (Codex groups its MCP tools so)
# OpenAI's hosted tools: run by OpenAI's servers, not by the client. Offered alongside the client's own (Codex always
# offers web_search), they are left out of the prompt: the model answers without them, as with tool_choice auto.
HOSTED = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "file_search", "code_interpreter",
                    "image_generation", "computer_use_preview", "computer_use", "mcp", "local_shell", "tool_search"})


def _tools(tools: Any) -> Any:
    """Function tools, and the function tools of namespaces (each named NAMESPACE__NAME for the model)."""
    if tools is None or not isinstance(tools, list):
        return tools
    flat = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            flat.append(tool)
        elif kind in HOSTED:
            continue
        elif kind == "namespace" and isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise ApiError(400, f"tools[{index}].tools: only function tools are supported here", param="tools")
                flat.append({**inner, "name": f"{tool['name']}{NAMESPACED}{inner.get('name')}"})
        else:
            raise ApiError(400, f"tools[{index}]: only function and namespace tools (and hosted ones, left to the model "
                           f"unused) are supported here (not {kind!r})", param="tools")
    return [{"name": t.get("name"), "description": t.get("description") or "", "parameters": t.get("parameters")}
            for t in flat]


def _namespaces(tools: Any) -> frozenset[str]:
    """The namespaces a request's tools name."""
    return frozenset(t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "namespace"
                     and isinstance(t.get("name"), str)) if isinstance(tools, list) else frozenset()


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return choice.get("name")
    return choice


def _effort(reasoning: Any) -> bool | None:
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high"):
        raise ApiError(400, "reasoning.effort must be none, minimal, low, medium or high", param="reasoning")
    return bool(effort != "none")


# -- replies ---------------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class _Output:
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


@dataclass
class ResponsesReply:
    model: str
    request: ResponsesRequest
    keep: Callable[[str, list[Message]], None]  # store a finished response's conversation under its id
    id: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    outputs: list[_Output] = field(default_factory=list)
    open: _Output | None = None  # the output item being streamed

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    def _event(self, kind: str, **fields: Any) -> Item:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _response(self, status: str, done: Done | None) -> dict[str, Any]:
        incomplete = finish_reason(done.finish_reason).responses if done else None
        usage = None
        if done is not None:
            stats = done.stats
            usage = {"input_tokens": stats.prompt_tokens, "input_tokens_details": {"cached_tokens": stats.cached_tokens},
                     "output_tokens": stats.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": stats.prompt_tokens + stats.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
                "output": [o.item for o in self.outputs], "usage": usage, **self.request.echo}

    def opening(self) -> list[Item]:
        response = self._response("in_progress", None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def keepalive(self) -> list[Item]:
        return [self._event("response.in_progress", response=self._response("in_progress", None))]

    def _add(self, item: dict[str, Any]) -> list[Item]:
        items = self._finish_open()
        self.open = _Output(item)
        self.outputs.append(self.open)
        items.append(self._event("response.output_item.added", output_index=len(self.outputs) - 1, item=item))
        if item["type"] == "message":
            items.append(self._event("response.content_part.added", item_id=item["id"], **self._where(),
                                     part={"type": "output_text", "text": "", "annotations": []}))
        return items

    def _where(self) -> dict[str, int]:
        return {"output_index": len(self.outputs) - 1, "content_index": 0}

    def _finish_open(self, status: str = "completed") -> list[Item]:
        """The open item's closing events; `status` "incomplete": the answer was cut while writing it (a call cut by
        max_output_tokens is never shown as one to run)."""
        output, self.open = self.open, None
        if output is None:
            return []
        item, text = output.item, "".join(output.text)
        where = self._where()
        items: list[Item] = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            item["content"] = [part]
            items += [self._event("response.output_text.done", item_id=item["id"], **where, text=text),
                      self._event("response.content_part.done", item_id=item["id"], **where, part=part)]
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            items.append(self._event("response.reasoning_text.done", item_id=item["id"], **where, text=text))
        else:
            item["arguments"] = text
            items.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=where["output_index"], name=item["name"], arguments=text))
        item["status"] = status
        return [*items, self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def on_event(self, index: int, event: DecodeEvent) -> list[Item]:
        if isinstance(event, Token):
            kind = "reasoning" if event.reasoning else "message"
            items = [] if self.open is not None and self.open.item["type"] == kind else self._add(
                _reasoning_item([]) if event.reasoning else _message_item([], "in_progress"))
            assert self.open is not None
            self.open.text.append(event.text)
            delta = "response.reasoning_text.delta" if event.reasoning else "response.output_text.delta"
            return [*items, self._event(delta, item_id=self.open.item["id"], **self._where(), delta=event.text)]
        if isinstance(event, CallStarted):
            return self._add(_call_item(ToolCall(event.id, event.name, ""), "in_progress",
                                        _namespaces(self.request.echo["tools"])))
        if isinstance(event, CallArguments):
            assert self.open is not None
            self.open.text.append(event.text)
            return [self._event("response.function_call_arguments.delta", item_id=self.open.item["id"],
                                output_index=len(self.outputs) - 1, delta=event.text)]
        status = "incomplete" if finish_reason(event.finish_reason).responses else "completed"
        items = self._finish_open(status)
        self._kept(event)
        return [*items, self._event(f"response.{status}", response=self._response(status, event))]

    def closing(self, dones: list[Done]) -> list[Item]:
        return []

    def failed(self, error: ApiError) -> list[Item]:
        return [self._event("error", code=error.code or error.kind, message=error.message, param=error.param)]

    def whole(self, dones: list[Done]) -> dict[str, Any]:
        done = dones[0]
        if done.reasoning:
            self.outputs.append(_Output(_reasoning_item([{"type": "reasoning_text", "text": done.reasoning}])))
        if done.text or not done.tool_calls:
            self.outputs.append(_Output(_message_item([{"type": "output_text", "text": done.text, "annotations": []}])))
        self.outputs += [_Output(_call_item(call, namespaces=_namespaces(self.request.echo["tools"])))
                         for call in done.tool_calls]
        status = "incomplete" if finish_reason(done.finish_reason).responses else "completed"
        if status == "incomplete" and self.outputs:  # the item the limit cut: never shown as whole (a call to run)
            self.outputs[-1].item["status"] = "incomplete"
        self._kept(done)
        return self._response(status, done)

    def _kept(self, done: Done) -> None:
        if self.request.store:
            self.keep(self.id, [*self.request.conversation,
                                Message("assistant", done.text, tool_calls=tuple(done.tool_calls))])


def _message_item(content: list[Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": content}


def _reasoning_item(content: list[Any]) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": content}


def _call_item(call: ToolCall, status: str = "completed", namespaces: frozenset[str] = frozenset()) -> dict[str, Any]:
    item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}
    namespace, namespaced, name = call.name.partition(NAMESPACED)
    if namespaced and namespace in namespaces:  # a namespace's tool: its own name, and its namespace
        item.update(name=name, namespace=namespace)
    return item


