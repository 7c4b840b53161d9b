"""OpenAI's chat and text completions wire format, both ways, as plain data — what `serve` writes and the `--endpoint`
client reads, in one place (as Ollama's `openai/` package): the sampling fields of a request, a message, a tool call's
streamed delta, usage and llmcli's timings, the finish reason (answer/finish.py's names), and a stream of chunks read
back into llmcli's events. No HTTP here: serve's routes (llmcli/serve/openai_api.py) and the client's transport
(llmcli/remote/client.py) carry it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from llmcli.answer.answer_text import StopMatcher
from llmcli.answer.events import MAX_TOP_LOGPROBS, Done, Prefill, Token, TokenLogprob, TokenTrace
from llmcli.answer.finish import from_openai
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.image_bytes import ImageError, decode_data
from llmcli.answer.images import MARKER, MAX_IMAGES, ImageInput
from llmcli.answer.message import Message
from llmcli.answer.sampling_config import ANSWER_FIELDS, WIRE_FIELDS
from llmcli.answer.stats import AnswerClock
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.tool_calls import ToolCall, ToolSpec, new_call_id
from llmcli.answer.trace_wire import trace_of

# request fields -> llmcli settings: OpenAI's names, and llama-server's (llmcli's) for the rest
SAMPLING_FIELDS = {wire: name for name, wire in WIRE_FIELDS.items()}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class WireError(ValueError):
    """A request that is not in its protocol's shape: what is wrong and the field — a 400 (a server writes it in the
    protocol's error shape; its own errors, with other statuses, are this too)."""

    status = 400
    kind = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


# -- a request -------------------------------------------------------------------------------------------


def sampling_fields(generation: GenerationOptions, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """An answer's sampling settings as request fields: those that differ from the built-in defaults (a server's own
    defaults stand for the rest), and always the temperature."""
    fields: dict[str, Any] = {}
    for name, wire in WIRE_FIELDS.items():
        value = getattr(generation if name in ANSWER_FIELDS else generation.sampling, name)
        if value is not None and (value != defaults.get(name) or name == "temp"):
            fields[wire] = value
    return fields


def tool_fields(spec: ToolSpec | None) -> dict[str, Any]:
    """The tools an answer may call, as a request offers them (the server renders them and constrains the calls)."""
    if spec is None or not spec.tools:
        return {}
    choice = spec.choice
    return {"tools": [tool.openai() for tool in spec.tools],
            "tool_choice": {"type": "function", "function": {"name": choice.name}} if choice.mode == "function"
            else choice.mode,
            "parallel_tool_calls": spec.parallel}


def message_dict(message: Message) -> dict[str, Any]:
    """A message as a request carries it (a call's arguments as JSON text; content always a string)."""
    return message.openai_dict()


def message_of(message: Any, index: int) -> Message:
    """One message of a request: a role, its text; an assistant's `tool_calls`, a tool's `tool_call_id`. WireError
    when it is not OpenAI's shape."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise WireError(f"messages[{index}].role must be one of {', '.join(ROLES)}", "messages")
    calls = (message.get("tool_calls") or []) if role == "assistant" else []
    if not isinstance(calls, list):
        raise WireError(f"messages[{index}].tool_calls must be a list", "messages")
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            raise WireError(f"messages[{index}].tool_calls: each is {{id, type, function: {{name, arguments}}}}",
                            "messages")
        parsed_calls.append(ToolCall(str(call.get("id") or new_call_id()), name,
                                     arguments if isinstance(arguments, str) else json.dumps(arguments)))
    content = message.get("content")
    text, images = ("", ()) if content is None and role == "assistant" else content_of(
        content, f"messages[{index}]", image_part=openai_image if role == "user" else None)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise WireError(f"messages[{index}]: a tool message needs its tool_call_id", "messages")
        name = message.get("name")
        return Message("tool", text, tool_call_id=call_id, name=name if isinstance(name, str) else None)
    return Message(ROLES[role], text, tool_calls=tuple(parsed_calls), images=images)


def text_of(content: Any, where: str, param: str = "messages", part_types: tuple[str, ...] = ("text",)) -> str:
    """A text's content: a string, or a list of text parts (`{"type": "text", "text": …}`; every protocol's
    messages read it, each with its part types). An image where only text may be: a 400 saying so."""
    return content_of(content, where, param, part_types, None)[0]


ImagePart = Callable[[dict[str, Any]], "str | None"]  # a protocol's image part -> its data (a data URI or base64)


def openai_image(part: dict[str, Any]) -> str | None:
    """Chat Completions' `{"type": "image_url", "image_url": {"url": …}}` (or the URL alone)."""
    if part.get("type") != "image_url":
        return None
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url if isinstance(url, str) else ""


