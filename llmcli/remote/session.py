"""A conversation with a server (--endpoint): the `Answerer` a local Session is (events in, history kept), and the
requests of `run --batch` sent `parallel` at a time. Imports no llama.cpp."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llmcli.answer.answerer import ProgressCallback, PromptOptions, ResultCallback, oldest_exchange_end, with_system
from llmcli.answer.batch_jsonl import BatchItem, Summary
from llmcli.answer.constraint import GRAMMAR_FLAGS
from llmcli.answer.events import AnswerEvent, DecodeEvent, Done, Notice, Prefill, Token, TokenTrace, answer_record
from llmcli.answer.finish import REPETITION_NOTICE
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.image_bytes import read_image
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message, user_message
from llmcli.answer.openai_wire import ChunkReader, message_dict, sampling_fields, tool_fields
from llmcli.errors import LlmcliError, UsageError
from llmcli.interrupt import Cancellation
from llmcli.remote.client import Client, NetworkError

# What a server decides for itself: settings of a local model's engine, cache and context. Given for a run with
# --endpoint, they are named in a notice, never dropped without a word.
NOT_SENT = frozenset({"ctx_size", "threads", "batch_size", "mlock", "mmap", "speculate", "draft_model", "draft_max",
                      "flash_attn", "kv_type", "prompt_cache", "prompt_cache_min", "prompt_cache_size", "hub_timeout",
                      "on_overflow", "special", "mmproj"})
OWN_SERVER_SETTINGS = frozenset({"on_overflow"})  # of those, sent to llmcli serve (a warm server) in fields of its own


@dataclass(frozen=True)
class RemoteRequest:
    """What every request of a command carries: the model, the sampling settings, the answer's constraint."""

    model: str
    defaults: Mapping[str, Any]  # the built-in defaults: a setting equal to its default is not sent (but temp is)
    grammar: str | None = None
    json_schema: Mapping[str, Any] | None = None
    json_object: bool = False
    # OpenAI's {token id (as text): bias in [-100, 100]}, or, to llmcli serve, [[token id or text, bias or false]]
    logit_bias: Mapping[str, float] | list[list[Any]] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # sent as they are (a warm server's keep_alive)
    own_server: bool = False  # the server is llmcli serve (a warm server): its own fields are sent (on_overflow)
    grammar_origin: str | None = None  # the flag the grammar came from: llmcli serve's errors name it (own server)

    def body(self, generation: GenerationOptions, think: bool | None = None, chat: bool = True,
             on_overflow: str = "error") -> dict[str, Any]:
        # from this answer's options: chat's /set changes them between turns
        body: dict[str, Any] = {"model": self.model, **self.extra, **sampling_fields(generation, self.defaults)}
        if on_overflow == "truncate" and self.own_server:  # (llmcli serve's own field)
            body["on_overflow"] = on_overflow
        if generation.fit_history and chat and self.own_server:  # (chat: the oldest exchanges go, as in this process)
            body["fit_history"] = True
        if generation.trace is not None and self.own_server:  # --trace: each token's steps, in SSE comments
            body["trace"] = generation.trace
        if not generation.reasoning and self.own_server:  # --reasoning stdout: the think block stays in the text
            body["reasoning_format"] = "none"  # (llama-server's field, which llmcli serve takes)
        if self.logit_bias:
            body["logit_bias"] = self.logit_bias
        body.update(tool_fields(generation.tools))
        if think is not None:  # llama-server, vLLM and llmcli serve pass it to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": think}
        if generation.max_tokens:
            body["max_tokens"] = generation.max_tokens
        if generation.logprobs is not None:  # (chat: OpenAI's logprobs and top_logprobs; completions: logprobs: N)
            body.update({"logprobs": True, "top_logprobs": generation.logprobs} if chat else
                        {"logprobs": generation.logprobs})
        if generation.stops:
            body["stop"] = list(generation.stops)
        if self.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": self.json_schema}}
        elif self.json_object:
            body["response_format"] = {"type": "json_object"}
        elif self.grammar is not None:
            body["grammar"] = self.grammar
            if self.own_server and self.grammar_origin in GRAMMAR_FLAGS:
                body["grammar_origin"] = self.grammar_origin
        return body


