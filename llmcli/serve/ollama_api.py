"""Ollama's API (https://github.com/ollama/ollama/blob/main/docs/api.md), both ways: /api/chat and /api/generate
bodies -> AnswerRequests, llmcli's events -> its NDJSON lines and whole replies; the model lists (/api/tags, /api/ps,
/api/show) from the model's facts; embeddings' bodies. Durations are nanoseconds, as Ollama reports them. No HTTP.

Taken as Ollama takes them: `options` (num_predict, temperature, top_k, top_p, min_p, typical_p, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty, seed, stop, mirostat…), `format` ("json" or a JSON schema),
`system`, `raw`, `think`, `tools` (calls come back in `message.tool_calls`, their arguments an object), `logprobs`.
Read and left to the server: `keep_alive` (one model, always loaded), the load options (num_ctx within the server's
context, num_thread, num_gpu, num_batch, use_mmap…). Refused, saying so: `suffix`, `template`, `context`. `images`
(base64) are read. /api/pull and the routes that change Ollama's store: llmcli/serve/ollama_store_api.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from llmcli.answer.events import DecodeEvent, Done, Token
from llmcli.answer.finish import finish_reason
from llmcli.answer.images import MAX_IMAGES, ImageInput
from llmcli.answer.message import Message, user_message
from llmcli.answer.openai_wire import WireError, image_from
from llmcli.answer.tool_calls import ToolCall
from llmcli.serve.answer_request import AnswerRequest, ApiError, Prompter
from llmcli.serve.model_facts import ModelFacts
from llmcli.serve.request_fields import (
    check_fields,
    checked,
    constraint_of,
    stops_of,
    think_budget_of,
    tools_of,
    top_logprobs_of,
)
from llmcli.serve.wire import Item

VERSION = "0.13.3"  # the Ollama API level these routes follow (clients check it)
ROLES = ("system", "user", "assistant", "tool")
# options -> llmcli settings
OPTIONS = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
           "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "seed": "seed", "mirostat": "mirostat",
           "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
# options that choose how a model is loaded: the server loaded it already, so they are read and left
LOAD_OPTIONS = frozenset({"num_ctx", "num_thread", "num_gpu", "main_gpu", "num_batch", "num_keep", "use_mmap", "use_mlock",
                          "low_vram", "numa", "vocab_only", "f16_kv", "logits_all", "penalize_newline", "tfs_z"})
LEFT = frozenset({"keep_alive"})  # one model, always loaded
CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream", "think", "logprobs",
                         "top_logprobs"}) | LEFT
GENERATE_FIELDS = frozenset({"model", "prompt", "suffix", "images", "format", "options", "system", "template",
                             "stream", "raw", "context", "think", "logprobs", "top_logprobs"}) | LEFT
IMAGE_GENERATION = {name: "no image generation (a text model)" for name in ("width", "height", "steps")}
EMBED_FIELDS = frozenset({"model", "input", "prompt", "truncate", "options", "dimensions"}) | LEFT


def error_body(error: WireError) -> dict[str, Any]:
    return {"error": error.message}


def _model(body: Any, prompter: Prompter) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required")
    prompter.check_model(model.removesuffix(":latest"), lambda name: f"model '{model}' not found")
    return body


def loads_only(body: Any, key: str) -> bool:
    """An empty prompt (or no messages): Ollama's way to load a model and answer nothing."""
    return isinstance(body, dict) and not body.get(key)


def parse_chat(body: Any, prompter: Prompter) -> list[AnswerRequest]:
    body = _model(body, prompter)
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list")
    tools = tools_of(body.get("tools"), None, prompter)
    if tools is not None and tools.active and body.get("format") not in (None, ""):
        raise ApiError(400, "tools cannot be combined with format")
    return [AnswerRequest(messages=_messages(messages), tools=tools, **_answer_fields(body))]


def parse_generate(body: Any, prompter: Prompter) -> list[AnswerRequest]:
    body = _model(body, prompter)
    check_fields(body, GENERATE_FIELDS, IMAGE_GENERATION)
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string")
    for key, why in (("suffix", "no fill-in-the-middle"), ("template", "the model's own chat template is used"),
                     ("context", "send the conversation to /api/chat instead")):
        if body.get(key):
            raise ApiError(400, f"{key} is not supported ({why})")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise ApiError(400, "system must be a string")
    fields = _answer_fields(body)
    images = _images(body.get("images"), "images")
    if body.get("raw"):  # (pictures in a raw prompt: where its markers are, else after its text, as run --raw does)
        return [AnswerRequest(prompt=(system or "") + prompt, prompt_param="prompt", images=images, **fields)]
    messages = ([Message("system", system)] if system else []) + [user_message(prompt, images)]
    return [AnswerRequest(messages=messages, prompt_param="prompt", **fields)]