def content_of(content: Any, where: str, param: str = "messages", part_types: tuple[str, ...] = ("text",),
               image_part: ImagePart | None = openai_image) -> tuple[str, tuple[ImageInput, ...]]:
    """A message's content: its text, with a marker where each image sits, and the images, decoded and checked (a
    400 names the bad one). `image_part` reads the protocol's image parts (None: none may be there)."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise WireError(f"{where}.content must be a string or a list of text parts", param)
    texts: list[str] = []
    images: list[ImageInput] = []
    for index, part in enumerate(content):
        if part.get("type") in part_types and isinstance(part.get("text"), str):
            texts.append(part["text"].replace(MARKER, "<__media _>"))
            continue
        data = image_part(part) if image_part is not None else None
        if data is None:
            if "image" in str(part.get("type", "")):
                raise WireError(f"{where}: an image is not taken here, only text", param)
            raise WireError(f"{where}.content must be a string or a list of text parts", param)
        images.append(image_from(data, f"{where}.content[{index}]", param))
        texts.append(MARKER)
    if len(images) > MAX_IMAGES:
        raise WireError(f"{where}: {len(images)} images; a prompt takes at most {MAX_IMAGES}", param)
    return "".join(texts), tuple(images)


def image_from(data: str, where: str, param: str) -> ImageInput:
    """An image a request sent (a data URI or base64), decoded; a 400 saying what is wrong with it."""
    if not isinstance(data, str) or not data:
        raise WireError(f"{where}: an image needs its data (a data:image/...;base64 URI)", param)
    if data.startswith(("http://", "https://")):
        raise WireError(f"{where}: image URLs are not fetched by this server; send the image itself as a "
                        "data:image/...;base64 URI", param)
    try:
        return decode_data(data, where)
    except ImageError as exc:
        raise WireError(exc.message, param) from None


# -- an answer, written ----------------------------------------------------------------------------------


def call_delta(event: CallStarted | CallArguments) -> dict[str, Any]:
    """A tool call's delta, as OpenAI streams it: index, id, type and name once, then pieces of the arguments."""
    if isinstance(event, CallStarted):
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    return {"index": event.index, "function": {"arguments": event.text}}


def usage(dones: list[Done]) -> dict[str, Any]:
    """Token counts of a response (every choice): prompt, cached part of it, completion."""
    prompt = sum(done.stats.prompt_tokens for done in dones)
    completion = sum(done.stats.completion_tokens for done in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(done.stats.cached_tokens for done in dones)}}


def timings(done: Done) -> dict[str, Any]:
    """llmcli's own record (llama-server's field): every phase, the rates, and why the answer ended in llmcli's
    words — which OpenAI's finish reason cannot all tell."""
    invalid = [{"index": i, "id": c.id, "error": c.error} for i, c in enumerate(done.tool_calls) if c.error]
    return {**done.stats.to_dict(), "finish_reason": done.finish_reason, "stop_sequence": done.stop_sequence,
            "format_error": done.format_error, **({"tool_call_errors": invalid} if invalid else {})}


# -- an answer, read -------------------------------------------------------------------------------------