class RemoteSession:
    """The `Answerer` over an endpoint: the server renders the template, fits the conversation and keeps the KV cache
    (no `local` part)."""

    local = None

    @property
    def not_sent(self) -> frozenset[str]:
        """The settings this server decides itself (a warm server, llmcli serve, takes OWN_SERVER_SETTINGS too)."""
        return NOT_SENT - OWN_SERVER_SETTINGS if self.request.own_server else NOT_SENT

    def __init__(self, client: Client, request: RemoteRequest, options: PromptOptions):
        self.client, self.request, self.options = client, request, options
        self.history: list[Message] = []
        self.notices: list[str] = []
        self.loaded: tuple[float, bool] | None = None  # a warm server's: (load_s, warm), said with the first answer

    @property
    def where(self) -> str:
        return self.client.endpoint.where

    def ask(self, user_text: str | None, options: GenerationOptions,
            stable_text: str | None = None, images: tuple[ImageInput, ...] = ()) -> Iterator[AnswerEvent]:
        """Answer `user_text` (and its images) after the history; the exchange joins the history when the answer is
        done."""
        for event in exchange(self, user_text, options, self.history, images):
            if isinstance(event, Done) and self.loaded is not None:
                (load_s, warm), self.loaded = self.loaded, (0.0, True)  # (the next answers find the model loaded)
                event = dataclasses.replace(event, stats=dataclasses.replace(event.stats, load_s=load_s, warm=warm))
            if isinstance(event, Done):
                for _ in range(event.dropped):  # (the server fitted the conversation: it goes on as it was answered)
                    del self.history[: oldest_exchange_end(self.history)]
                self.history += [*([user_message(user_text, images)] if user_text is not None else []),
                                 Message("assistant", event.text, tool_calls=event.tool_calls)]
            yield event
            if isinstance(event, Done) and event.finish_reason == "repetition":
                yield Notice(REPETITION_NOTICE)

    def close(self) -> None:
        self.client.close()

    def batch(self, items: list[BatchItem], generation: GenerationOptions, parallel: int, cancel: Cancellation,
              on_result: ResultCallback, on_progress: ProgressCallback | None = None) -> Summary:
        """Every item's answer, `parallel` requests at a time, each result as it finishes (any order). A server that
        cannot be reached stops the batch (NetworkError); a refused item is an error record."""
        started = time.perf_counter()
        summary = Summary(prompts=len(items), parallel=parallel, where=self.where)

        def one(item: BatchItem) -> dict[str, Any]:
            if item.error is not None:
                return item.error_record(item.error)
            try:
                images = tuple(read_image(reference) for reference in item.images)
                *events, done = exchange(self, item.prompt or "", generation, [], images)
            except NetworkError:
                raise
            except LlmcliError as exc:
                return item.error_record(exc.message)
            assert isinstance(done, Done)
            notices = [event.text for event in events if isinstance(event, Notice)]  # (the input truncated, -n capped)
            return {**item.extra, "index": item.index, **answer_record(done, notices)}

        finished = 0
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for item, result in zip(items, pool.map(one, items), strict=True):
                if "error" in result:
                    summary.errors += 1
                else:
                    usage = result["usage"]
                    summary.prompt_tokens += usage["prompt_tokens"]
                    summary.completion_tokens += usage["completion_tokens"]
                on_result(item.index, result)
                finished += 1
                if on_progress is not None:
                    elapsed = time.perf_counter() - started
                    on_progress(finished, len(items), summary.completion_tokens / elapsed if elapsed > 0 else 0.0)
        summary.wall_s = time.perf_counter() - started
        return summary


def exchange(session: RemoteSession, user_text: str | None, options: GenerationOptions,
             history: list[Message], images: tuple[ImageInput, ...] = ()) -> Iterator[DecodeEvent | Notice | Prefill |
                                                                                        TokenTrace]:
    """One request and its streamed answer, as events; the Done carries the whole answer."""
    started = time.perf_counter()
    chat = not session.options.raw
    body = session.request.body(options, session.options.think if chat else None, chat, session.options.on_overflow)
    if chat:
        new = [user_message(user_text, images)] if user_text is not None else []
        messages = with_system(session.options.system, [*history, *new])
        body["messages"] = [message_dict(m) for m in messages]
    elif images and not session.request.own_server:
        raise UsageError("images need a chat request: --raw sends text only")
    else:  # (llmcli serve takes a raw prompt's pictures in a field of its own: a warm run --raw --image)
        body["prompt"] = user_text or ""
        if images:
            body["images"] = [image.data_uri() for image in images]
    answer = ChunkReader(options.stops, started, options.tools)
    for chunk in session.client.stream("chat/completions" if chat else "completions", body):
        yield from answer.events(chunk, chat)
        if answer.stop is not None:
            break  # the rest is not needed: closing the stream tells the server to stop
    tail, done = answer.done(session.client.cancelled())
    if tail:
        yield Token(tail)
    for notice in answer.notices:
        yield Notice(notice)
    yield dataclasses.replace(done, format_error=options.constraint.problem(done.text, done.finish_reason))


def schema_of(json_schema: str | None) -> Mapping[str, Any] | None:
    """--json-schema's text (JSON, or a file holding it) as an object."""
    if json_schema is None:
        return None
    from llmcli.answer.constraint import build_constraint

    return build_constraint(json_schema=json_schema).schema or json.loads(json_schema)