def _images(given: Any, where: str) -> tuple[ImageInput, ...]:
    """Ollama's `images`: a list of base64 images (a message's, or /api/generate's)."""
    if given in (None, []):
        return ()
    if not isinstance(given, list) or not all(isinstance(image, str) for image in given):
        raise ApiError(400, f"{where} must be a list of base64 images")
    if len(given) > MAX_IMAGES:
        raise ApiError(400, f"{where}: {len(given)} images; a prompt takes at most {MAX_IMAGES}")
    return tuple(image_from(image, f"{where}[{index}]", where) for index, image in enumerate(given))


def _answer_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    unknown = sorted(set(options) - set(OPTIONS) - LOAD_OPTIONS - {"num_predict", "stop"})
    if unknown:
        raise ApiError(400, f"unknown option {unknown[0]!r}")
    settings = {OPTIONS[key]: checked(OPTIONS[key], value, key) for key, value in options.items()
                if key in OPTIONS and value is not None}
    predict = options.get("num_predict")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool) or predict < -2):
        raise ApiError(400, "num_predict must be an integer (-1: no limit, -2: fill the context)")
    think = body.get("think")
    if think is not None and not isinstance(think, (bool, str)):
        raise ApiError(400, "think must be true, false, or high, medium or low")
    settings = {**think_budget_of(think), **settings}  # a level's thinking budget (--think-budget)
    return dict(settings=settings, max_tokens=predict if predict is not None and predict > 0 else None,
                stops=stops_of(options.get("stop"), "options.stop"), constraint=_format(body.get("format")),
                think=bool(think) if think is not None else None, stream=body.get("stream", True) is not False,
                logprobs=top_logprobs_of(body.get("logprobs"), body.get("top_logprobs")),
                limit_param="num_predict")


def _format(value: Any) -> Any:
    if value in (None, ""):
        return constraint_of(None)
    if value == "json":
        return constraint_of("json", param="format")
    if isinstance(value, dict):
        return constraint_of("json_schema", value, param="format")
    raise ApiError(400, 'format must be "json" or a JSON schema')


def _messages(messages: list[Any]) -> list[Message]:
    """Ollama's messages: a call's arguments are an object, and a tool's result names the tool, not the call (each
    result answers the earliest call of its tool not yet answered)."""
    parsed: list[Message] = []
    unanswered: list[ToolCall] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}")
        images = _images(message.get("images"), f"{where}.images") if message.get("role") == "user" else ()
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string")
        role = message["role"]
        if role == "assistant":
            calls = tuple(_call(call, f"{where}.tool_calls[{i}]", len(parsed), i)
                          for i, call in enumerate(message.get("tool_calls") or []))
            unanswered.extend(calls)
            parsed.append(Message("assistant", content, tool_calls=calls))
        elif role == "tool":
            name = message.get("tool_name") or message.get("name")
            answered = next((c for c in unanswered if name in (None, c.name)), None)
            if answered is not None:
                unanswered.remove(answered)
            parsed.append(Message("tool", content, tool_call_id=answered.id if answered else f"call_{index}",
                                  name=name if isinstance(name, str) else (answered.name if answered else None)))
        else:
            parsed.append(user_message(content, images) if images else Message(role, content))
    return parsed


def _call(call: Any, where: str, message_index: int, index: int) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        raise ApiError(400, f"{where} is {{function: {{name, arguments}}}}")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(str(call.get("id") or f"call_{message_index}_{index}"), name, text)


# -- replies ---------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def durations(done: Done) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds) from llmcli's timings."""
    stats = done.stats
    ns = 1_000_000_000
    return {"done_reason": finish_reason(done.finish_reason).ollama, "total_duration": int(stats.total_s * ns),
            "load_duration": int(stats.load_s * ns), "prompt_eval_count": stats.prompt_tokens,
            "prompt_eval_duration": int(stats.prefill_s * ns), "eval_count": stats.completion_tokens,
            "eval_duration": int(max(0.0, stats.total_s - stats.prompt_s - stats.prefill_s) * ns)}


@dataclass
class OllamaReply:
    """One /api/chat (`chat`) or /api/generate reply: NDJSON lines as the answer grows, or one object."""

    chat: bool
    model: str
    requests: list[AnswerRequest]

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    def _line(self, text: str = "", thinking: str | None = None, **more: Any) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            line["message"] = {"role": "assistant", "content": text,
                               **({"thinking": thinking} if thinking is not None else {})}
        else:
            line["response"] = text
            if thinking is not None:
                line["thinking"] = thinking
        return {**line, "done": False, **more}

    def opening(self) -> list[Item]:
        return []

    def keepalive(self) -> list[Item]:
        return []  # NDJSON has no line a client would skip: Ollama's own server sends nothing either

    def on_event(self, index: int, event: DecodeEvent) -> list[Item]:
        if isinstance(event, Token):
            line = self._line("", event.text) if event.reasoning else self._line(event.text)
            if self.requests[0].logprobs is not None:
                line["logprobs"] = [lp.to_dict() for lp in event.logprobs]
            return [(None, line)]
        if not isinstance(event, Done):
            return []  # a call is sent whole, once the answer is done (as Ollama sends it)
        lines: list[Item] = []
        if _whole_calls(event) and self.chat:
            line = self._line()
            line["message"]["tool_calls"] = [_call_object(call, i) for i, call in enumerate(_whole_calls(event))]
            lines.append((None, line))
        return [*lines, (None, {**self._line(), "done": True, **durations(event)})]

    def closing(self, dones: list[Done]) -> list[Item]:
        return []

    def failed(self, error: ApiError) -> list[Item]:
        return [(None, error_body(error))]

    def whole(self, dones: list[Done]) -> dict[str, Any]:
        done = dones[0]
        reply = self._line(done.text, done.reasoning, done=True, **durations(done))
        if _whole_calls(done) and self.chat:
            reply["message"]["tool_calls"] = [_call_object(call, i) for i, call in enumerate(_whole_calls(done))]
        if self.requests[0].logprobs is not None:
            reply["logprobs"] = [lp.to_dict() for lp in done.logprobs]
        return reply