class ChunkReader:
    """Chunks in (chat's `delta`s or completions' `text`), the events of a local answer out: text (never a stop
    sequence), reasoning, tool calls, then Done with timings measured here (TTFT, decode rate) and the server's token
    counts and finish reason when it sends them (llmcli's own in `timings`)."""

    def __init__(self, stops: tuple[str, ...], started: float, tools: ToolSpec | None = None):
        self.stops = StopMatcher(stops)
        self.tools = tools  # to check the calls the server sends against (it is not trusted to have)
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]
        self.clock = AnswerClock(started)
        self.clock.prefill_started = started  # the server's prefill is what the first chunk waits for
        self.text: list[str] = []
        self.thought: list[str] = []
        self.pieces = 0  # chunks with text: the token count when the server gives none
        self.finish: str | None = None
        self.stop: str | None = None
        self.usage: dict[str, Any] = {}
        self.server_timings: dict[str, Any] = {}
        self.logprobs: list[TokenLogprob] = []  # of the answer's tokens, as the server sent them (when asked for)
        self._unsent: list[TokenLogprob] = []  # those of text the stop matcher still holds
        self.prompt_tokens = 0  # as llmcli serve announced them (an answer cut short gets no usage)
        self.dropped = 0  # the conversation's oldest exchanges llmcli serve dropped to fit (fit_history)
        self._traced_at: float | None = None  # when the last traced token's trace came (its text not yet read)

    def events(self, chunk: dict[str, Any], chat: bool) -> Iterator[Token | CallStarted | CallArguments | Prefill |
                                                                     TokenTrace]:
        traced = chunk.get("llmcli_trace")  # (the client's reading of llmcli serve's comments)
        if traced is not None:
            found = trace_of(traced)
            if found is not None:
                self._traced_at = time.perf_counter()  # (when its token came: its text's chunk follows, after the
                # trace is shown)
                if found.index == 0:  # (the first token's time is the TTFT: since this request was made, as the
                    # summary's, not since the server read it)
                    found = dataclasses.replace(found, seconds=self._traced_at - self.clock.submitted)
                yield found
            return
        announced = chunk.get("llmcli_prompt_tokens")
        if type(announced) is int:
            self.prompt_tokens = announced
            return
        dropped = chunk.get("llmcli_dropped")
        if type(dropped) is int:
            self.dropped = dropped
            return
        progress = chunk.get("llmcli_prefill")
        if isinstance(progress, list) and len(progress) == 3 and self.clock.first_token is None:
            evaluated, total, prompt = progress
            yield Prefill(evaluated, total, prompt)
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.server_timings = chunk["timings"]
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish = from_openai(choice["finish_reason"])
            delta = (choice.get("delta") or {}) if chat else choice
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self._arrived()
                self.thought.append(reasoning)
                yield Token(reasoning, reasoning=True)
            yield from self._call_events(delta.get("tool_calls") if chat else None)
            text = delta.get("content") if chat else delta.get("text")
            if isinstance(text, str) and text and self.stop is None:
                self._arrived()
                self._unsent += logprobs_of(choice.get("logprobs"), chat)
                shown, self.stop = self.stops.feed(text)
                if shown:
                    self.text.append(shown)
                    logprobs, self._unsent = tuple(self._unsent), []
                    self.logprobs += logprobs
                    yield Token(shown, logprobs=logprobs)

    def _call_events(self, deltas: Any) -> Iterator[CallStarted | CallArguments]:
        """The inverse of `call_delta`: index, id and name once, then pieces of the arguments."""
        for delta in deltas if isinstance(deltas, list) else ():
            if not isinstance(delta, dict) or not isinstance(delta.get("index", 0), int):
                continue
            index = delta.get("index", 0)
            found = delta.get("function")
            function: dict[str, Any] = found if isinstance(found, dict) else {}
            if index not in self.calls:
                self._arrived()
                self.calls[index] = [str(delta.get("id") or new_call_id()), str(function.get("name") or ""), ""]
                yield CallStarted(index, self.calls[index][0], self.calls[index][1])
            piece = function.get("arguments")
            if isinstance(piece, str) and piece:
                self.calls[index][2] += piece
                yield CallArguments(index, piece)

    def _arrived(self) -> None:
        self.clock.token(self._traced_at or time.perf_counter(), True)  # (a traced token: when its trace came)
        self._traced_at = None
        self.pieces += 1

    @property
    def notices(self) -> list[str]:
        """What llmcli serve said of this answer, in run's words (`timings.notices`: the input truncated, -n capped)."""
        found = self.server_timings.get("notices")
        return [" ".join(n.split())[:400] for n in found if isinstance(n, str)][:8] if isinstance(found, list) else []

    def done(self, interrupted: bool) -> tuple[str, Done]:
        """What the stop matcher still held, and the Done event: the inverse of `usage` and `timings`."""
        tail = ""
        if self.stop is None:
            tail, self.stop = self.stops.finish()
        if tail:
            self.text.append(tail)
            self.logprobs += self._unsent
        prompt = int(self.usage.get("prompt_tokens") or _count(self.server_timings, "prompt_tokens") or self.prompt_tokens)
        details = self.usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        completion = int(self.usage.get("completion_tokens") or self.pieces)
        self.clock.prefill_done = self.clock.first_token
        server = self.server_timings  # llmcli serve's own record: the images it read, its threads
        self.clock.images, self.clock.images_encoded = _count(server, "images"), _count(server, "images_encoded")
        image_s, prompt_s = server.get("image_s"), server.get("prompt_s")
        self.clock.image_s = float(image_s) if isinstance(image_s, (int, float)) and image_s >= 0 else 0.0
        # (rendering and tokenizing the prompt: the server's, within this answer's TTFT)
        if isinstance(prompt_s, (int, float)) and prompt_s >= 0 and self.clock.first_token is not None:
            self.clock.prompt_s = min(float(prompt_s), (self.clock.first_token - self.clock.submitted) / 2)
            self.clock.prefill_started = self.clock.submitted + self.clock.prompt_s  # (the prefill follows it)
        drafted = _count(server, "draft_tokens")
        stats = self.clock.stats(prompt_tokens=prompt, cached_tokens=cached, prefill_tokens=max(0, prompt - cached),
                                 completion_tokens=completion, decode_steps=max(0, completion - 1),
                                 threads=_count(server, "threads") or None,
                                 prefill_threads=_count(server, "prefill_threads") or None,
                                 kv_cells=_count(server, "kv_cells") or None, draft_tokens=drafted,
                                 accepted_tokens=min(_count(server, "accepted_tokens"), drafted),
                                 reasoning_tokens=min(_count(server, "reasoning_tokens"), completion),
                                 seed=server["seed"] if type(server.get("seed")) is int else None)
        own = self.server_timings.get("finish_reason")  # llmcli serve says why, in llmcli's words
        finish = ("interrupted" if interrupted else "stop_sequence" if self.stop is not None
                  else own if isinstance(own, str) and own else self.finish or "stop")
        stop = self.stop if self.stop is not None else self.server_timings.get("stop_sequence")
        calls = tuple(ToolCall(call_id, name, arguments or "{}",
                               self.tools.check(name, arguments or "{}") if self.tools is not None else None)
                      for _, (call_id, name, arguments) in sorted(self.calls.items()))
        if calls and finish in ("stop", "tool_calls"):
            finish = "tool_calls"
        return tail, Done(finish, stats, stop if isinstance(stop, str) else None, text="".join(self.text),
                          reasoning="".join(self.thought).strip() or None, tool_calls=calls,
                          logprobs=tuple(self.logprobs), dropped=self.dropped)


