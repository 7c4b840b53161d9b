"""The OpenAI wire format, both ways: a request body -> what the slots need (validated as `run` validates its
flags), and llmcli's events -> response objects and stream chunks. No HTTP here (llmcli/serve/app.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmcli.answer.constraint import build_constraint
from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.reasoning import opens_thinking
from llmcli.answer.sampling_config import WIRE_FIELDS, SamplingConfig
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.tool_calls import ToolCall, ToolSpec, new_call_id, tool_spec
from llmcli.chat.answerer import RenderedPrompt
from llmcli.chat.chat_template import Message
from llmcli.errors import LlmcliError
from llmcli.llama.schema_grammar import tool_grammar, with_grammar
from llmcli.settings import SETTINGS, check_value

# request fields -> llmcli settings: OpenAI's names, and llama-server's (llmcli's) for the rest
FIELDS = {wire: name for name, wire in WIRE_FIELDS.items()}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 16
# finish reasons as OpenAI clients know them (llmcli's own is in `timings.finish_reason`)
FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "context_full": "length",
          "repetition": "stop", "interrupted": "stop", "tool_calls": "tool_calls"}


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    n_ctx: int  # a slot's context: prompt + answer
    max_tokens: int  # the most tokens an answer may ask for
    max_body_bytes: int
    max_draft: int = 16  # tokens a draft may have (speculative decoding: the server's --speculate, --draft-max)


@dataclass(frozen=True)
class Parsed:
    tokens: list[int]
    generation: GenerationOptions
    seed: int
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Prompter:
    """How this server turns messages or a prompt into tokens (the model's template, its vocabulary)."""

    # messages, --think (None: as the server's), the tools
    render_chat: Callable[[list[Message], bool | None, ToolSpec | None], RenderedPrompt]
    tokenize: Callable[[str], list[int]]
    model_names: tuple[str, ...]  # what `model` may say (the first is the name /v1/models lists)
    defaults: Mapping[str, Any]  # the server's effective settings (its flags and config file)
    limits: Limits
    tool_format: str = "generic"  # how this model writes a call (its template's, or --tool-format)


def parse(body: Any, chat: bool, prompter: Prompter) -> Parsed:
    """A request body -> tokens and generation options; ApiError (400, 404) on anything invalid."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in prompter.model_names:
        raise ApiError(404, f"the model {model!r} does not exist here; this server has {prompter.model_names[0]!r}",
                       param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", param="n")
    tools = _tools(body, prompter.tool_format) if chat else None
    rendered = _render(body, chat, prompter, tools)
    values = dict(prompter.defaults)
    for name, setting_name in FIELDS.items():
        if body.get(name) is not None:
            values[setting_name] = _checked(setting_name, body[name], name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    room = prompter.limits.n_ctx - len(rendered.tokens)
    if max_tokens is not None:
        max_tokens = _checked("max_tokens", max_tokens, "max_tokens")
        if max_tokens > prompter.limits.max_tokens:
            raise ApiError(400, f"max_tokens is at most {prompter.limits.max_tokens} here", param="max_tokens")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise ApiError(400, f"the prompt ({len(rendered.tokens)} tokens) plus max_tokens ({max_tokens or 1}) do not fit "
                       f"the context of {prompter.limits.n_ctx} tokens", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    max_tokens = max_tokens or min(room, values["max_tokens"] or prompter.limits.max_tokens, prompter.limits.max_tokens)
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else stops if stops is not None else values["stop"]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    if tools is not None and tools.active and (body.get("grammar") is not None or body.get("response_format") not in (
            None, "text", {"type": "text"})):
        raise ApiError(400, "tools cannot be combined with grammar or response_format", param="tools")
    try:
        constraint = _constraint(body.get("response_format"), body.get("grammar"))
        sampling = SamplingConfig.from_settings(values, logit_bias=_logit_bias(body.get("logit_bias")),
                                                grammar=constraint.grammar, grammar_origin=constraint.origin)
    except LlmcliError as exc:
        raise ApiError(400, exc.message) from None
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    generation = GenerationOptions(sampling, max_tokens, tuple(stops), constraint, values["repetition_guard"],
                                   speculate=values["speculate"], max_draft=prompter.limits.max_draft,
                                   thinking_open=opens_thinking(rendered.text), tools=tools)
    return Parsed(rendered.tokens, generation, sampling.effective_seed(), bool(body.get("stream")),
                  bool(stream_options.get("include_usage")))


def _tools(body: Mapping[str, Any], tool_format: str) -> ToolSpec | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` as one spec (None without tools); 400 naming what is wrong."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of function tools", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    try:
        spec = tool_spec(tools, body.get("tool_choice"), tool_format, parallel)
        if not spec.tools and spec.choice.mode == "required":
            raise LlmcliError("tool_choice required needs tools")
        if spec.active:
            tool_grammar(spec)  # a schema no grammar can hold is this request's 400, not a failed slot
    except LlmcliError as exc:
        raise ApiError(400, exc.message, param="tool_choice" if "tool_choice" in exc.message else "tools") from None
    return spec


def _render(body: Mapping[str, Any], chat: bool, prompter: Prompter, tools: ToolSpec | None = None) -> RenderedPrompt:
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        return RenderedPrompt(prompt, prompter.tokenize(prompt))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    parsed = [_message(message, index) for index, message in enumerate(messages)]
    kwargs = body.get("chat_template_kwargs") or {}
    think = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if not isinstance(kwargs, dict) or not isinstance(think, (bool, type(None))):
        raise ApiError(400, "chat_template_kwargs must be an object; its enable_thinking true or false",
                       param="chat_template_kwargs")
    try:
        return prompter.render_chat(parsed, think, tools)
    except LlmcliError as exc:  # the template refused the conversation
        raise ApiError(400, exc.message, param="messages") from None


def _message(message: Any, index: int) -> Message:
    """One message of a chat request: a role, its text; an assistant's `tool_calls`, a tool's `tool_call_id`."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise ApiError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}", param="messages")
    calls = (message.get("tool_calls") or []) if role == "assistant" else []
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{index}].tool_calls must be a list", param="messages")
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            raise ApiError(400, f"messages[{index}].tool_calls: each is {{id, type, function: {{name, arguments}}}}",
                           param="messages")
        parsed_calls.append(ToolCall(str(call.get("id") or new_call_id()), name,
                                     arguments if isinstance(arguments, str) else json.dumps(arguments)))
    content = message.get("content")
    text = "" if content is None and role == "assistant" else _content(content, index)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ApiError(400, f"messages[{index}]: a tool message needs its tool_call_id", param="messages")
        name = message.get("name")
        return Message("tool", text, tool_call_id=call_id, name=name if isinstance(name, str) else None)
    return Message(ROLES[role], text, tool_calls=tuple(parsed_calls))


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts", param="messages")


