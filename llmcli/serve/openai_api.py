"""serve's side of OpenAI's chat and completions: a request body -> AnswerRequests (llmcli/serve/answer_request.py),
and llmcli's events -> response objects and stream chunks. The wire format itself — fields, messages, deltas, usage,
timings — is llmcli/answer/openai_wire.py's, which the --endpoint client reads with. No HTTP here."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.constraint import GRAMMAR_FLAGS
from llmcli.answer.events import DecodeEvent, Done, Prefill, Token, TokenLogprob, TokenTrace
from llmcli.answer.finish import finish_reason
from llmcli.answer.image_bytes import ImageError, decode_data
from llmcli.answer.images import MAX_IMAGES, ImageInput
from llmcli.answer.openai_wire import SAMPLING_FIELDS, WireError, call_delta, message_of, timings, usage
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.trace_wire import MAX_TRACE_TOP, trace_wire
from llmcli.serve.answer_request import AnswerRequest, ApiError, Parsed, Prompter
from llmcli.serve.request_fields import (
    check_fields,
    constraint_of,
    count_of,
    logit_bias_of,
    max_tokens_of,
    settings_of,
    stops_of,
    think_budget_of,
    tools_of,
    top_logprobs_of,
)
from llmcli.serve.wire import COMMENT, Item

MAX_PROMPTS = 16  # /v1/completions: prompts in one request (each takes a slot)
# Fields that cannot change a local answer, read and left on purpose: who asks, what to store, which tier, moderation,
# caching hints (this server caches every prompt in its slots), a verbosity hint, a predicted output (a speed-up only).
LEFT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "cache_prompt",
                  "prompt_cache_options", "prompt_cache_retention", "moderation", "verbosity", "prediction"})
# `keep_alive` (llmcli's and Ollama's): how long the model stays loaded after this request
# `on_overflow` (llmcli's: "truncate" drops the start of the last message until it fits, as run's --on-overflow)
# `grammar_origin` (llmcli's: the flag a warm run's grammar came from, for its errors' words)
# `reasoning_format` (llama-server's: "none" leaves a think block in the text, as run's --reasoning stdout)
# `fit_history` (llmcli's: a chat's oldest exchanges are dropped until it fits, as chat drops them; said in a comment)
# `trace` (llmcli's: N, a streamed answer's tokens traced with N candidates each, in SSE comments: run --trace)
SHARED = frozenset({"model", "stream", "stream_options", "n", "max_tokens", "stop", "logit_bias", "logprobs", "seed",
                    "grammar", "response_format", "keep_alive", "on_overflow", "grammar_origin", "reasoning_format",
                    "fit_history", "trace", *SAMPLING_FIELDS}) | LEFT
CHAT_FIELDS = SHARED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "modalities"}
COMPLETION_FIELDS = SHARED | {"prompt", "echo", "suffix", "best_of", "images"}  # images: llmcli's (a raw prompt's)
# Refused where honouring is impossible and ignoring would change what the client gets.
NOT_HERE = {"audio": "text only", "web_search_options": "no web search", "functions": "use tools",
            "function_call": "use tool_choice"}


def error_body(error: WireError) -> dict[str, Any]:
    """OpenAI's error object; llmcli's own error behind it (a prompt too long for the context) adds `llmcli_error`,
    its hint and exit code, which llmcli's client (a warm run, --endpoint) reports as an in-process run does."""
    found: dict[str, Any] = {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}
    cause = getattr(error, "cause", None)
    if cause is not None:
        found["llmcli_error"] = {"message": cause.message, "hint": cause.hint, "exit_code": int(cause.exit_code)}
    return {"error": found}


