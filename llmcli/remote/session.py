"""A conversation with a remote engine: the same `ask` as a local Session (events in, history kept), and the
requests of `run --batch` sent `parallel` at a time."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llmcli.chat.session import PromptOptions, with_system
from llmcli.chat.templates import Message
from llmcli.errors import LlmcliError, UsageError
from llmcli.inference.batch_input import BatchItem
from llmcli.inference.events import Done, Notice, Token, answer_record
from llmcli.inference.generation import GenerationOptions
from llmcli.remote.client import Client, NetworkError, StreamedAnswer

# llmcli settings -> the request fields OpenAI-compatible servers read (llama-server, vLLM and llmcli serve take
# top_k, min_p and repeat_penalty too; OpenAI itself ignores what it does not know)
FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
          "repeat_penalty": "repeat_penalty", "seed": "seed"}


@dataclass(frozen=True)
class RemoteRequest:
    """What every request of a command carries: the model, the sampling settings, the answer's constraint."""

    model: str
    defaults: Mapping[str, Any]  # the built-in defaults: a setting equal to its default is not sent (but temp is)
    grammar: str | None = None
    json_schema: Mapping[str, Any] | None = None
    json_object: bool = False

    def body(self, generation: GenerationOptions) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        for name, field in FIELDS.items():  # from this answer's sampling: chat's /set changes it between turns
            value = getattr(generation.sampling, name)
            if value is not None and (value != self.defaults.get(name) or name == "temp"):
                body[field] = value
        if generation.max_tokens:
            body["max_tokens"] = generation.max_tokens
        if generation.stops:
            body["stop"] = list(generation.stops)
        if self.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": self.json_schema}}
        elif self.json_object:
            body["response_format"] = {"type": "json_object"}
        elif self.grammar is not None:
            body["grammar"] = self.grammar
        return body


class RemoteSession:
    """`Session`'s interface over an endpoint: the server renders the template and keeps the KV cache."""

    engine = None  # no local engine: nothing to fit or shift here (the server says when it does not fit)
    template = None
    prompt_cache = None
    remote = True

    def __init__(self, client: Client, request: RemoteRequest, options: PromptOptions):
        self.client, self.request, self.options = client, request, options
        self.history: list[Message] = []
        self.notices: list[str] = []
        self.last_reasoning: str | None = None

    @property
    def raw(self) -> bool:
        return self.options.raw

    def ask(self, user_text: str, options: GenerationOptions, stable_text: str | None = None) -> Iterator[Token | Done | Notice]:
        """Answer `user_text` after the history; the exchange joins the history when the answer is done."""
        exchange = Exchange()
        yield from exchange.run(self, user_text, options, self.history)
        self.last_reasoning = exchange.reasoning
        self.history += [Message("user", user_text), Message("assistant", exchange.content)]

    def render(self, user_text: str) -> Any:
        raise UsageError("the prompt is rendered by the server with --endpoint: --show-prompt is not available")

    def answer_room(self, max_tokens: int | None) -> int:
        return max_tokens or 0

    def shift_for(self, user_text: str) -> None:
        return None

    def resume(self) -> int:
        return 0

    def keep_state(self) -> None:
        return None

    def take_notices(self) -> list[str]:
        return []


class Exchange:
    """One request and its streamed answer: the events, and what they add up to."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thought: list[str] = []

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning(self) -> str | None:
        return "".join(self.thought).strip() or None

    def run(self, session: RemoteSession, user_text: str, options: GenerationOptions,
            history: list[Message]) -> Iterator[Token | Done]:
        started = time.perf_counter()
        chat = not session.options.raw
        body = session.request.body(options)
        if chat:
            messages = with_system(session.options.system, [*history, Message("user", user_text)])
            body["messages"] = [{"role": m.role, "content": m.content} for m in messages]
        else:
            body["prompt"] = user_text
        answer = StreamedAnswer(options.stops, started)
        for chunk in session.client.stream("chat/completions" if chat else "completions", body):
            for event in answer.events(chunk, chat):
                (self.thought if event.reasoning else self.text).append(event.text)
                yield event
            if answer.stop is not None:
                break  # the rest is not needed: closing the stream tells the server to stop
        tail, done = answer.done(session.client.cancelled())
        if tail:
            self.text.append(tail)
            yield Token(tail)
        yield dataclasses.replace(done, format_error=options.constraint.problem(self.content, done.finish_reason))


def batch(session: RemoteSession, items: list[BatchItem], generation: GenerationOptions, parallel: int,
          on_result: Callable[[int, dict[str, Any]], None]) -> tuple[int, int]:
    """Every item's answer, `parallel` requests at a time, each result as it finishes (any order); (answered,
    errors). A server that cannot be reached stops the batch (NetworkError); a refused item is an error record."""

    def one(item: BatchItem) -> dict[str, Any]:
        if item.error is not None:
            return item.error_record(item.error)
        exchange = Exchange()
        try:
            *_, done = exchange.run(session, item.prompt or "", generation, [])
        except NetworkError:
            raise
        except LlmcliError as exc:
            return item.error_record(exc.message)
        assert isinstance(done, Done)
        return {**item.extra, "index": item.index, **answer_record(exchange.content, done, reasoning=exchange.reasoning)}

    errors = 0
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for item, result in zip(items, pool.map(one, items), strict=True):
            errors += "error" in result
            on_result(item.index, result)
    return len(items), errors


def schema_of(json_schema: str | None) -> Mapping[str, Any] | None:
    """--json-schema's text (JSON, or a file holding it) as an object."""
    if json_schema is None:
        return None
    from llmcli.inference.grammar import build_constraint

    return build_constraint(json_schema=json_schema).schema or json.loads(json_schema)