def _checked(setting_name: str, value: Any, param: str) -> Any:
    setting = SETTINGS[setting_name]
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise ApiError(400, f"{param} must be true or false", param=param)
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (setting.kind is float or isinstance(value, int))
    if not ok:
        raise ApiError(400, f"{param} must be a number", param=param)
    value = float(value) if setting.kind is float else value
    try:
        check_value(setting, value, "request")
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace(setting.flag, param, 1), param=param) from None
    return setting.normalised(value)


def _constraint(response_format: Any, grammar: Any) -> Any:
    if grammar is not None and not isinstance(grammar, str):
        raise ApiError(400, "grammar must be a GBNF string", param="grammar")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind in (None, "text"):
        return with_grammar(build_constraint(grammar))
    if grammar is not None:
        raise ApiError(400, "grammar and response_format cannot be combined", param="grammar")
    if kind == "json_object":
        return with_grammar(build_constraint(json_format=True))
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be an object", param="response_format")
        return with_grammar(build_constraint(json_schema=json.dumps(schema)))
    raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must map token ids to numbers", param="logit_bias")
    try:
        biases = tuple((int(token), float(bias)) for token, bias in value.items())
    except (TypeError, ValueError):
        raise ApiError(400, "logit_bias must map token ids to numbers", param="logit_bias") from None
    if any(not -100 <= bias <= 100 for _, bias in biases):
        raise ApiError(400, "logit_bias values must be in [-100, 100]", param="logit_bias")
    return biases