def parse_chat(body: Any, prompter: Prompter) -> list[AnswerRequest]:
    """A chat completions body -> one AnswerRequest; ApiError (400, 404) on anything invalid."""
    body = _common(body, prompter)
    check_fields(body, CHAT_FIELDS, NOT_HERE)
    if body.get("modalities") not in (None, ["text"]):
        raise ApiError(400, "modalities: this server answers with text only ([\"text\"])", param="modalities")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    kwargs = body.get("chat_template_kwargs") or {}
    think = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if not isinstance(kwargs, dict) or not isinstance(think, (bool, type(None))):
        raise ApiError(400, "chat_template_kwargs must be an object; its enable_thinking true or false",
                       param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise ApiError(400, "reasoning_effort must be none, minimal, low, medium or high", param="reasoning_effort")
        think = effort != "none" if think is None else think
    tools = tools_of(body.get("tools"), body.get("tool_choice"), prompter, body.get("parallel_tool_calls", True))
    if tools is not None and tools.active and (body.get("grammar") is not None or body.get("response_format") not in (
            None, "text", {"type": "text"})):
        raise ApiError(400, "tools cannot be combined with grammar or response_format", param="tools")
    fields = _answer_fields(body)
    fields["settings"] = {**think_budget_of(effort), **fields["settings"]}  # (an effort's budget: --think-budget)
    return [AnswerRequest(messages=[message_of(m, i) for i, m in enumerate(messages)], tools=tools, think=think,
                          logprobs=top_logprobs_of(body.get("logprobs"), body.get("top_logprobs")), **fields)]


def parse_completion(body: Any, prompter: Prompter) -> list[AnswerRequest]:
    """A completions body -> one AnswerRequest per prompt (a string, token ids, or a list of either)."""
    body = _common(body, prompter)
    check_fields(body, COMPLETION_FIELDS, NOT_HERE)
    if body.get("best_of", 1) != 1:
        raise ApiError(400, "best_of must be 1: one answer per prompt", param="best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            _is_id(t) for t in p)) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of either",
                       param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt holds at most {MAX_PROMPTS} prompts", param="prompt")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "echo must be true or false", param="echo")
    if body.get("suffix") is not None:
        raise ApiError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix")
    logprobs = body.get("logprobs")
    n_top = None if logprobs is None else count_of(logprobs, "logprobs")
    scoring = echo and n_top is not None  # (the prompt's own logprobs: each position of it evaluated again)
    only_scored = echo and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None
    fields = _answer_fields({**body, "max_tokens": None} if only_scored else body)
    if only_scored:
        fields["max_tokens"] = 0
    if scoring and fields["stream"]:
        raise ApiError(400, "echo with logprobs is answered whole (stream false): the prompt's logprobs come with it",
                       param="echo")
    images = _raw_images(body.get("images"), prompts)
    if echo and images:
        raise ApiError(400, "echo takes a prompt without images", param="echo")
    return [AnswerRequest(prompt=p, logprobs=n_top, prompt_logprobs=n_top if scoring else None, prompt_param="prompt",
                          images=images, echo=echo, **fields) for p in prompts]


def _raw_images(given: Any, prompts: list[Any]) -> tuple[ImageInput, ...]:
    """llmcli's own `images` of a completions request (a warm `run --raw --image`): data URIs, for one text prompt."""
    if given is None:
        return ()
    if not isinstance(given, list) or not all(isinstance(image, str) for image in given) or len(given) > MAX_IMAGES:
        raise ApiError(400, f"images must be a list of at most {MAX_IMAGES} data URIs", param="images")
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise ApiError(400, "images go with one text prompt", param="images")
    try:
        return tuple(decode_data(image, f"images[{index}]") for index, image in enumerate(given))
    except ImageError as exc:
        raise ApiError(400, exc.message, param="images") from None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _common(body: Any, prompter: Prompter) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompter.check_model(body.get("model"))
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", param="n")
    return body


def _answer_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """What chat and completions share: sampling settings, the limit, stops, the format, the stream."""
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind not in (None, "text", "json_object", "json_schema"):
        raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    schema = (response_format.get("json_schema") or {}).get("schema") if isinstance(response_format, dict) else None
    if kind == "json_schema" and not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be an object", param="response_format")
    constraint = constraint_of("json" if kind == "json_object" else kind, schema, body.get("grammar"))
    on_overflow = body.get("on_overflow", "error")
    if on_overflow not in ("error", "truncate"):
        raise ApiError(400, "on_overflow must be error or truncate", param="on_overflow")
    grammar_origin = body.get("grammar_origin")
    if grammar_origin is not None and grammar_origin not in GRAMMAR_FLAGS:
        raise ApiError(400, f"grammar_origin must be one of {', '.join(GRAMMAR_FLAGS)}", param="grammar_origin")
    reasoning_format = body.get("reasoning_format")  # (llama-server's: "none" leaves a think block in the text)
    if reasoning_format not in (None, "none", "auto", "deepseek"):
        raise ApiError(400, "reasoning_format must be none, auto or deepseek", param="reasoning_format")
    trace = body.get("trace")
    if trace is not None and (not isinstance(trace, int) or isinstance(trace, bool) or not 1 <= trace <= MAX_TRACE_TOP):
        raise ApiError(400, f"trace must be an integer in [1, {MAX_TRACE_TOP}]", param="trace")
    if trace is not None and not body.get("stream"):
        raise ApiError(400, "trace comes in a stream's comments: stream true", param="trace")
    return dict(settings=settings_of(body, SAMPLING_FIELDS), on_overflow=on_overflow, grammar_origin=grammar_origin,
                trace=trace,
                split_reasoning=reasoning_format != "none", fit_history=body.get("fit_history") is True,
                max_tokens=max_tokens_of(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens"),
                stops=stops_of(body.get("stop")), constraint=constraint, logit_bias=logit_bias_of(body.get("logit_bias")),
                stream=bool(body.get("stream")), include_usage=bool(stream_options.get("include_usage")))


# -- responses -------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One chat or completions response, whole or streamed (one choice per prompt)."""

    chat: bool
    model: str
    requests: list[AnswerRequest]
    id: str = ""
    created: int = 0
    notices: list[tuple[str, ...]] = field(default_factory=list)  # each choice's (Parsed.notices): in its timings
    prompt_tokens: list[int] = field(default_factory=list)  # each choice's prompt, said with its first chunk
    dropped: list[int] = field(default_factory=list)  # each choice's exchanges dropped to fit (fit_history): said too
    announced: set[int] = field(default_factory=set)  # choices whose first chunk said its prompt's tokens
    started: set[int] = field(default_factory=set)  # choices whose first chunk (with the role) went out
    offsets: dict[int, int] = field(default_factory=dict)  # completions' logprobs: text offset per choice
    echoes: list[Echo] = field(default_factory=list)  # completions' `echo`: each choice's prompt (empty: none)
    echoed: set[int] = field(default_factory=set)  # choices whose echoed prompt went out (a stream's first chunk)

    @staticmethod
    def new(chat: bool, model: str, requests: list[AnswerRequest], prepared: list[Parsed] | None = None,
            prompter: Prompter | None = None) -> Reply:
        prefix = "chatcmpl-" if chat else "cmpl-"
        echoes = [Echo.of(request, parsed, prompter) for request, parsed in zip(requests, prepared, strict=True)] \
            if prompter is not None and prepared and any(request.echo for request in requests) else []
        return Reply(chat, model, requests, prefix + uuid.uuid4().hex[:24], int(time.time()),
                     notices=[p.notices for p in prepared or ()], prompt_tokens=[len(p.tokens) for p in prepared or ()],
                     dropped=[p.dropped for p in prepared or ()], echoes=echoes)

    def _timings(self, index: int, done: Done) -> dict[str, Any]:
        notices = self.notices[index] if index < len(self.notices) else ()
        return {**timings(done), **({"notices": list(notices)} if notices else {})}

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> Item:
        return None, {**self._head(True), "choices": [choice]}

    def _announced(self, index: int) -> list[Item]:
        """Before a choice's first chunk, an SSE comment with its prompt's tokens (clients skip it; llmcli's reads
        it: an answer cut short by Ctrl-C still tells how long its prompt was). Not in `timings`: a client reads that
        as the finished answer's."""
        if index in self.announced or index >= len(self.prompt_tokens):
            return []
        self.announced.add(index)
        dropped = self.dropped[index] if index < len(self.dropped) else 0
        return [*([(COMMENT, f"dropped {dropped}")] if dropped else []),
                (COMMENT, f"prompt_tokens {self.prompt_tokens[index]}")]

    def opening(self) -> list[Item]:
        return []

    def keepalive(self) -> list[Item]:
        return [(COMMENT, "keep-alive")]  # OpenAI's clients skip SSE comments

    def trace(self, index: int, event: TokenTrace) -> list[Item]:
        """A traced token (llmcli's own `trace` field), as an SSE comment: `trace {…}` (llmcli/answer/trace_wire.py)."""
        return [(COMMENT, "trace " + json.dumps(trace_wire(event), separators=(",", ":")))]

    def progress(self, event: Prefill) -> list[Item]:
        """A long prompt's progress, as an SSE comment (clients skip it; llmcli's reads it: a warm run's progress
        line): `prefill EVALUATED/TOTAL PROMPT`."""
        return [(COMMENT, f"prefill {event.evaluated}/{event.total} {event.prompt}")]

    def _echoed(self, index: int) -> list[Item]:
        """A streamed completion's echoed prompt: its own chunk, before the answer's first (echo with logprobs is
        answered whole)."""
        if index in self.echoed or index >= len(self.echoes) or not self.echoes[index].text:
            return []
        self.echoed.add(index)
        return [self._chunk({"index": index, "text": self.echoes[index].text, "logprobs": None, "finish_reason": None})]

    def on_event(self, index: int, event: DecodeEvent) -> list[Item]:
        wants_logprobs = self.requests[index].logprobs is not None
        if isinstance(event, Token):
            if not self.chat:
                logprobs = self._completion_logprobs(index, event.logprobs) if wants_logprobs else None
                return [*self._announced(index), *self._echoed(index),
                        self._chunk({"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None})]
            delta = self._delta(index)
            delta["reasoning_content" if event.reasoning else "content"] = event.text
            choice = {"index": index, "delta": delta, "finish_reason": None}
            if wants_logprobs and not event.reasoning:
                choice["logprobs"] = {"content": [lp.to_dict() for lp in event.logprobs]}
            return [*self._announced(index), self._chunk(choice)]
        if isinstance(event, (CallStarted, CallArguments)):
            return [*self._announced(index), self._chunk({"index": index, "delta": {**self._delta(index),
                                                                                   "tool_calls": [call_delta(event)]},
                                 "finish_reason": None})]
        last: dict[str, Any] = {"index": index, "finish_reason": finish_reason(event.finish_reason).openai}
        if self.chat:
            last["delta"] = {}
        else:
            last.update(text="", logprobs=None)
        return [*self._echoed(index), (None, {**self._head(True), "choices": [last], "timings": self._timings(index, event)})]

    def _delta(self, index: int) -> dict[str, Any]:
        """The role comes with a choice's first chunk, as OpenAI sends it."""
        if index in self.started:
            return {}
        self.started.add(index)
        return {"role": "assistant"}

    def closing(self, dones: list[Done]) -> list[Item]:
        usage_chunk = [(None, {**self._head(True), "choices": [], "usage": usage(dones)})]
        return (usage_chunk if self.requests[0].include_usage else []) + [(None, "[DONE]")]

    def failed(self, error: ApiError) -> list[Item]:
        return [(None, error_body(error)), (None, "[DONE]")]

    def whole(self, dones: list[Done]) -> dict[str, Any]:
        choices = []
        for index, done in enumerate(dones):
            finish = finish_reason(done.finish_reason).openai
            wants_logprobs = self.requests[index].logprobs is not None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": done.text or (None if done.tool_calls else "")}
                if done.reasoning:
                    message["reasoning_content"] = done.reasoning
                if done.tool_calls:
                    message["tool_calls"] = [call.openai() for call in done.tool_calls]
                logprobs = {"content": [lp.to_dict() for lp in done.logprobs]} if wants_logprobs else None
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                echo = self.echoes[index] if index < len(self.echoes) else Echo()
                self.offsets[index] = len(echo.text)
                logprobs = self._completion_logprobs(index, done.logprobs) if wants_logprobs else None
                if logprobs is not None and echo.first_piece is not None:
                    logprobs = _joined(echo.logprobs(done.prompt_logprobs), logprobs)
                choices.append({"index": index, "text": echo.text + done.text, "logprobs": logprobs,
                                "finish_reason": finish})
        return {**self._head(False), "choices": choices, "usage": usage(dones), "timings": self._timings(0, dones[0])}

    def _completion_logprobs(self, index: int, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """The legacy completions shape: parallel lists, the alternatives as {token: logprob}."""
        offsets = []
        for logprob in logprobs:
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(logprob.text)
        return {"tokens": [lp.text for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{piece.decode("utf-8", "replace"): value for _, piece, value in lp.top}
                                 for lp in logprobs], "text_offset": offsets}


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt (OpenAI's legacy `echo`): its text — the prompt as given, or its token ids as
    text — and, when its tokens were scored, the first token's piece (it has no logprob: nothing comes before it)."""

    text: str = ""
    first_piece: str | None = None

    @staticmethod
    def of(request: AnswerRequest, parsed: Parsed, prompter: Prompter) -> Echo:
        if not request.echo:
            return Echo()
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else prompter.detokenize(list(prompt or ()), True)
        first = prompter.detokenize(parsed.tokens[:1], False) if request.prompt_logprobs is not None else None
        return Echo(text, first)

    def logprobs(self, scored: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """The prompt's part of the legacy logprobs: its first token (no logprob), then each scored one; offsets
        into the echoed text (a piece written nowhere in it, a BOS the tokenizer added, takes no room)."""
        pieces = [self.first_piece or "", *(lp.text for lp in scored)]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(min(at, len(self.text)))
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": [None, *(lp.logprob for lp in scored)],
                "top_logprobs": [None, *({p.decode("utf-8", "replace"): v for _, p, v in lp.top} for lp in scored)],
                "text_offset": offsets}


def _joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}
