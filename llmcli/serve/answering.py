"""The one way a request is answered over HTTP, whatever its protocol: its body read (bounded), its answers submitted
to the slots, then either the whole response or a stream (SSE or NDJSON) of the protocol's items. A client that goes
away cancels its answers: their slots are free at the next decode step; the server stopping ends a stream as that
protocol ends one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmcli.answer.events import Done, Prefill, TokenTrace
from llmcli.answer.image_bytes import REQUEST_PIXELS, PixelAllowance
from llmcli.answer.openai_wire import WireError
from llmcli.answer.stats import AnswerClock, summary_line
from llmcli.decode.serving import Failure, Job, JobEvent, QueueFull
from llmcli.errors import LlmcliError
from llmcli.serve.answer_request import AnswerRequest, ApiError, Parsed, prepare
from llmcli.serve.engine_process import EngineProcess
from llmcli.serve.model_pool import ModelPool, Served
from llmcli.serve.pulling import PullModel
from llmcli.serve.wire import COMMENT, Exchange, Item

RETRY_AFTER_S = 1
SHUTDOWN_GRACE_S = 5.0  # SIGTERM: after the server's grace, how long a cut stream has to send its end
DISCONNECT_POLL_S = 0.5  # a whole answer: how often the client is checked for having gone away


@dataclass
class ServerState:
    pool: ModelPool  # the models, loaded on first use
    max_body: int  # bytes a request body may have (413 beyond)
    api_key: str | None = None
    shutdown_grace: float = 10.0  # SIGTERM: what the answers in flight have to finish (then they are cut)
    body_timeout: float = 10.0  # a request's body must arrive within it (408)
    keepalive_s: float = 10.0  # a stream silent this long sends its protocol's keep-alive (a long prefill)
    report: Callable[[str], None] | None = None  # one line per answer (serve prints it on stderr)
    pull: PullModel | None = None  # Ollama's /api/pull downloads with it (--allow-pull; None: refused)


ErrorShape = Callable[[WireError], Any]


def error_response(error: WireError, shape: ErrorShape) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
    return JSONResponse(shape(error), status_code=error.status, headers=headers)


def check_key(request: Request, state: ServerState) -> None:
    """401 unless the request carries the server's key: `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(token.encode(), state.api_key.encode()):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                       code="invalid_api_key")


MAX_JSON_DEPTH = 64  # arrays and objects inside one another: deeper bodies are refused before anything reads them


# What a browser sends with every POST (Origin: the Fetch standard) or every request (Sec-Fetch-*), and a page's script
# can neither set nor remove (forbidden header names).
BROWSER_HEADERS = ("origin", "sec-fetch-site", "sec-fetch-mode")