# -- responses -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What every object of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    @staticmethod
    def new(chat: bool, model: str) -> Reply:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Reply(chat, model, prefix + uuid.uuid4().hex[:24], int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str, reasoning: bool = False, first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {**self._head(True), "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["reasoning_content" if reasoning else "content"] = text
        return {**self._head(True), "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    def call_chunk(self, event: CallStarted | CallArguments) -> dict[str, Any]:
        """A tool call's delta, as OpenAI streams it: index, id, type and name once, then pieces of the arguments."""
        call: dict[str, Any]
        if isinstance(event, CallStarted):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
        else:
            call = {"index": event.index, "function": {"arguments": event.text}}
        return {**self._head(True), "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}

    def last_chunk(self, done: Done) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(done.finish_reason, "stop")}
        if self.chat:
            choice["delta"] = {}
        else:
            choice.update(text="", logprobs=None)
        return {**self._head(True), "choices": [choice], "timings": timings(done)}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(done)}

    def whole(self, text: str, reasoning: str | None, done: Done) -> dict[str, Any]:
        finish = FINISH.get(done.finish_reason, "stop")
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text or (None if done.tool_calls else "")}
            if reasoning:
                message["reasoning_content"] = reasoning
            if done.tool_calls:
                message["tool_calls"] = [call.openai() for call in done.tool_calls]
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": usage(done), "timings": timings(done)}


def usage(done: Done) -> dict[str, Any]:
    stats = done.stats
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def timings(done: Done) -> dict[str, Any]:
    """llmcli's own record: every phase, the rates, and why the answer ended in llmcli's words."""
    invalid = [{"index": i, "id": c.id, "error": c.error} for i, c in enumerate(done.tool_calls) if c.error]
    return {**done.stats.to_dict(), "finish_reason": done.finish_reason, "stop_sequence": done.stop_sequence,
            "format_error": done.format_error, **({"tool_call_errors": invalid} if invalid else {})}


# -- embeddings ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddingRequest:
    texts: list[str]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI sends it
    dimensions: int | None


def parse_embeddings(body: Any, model_names: tuple[str, ...]) -> EmbeddingRequest:
    """An embeddings request: `input` a string or a list of strings; ApiError (400, 404) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in model_names:
        raise ApiError(404, f"the model {model!r} does not exist here; this server has {model_names[0]!r}",
                       param="model", code="model_not_found")
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input must be a string or a non-empty list of strings (token ids are not taken)",
                       param="input")
    if len(texts) > 2048:
        raise ApiError(400, "input holds at most 2048 texts", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise ApiError(400, "dimensions must be an integer", param="dimensions")
    return EmbeddingRequest(texts, encoding == "base64", dimensions)


def embeddings_reply(request: EmbeddingRequest, results: list[Any], model: str, n_embd: int) -> dict[str, Any]:
    """OpenAI's embeddings list; a text that cannot be embedded (too long, empty) is a 400 naming it."""
    import base64
    from array import array

    if request.dimensions is not None and request.dimensions != n_embd:
        raise ApiError(400, f"dimensions must be {n_embd} for this model (its vectors are not shortened)",
                       param="dimensions")
    data = []
    for index, result in enumerate(results):
        if result.vector is None:
            raise ApiError(400, f"input[{index}]: {result.error}", param="input",
                           code="context_length_exceeded" if result.too_long else None)
        vector: Any = result.vector
        if request.base64:
            packed = array("f", vector)
            if packed.itemsize != 4:  # pragma: no cover - every platform llama.cpp runs on has 4-byte floats
                raise ApiError(500, "no 32-bit float here", "server_error")
            vector = base64.b64encode(packed.tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(result.tokens for result in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