def _whole_calls(done: Done) -> tuple[ToolCall, ...]:
    """The calls a client may run: one cut off by the limit (or otherwise broken) has no object for its arguments
    in Ollama's shape, and Ollama's clients run every call listed — it is left out, and `done_reason: "length"` says
    the answer was cut (Ollama's own server lists only the calls it parsed whole)."""
    return tuple(call for call in done.tool_calls if call.error is None)


def _call_object(call: ToolCall, index: int) -> dict[str, Any]:
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.arguments_value()}}


def loaded_reply(chat: bool, model: str) -> dict[str, Any]:
    """The reply to an empty prompt: the model is loaded (it always is here)."""
    head: dict[str, Any] = {"model": model, "created_at": _now()}
    head.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return {**head, "done": True, "done_reason": "load"}


# -- the model lists ---------------------------------------------------------------------------------------


def _details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": facts.architecture, "families": [facts.architecture],
            "parameter_size": facts.parameter_size, "quantization_level": facts.quant}


def _entry(facts: ModelFacts) -> dict[str, Any]:
    tagged = ":" in facts.name.rsplit("/", 1)[-1]  # a Hub model's quant is its tag (owner/repo:Q4_K_M), as Ollama's
    name = facts.name if tagged else f"{facts.name}:latest"
    return {"name": name, "model": name, "size": facts.size, "digest": facts.digest, "details": _details(facts)}


def tags(models: list[ModelFacts]) -> dict[str, Any]:
    """/api/tags: every model a request may name."""
    return {"models": [{**_entry(facts), "modified_at": datetime.fromtimestamp(facts.modified, timezone.utc).isoformat()}
                       for facts in models]}


def running(models: list[tuple[ModelFacts, float | None]]) -> dict[str, Any]:
    """/api/ps: the models loaded now, and when each will be unloaded (None: never)."""
    def expiry(seconds: float | None) -> str:
        if seconds is None:
            return "9999-12-31T23:59:59Z"
        return datetime.fromtimestamp(time.time() + seconds, timezone.utc).isoformat().replace("+00:00", "Z")

    return {"models": [{**_entry(facts), "expires_at": expiry(seconds), "size_vram": 0, "context_length": facts.n_ctx}
                       for facts, seconds in models]}


def show(body: Any, facts: ModelFacts) -> dict[str, Any]:
    """/api/show: what the header says (the server's own settings are the defaults of every request)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    info = {**facts.metadata, "general.architecture": facts.architecture, "general.parameter_count": facts.parameters}
    parameters = f"num_ctx {facts.n_ctx}" if facts.n_ctx else ""  # a loaded model's context here, as Ollama says it
    return {"modelfile": f"FROM {facts.path}\n", "parameters": parameters, "template": facts.template,
            "details": _details(facts), "model_info": info, "capabilities": list(facts.capabilities),
            "modified_at": datetime.fromtimestamp(facts.modified, timezone.utc).isoformat()}


def parse_embed(body: Any, prompter: Prompter, legacy: bool) -> tuple[list[str], bool]:
    """/api/embed (`input`: a string or strings; `truncate`, default true) or the older /api/embeddings (`prompt`):
    the texts, and whether a text too long is cut to fit."""
    body = _model(body, prompter)
    check_fields(body, EMBED_FIELDS)
    given = body.get("prompt" if legacy else "input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts) or (not texts and legacy):
        raise ApiError(400, "prompt must be a string" if legacy else "input must be a string or a list of strings")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ApiError(400, "truncate must be true or false")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        raise ApiError(400, "dimensions is not supported (the model's vectors are not shortened)")
    return texts, truncate


def embed_reply(model: str, results: list[Any], seconds: float, legacy: bool) -> dict[str, Any]:
    for index, result in enumerate(results):
        if result.vector is None:
            raise ApiError(400, f"input[{index}]: {result.error}")
    if legacy:
        return {"embedding": list(results[0].vector)}
    ns = int(seconds * 1e9)
    return {"model": model, "embeddings": [list(r.vector) for r in results], "total_duration": ns,
            "load_duration": 0, "prompt_eval_count": sum(r.tokens for r in results)}