async def read_body(request: Request, state: ServerState) -> dict[str, Any]:
    """The key checked, then the JSON object of the body, read up to the server's limit (413 beyond it, before the rest
    is read). From a browser, only `application/json` is read: a web page can send `text/plain` or a form (or no type)
    to any address without asking first, so taking it would let any page the user opens drive the server (415). A
    request without a browser's headers is read as JSON whatever its type: `curl -d '{…}'` (Ollama's own examples)
    sends a form's type."""
    check_key(request, state)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    json_type = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    if not json_type and any(name in request.headers for name in BROWSER_HEADERS):
        raise ApiError(415, f"a browser's request body must be JSON sent as Content-Type: application/json (got "
                       f"{media or 'no Content-Type'})")
    limit = state.max_body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes")

    async def whole_body() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        data = await asyncio.wait_for(whole_body(), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {state.body_timeout:g} s") from None
    if not data:
        raise ApiError(400, "the request needs a JSON body")
    if _nesting(data) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # JSON may escape half of a UTF-16 pair ("\\ud800"): no text holds one, and no tokenizer takes it
        if b"\\ud" in data.lower():
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate (like \\ud800): not Unicode text") from None
    return body


_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")


def _nesting(data: bytes) -> int:
    """How deep a JSON text nests arrays and objects (its strings skipped), read without building anything."""
    brackets = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", data))
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                break
    return deepest


@dataclass(frozen=True)
class Asked:
    """What a request asks: its answers, and how to make the protocol's Exchange once they are prepared."""

    requests: list[AnswerRequest]
    reply: Callable[[list[Parsed]], Exchange]


async def requested_model(state: ServerState, body: Any) -> tuple[Served, Callable[[], None]]:
    """The model a body names, loaded, and held for this request (the callable releases it). Its prompter takes the
    name the request used (an alias, a path) as one of the model's."""
    name = body.get("model") if isinstance(body, dict) else None
    served = await state.pool.get(name)
    release = state.pool.hold(served, body.get("keep_alive") if isinstance(body, dict) else None)
    if isinstance(name, str) and name not in served.prompter.model_names:
        names = (*served.prompter.model_names, name, name.removesuffix(":latest"))
        served = dataclasses.replace(served, prompter=dataclasses.replace(served.prompter, model_names=names))
    return served, release


class RequestLog:
    """The server's log lines of one request (`x-request-id` tells its client the id): one per finished answer (its
    route, id and the stats line `llmcli run` prints), and one for a request that ended otherwise — refused (its status
    and why), failed, or left by its client (how many of its answers were done) — so that no request leaves no trace."""

    def __init__(self, request: Request, state: ServerState):
        self.id = "req_" + uuid.uuid4().hex[:16]
        self.route, self.say = f"{request.method} {request.url.path} {self.id}", state.report
        self.answered = self.expected = 0
        self.ended = False

    def answer(self, done: Done) -> None:
        self.answered += 1
        self._line(summary_line(done.stats, done.finish_reason, done.stop_sequence))

    def refused(self, error: WireError) -> None:
        self._line(f"{error.status} {' '.join(error.message.split())[:300]}")
        self.ended = True

    def left(self) -> None:
        """The client went away (or the stream was cut) before every answer was done."""
        if not self.ended and self.answered < self.expected:
            self._line(f"the client left: {self.answered} of {self.expected} answers done")
        self.ended = True

    def _line(self, text: str) -> None:
        if self.say is not None:
            self.say(f"{self.route} · {text}")


async def answer(request: Request, state: ServerState, parse: Callable[[Any, Served], Asked | Any],
                 shape: ErrorShape, ndjson: bool = False) -> Response:
    """Answer one request: `parse` turns its body into what it asks of its model (or into a whole response object,
    when it asks nothing of the slots); its answers are prepared (templates, tokenizing: off the event loop) and
    submitted to that model's slots. Each request leaves its lines in the server's log (RequestLog)."""
    log = RequestLog(request, state)
    response = await _answer(request, state, parse, shape, ndjson, log)
    response.headers["x-request-id"] = log.id
    return response


async def _answer(request: Request, state: ServerState, parse: Callable[[Any, Served], Asked | Any],
                  shape: ErrorShape, ndjson: bool, log: RequestLog) -> Response:
    release: Callable[[], None] = lambda: None  # noqa: E731
    try:
        body = await read_body(request, state)
        served, release = await requested_model(state, body)
        try:
            served.slots.admit()  # (the queue's limits before anything is decoded: a request's images)
        except QueueFull as exc:
            raise ApiError(429, f"busy: {exc}; retry later", code="busy") from None
        except LlmcliError as exc:  # (its engine died and could not start again: why)
            raise ApiError(500, exc.message, cause=exc) from None
        REQUEST_PIXELS.set(headers := PixelAllowance(headers_only=True))  # (to_thread carries the context)
        asked = await asyncio.to_thread(parse, body, served)
        if headers.seen:  # its pictures, read from their headers, fit the request's allowance: now decoded
            REQUEST_PIXELS.set(PixelAllowance())
            asked = await asyncio.to_thread(parse, body, served)
        if not isinstance(asked, Asked):
            release()
            return JSONResponse(asked)
        prepared = await asyncio.to_thread(lambda: [prepare(a, served.prompter) for a in asked.requests])
        return await respond(request, state, served.slots, prepared, asked.reply(prepared), ndjson, release, log)
    except WireError as error:  # (an ApiError, or a body not in its protocol's shape: 400)
        release()
        log.refused(error)
        return error_response(error, shape)


async def respond(request: Request, state: ServerState, slots: EngineProcess, prepared: list[Parsed], exchange: Exchange,
                  ndjson: bool = False, release: Callable[[], None] = lambda: None,
                  log: RequestLog | None = None) -> Response:
    """Submit prepared answers; the whole response, or a stream of the exchange's items (SSE, or NDJSON);
    `release` once every answer is over."""
    log = log or RequestLog(request, state)
    log.expected = len(prepared)
    events: asyncio.Queue[tuple[int, JobEvent]] = asyncio.Queue()

    def emitter(index: int) -> Callable[[JobEvent], None]:  # called on this loop (deliver)
        return lambda event: events.put_nowait((index, event))

    jobs = [Job(p.tokens, p.generation, p.seed, emitter(i), stable=p.stable, images=p.images,
                clock=AnswerClock(p.started, prompt_s=p.prompt_s) if p.started else AnswerClock())
            for i, p in enumerate(prepared)]
    try:
        for job in jobs:
            slots.submit(job)
    except QueueFull as exc:
        for job in jobs:
            job.cancelled.set()
        raise ApiError(429, f"busy: {exc}; retry later", code="busy") from None
    if not prepared[0].stream:
        try:
            return await _whole(request, events, jobs, exchange, log)
        finally:
            release()
    items = _stream(events, jobs, exchange, release, state.keepalive_s, log)
    if ndjson:
        return StreamingResponse(_ndjson(items), media_type="application/x-ndjson")
    # On SIGTERM sse-starlette waits `shutdown_grace_period` for the stream to end by itself before it cuts it: the
    # answer has the server's grace to finish, and then (cut by `cancel_all`) a moment to send its end.
    return EventSourceResponse(_sse(items), ping=15, send_timeout=30, shutdown_event=anyio.Event(),
                               shutdown_grace_period=state.shutdown_grace + SHUTDOWN_GRACE_S)


async def _stream(events: asyncio.Queue[tuple[int, JobEvent]], jobs: list[Job], exchange: Exchange,
                  release: Callable[[], None], keepalive_s: float, log: RequestLog) -> AsyncGenerator[Item, None]:
    """The exchange's items as the engine produces the events; the client gone (the task cancelled): the jobs are
    cancelled."""
    dones: list[Done | None] = [None] * len(jobs)
    try:
        for item in exchange.opening():
            yield item
        while None in dones:
            try:
                index, event = await asyncio.wait_for(events.get(), keepalive_s)
            except asyncio.TimeoutError:  # nothing for a while (a long prompt evaluated): what keeps clients waiting
                for item in exchange.keepalive():
                    yield item
                continue
            if isinstance(event, Prefill):  # a long prompt's progress: said where the protocol has a way
                progress = getattr(exchange, "progress", None)
                for item in progress(event) if progress is not None else ():
                    yield item
                continue
            if isinstance(event, TokenTrace):  # a traced answer's token (llmcli's own `trace` field): the same
                traced = getattr(exchange, "trace", None)
                for item in traced(index, event) if traced is not None else ():
                    yield item
                continue
            failure = jobs[index].failure
            if failure is not None:
                log.refused(_api_error(failure))
                for item in exchange.failed(_api_error(failure)):
                    yield item
                return
            for item in exchange.on_event(index, event):
                yield item
            if isinstance(event, Done):
                dones[index] = event
                log.answer(event)
        for item in exchange.closing([d for d in dones if d is not None]):
            yield item
    finally:
        for job in jobs:
            job.cancelled.set()  # a no-op once the answer is done
        log.left()
        release()


async def _sse(items: AsyncGenerator[Item, None]) -> AsyncIterator[ServerSentEvent]:
    try:
        async for name, data in items:
            if name == COMMENT:
                yield ServerSentEvent(comment=data)
                continue
            text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            yield ServerSentEvent(data=text, event=name)
    finally:
        await items.aclose()  # the client gone: its answers are cancelled now, not when the generator is collected


async def _ndjson(items: AsyncGenerator[Item, None]) -> AsyncIterator[bytes]:
    try:
        async for _, data in items:
            yield (json.dumps(data, ensure_ascii=False) + "\n").encode()
    finally:
        await items.aclose()


async def _whole(request: Request, events: asyncio.Queue[tuple[int, JobEvent]], jobs: list[Job],
                 exchange: Exchange, log: RequestLog) -> Response:
    """Wait for every answer, watching for the client going away meanwhile."""
    dones: list[Done | None] = [None] * len(jobs)
    try:
        while None in dones:
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if not isinstance(event, Done):
                continue  # the Done holds the whole answer
            failure = jobs[index].failure
            if failure is not None:
                error = _api_error(failure)
                log.refused(error)
                return JSONResponse(exchange.error_body(error), status_code=error.status)
            dones[index] = event
            log.answer(event)
        return JSONResponse(exchange.whole([d for d in dones if d is not None]))
    finally:
        for job in jobs:
            job.cancelled.set()
        log.left()


def _api_error(failure: Failure) -> ApiError:
    """A job's failure as HTTP says it: the request's fault is a 400, the engine's a 500."""
    return ApiError(400 if failure.refused else 500, failure.message, cause=failure.cause)