def logprobs_of(found: Any, chat: bool) -> list[TokenLogprob]:
    """A chunk's logprobs read back: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` (the inverse of
    `TokenLogprob.to_dict`) or completions' `{tokens, token_logprobs, top_logprobs}`. Token ids are not on the wire
    (-1); anything malformed is left out."""
    if not isinstance(found, dict):
        return []
    if chat:
        entries = found.get("content")
        return [logprob for entry in entries if (logprob := _logprob_of(entry)) is not None] \
            if isinstance(entries, list) else []
    tokens, values, tops = found.get("tokens"), found.get("token_logprobs"), found.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(values, list) and len(tokens) == len(values)):
        return []
    tops = tops if isinstance(tops, list) and len(tops) == len(tokens) else [{}] * len(tokens)
    return [TokenLogprob(-1, token.encode(), float(value), tuple(
        (-1, str(piece).encode(), float(lp)) for piece, lp in list(top.items())[:MAX_TOP_LOGPROBS]
        if isinstance(lp, (int, float))) if isinstance(top, dict) else ())
        for token, value, top in zip(tokens, values, tops, strict=True)
        if isinstance(token, str) and isinstance(value, (int, float))]


def _piece(entry: dict[str, Any]) -> bytes:
    found = entry.get("bytes")
    if isinstance(found, list) and all(isinstance(b, int) and 0 <= b < 256 for b in found):
        return bytes(found)
    return str(entry.get("token", "")).encode()


def _logprob_of(entry: Any) -> TokenLogprob | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
        return None
    top = entry.get("top_logprobs")
    alternatives = tuple((-1, _piece(t), float(t["logprob"])) for t in (top if isinstance(top, list) else [])[
        :MAX_TOP_LOGPROBS] if isinstance(t, dict) and isinstance(t.get("logprob"), (int, float)))
    return TokenLogprob(-1, _piece(entry), float(entry["logprob"]), alternatives)


def _count(record: Mapping[str, Any], key: str) -> int:
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
