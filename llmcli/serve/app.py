"""`llmcli serve`'s HTTP side: Starlette routes over the slots (llmcli/inference/serving.py).

    POST /v1/chat/completions   POST /v1/completions   (stream or not; stream_options.include_usage)
    POST /v1/embeddings         GET  /v1/models, /v1/models/{id}   GET  /health   (CORS: --cors ORIGIN)

Every /v1 request needs `Authorization: Bearer KEY` when the server has a key. Bodies larger than the
limit are refused before they are read whole; errors are OpenAI's error object with the right status.
The engine runs on its own thread; each request waits on an asyncio queue that the engine's thread fills.
A client that goes away cancels its job: its slot is free at the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmcli.answer.events import DecodeEvent, Token
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.decode.serving import Job, QueueFull, SlotServer, deliver_here
from llmcli.errors import LlmcliError
from llmcli.serve.protocol import ApiError, Parsed, Prompter, Reply, embeddings_reply, parse, parse_embeddings
from llmcli.serve.setup import Embeddings

RETRY_AFTER_S = 1
SHUTDOWN_GRACE_S = 5.0  # SIGTERM: how long a cancelled stream has to send its end before it is cut


@dataclass
class ServerState:
    slots: SlotServer
    prompter: Prompter
    api_key: str | None = None
    thread: threading.Thread | None = field(default=None, repr=False)
    embeddings: Embeddings | None = None  # /v1/embeddings (the model in embedding mode, loaded on first use)

    @property
    def model(self) -> str:
        return self.prompter.model_names[0]


def create_app(state: ServerState, cors: tuple[str, ...] = ()) -> Starlette:
    """The routes over the slots; `cors`: the origins whose pages may call from a browser (none by default)."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def deliver(events: list[tuple[Job, DecodeEvent]]) -> None:  # on the engine's thread: one wake-up a step
            loop.call_soon_threadsafe(deliver_here, events)

        state.slots.deliver = deliver
        state.thread = threading.Thread(target=state.slots.run, name="llmcli-engine", daemon=True)
        state.thread.start()
        try:
            yield
        finally:  # SIGTERM: uvicorn has stopped taking requests; in-flight answers were cancelled or finished
            state.slots.stop()
            await asyncio.to_thread(state.thread.join, 30)
            if state.embeddings is not None:
                state.embeddings.close()

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, state, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, state, chat=False)

    async def models(request: Request) -> Response:
        if (denied := _denied(request, state)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [_model_card(state.model)]})

    async def model(request: Request) -> Response:
        if (denied := _denied(request, state)) is not None:
            return denied
        name = request.path_params["name"]
        if name not in state.prompter.model_names:
            return _error(ApiError(404, f"the model {name!r} does not exist here; this server has {state.model!r}",
                                   param="model", code="model_not_found"))
        return JSONResponse(_model_card(state.model))

    async def embeddings(request: Request) -> Response:
        if (denied := _denied(request, state)) is not None:
            return denied
        if state.embeddings is None:
            return _error(ApiError(404, "no route /v1/embeddings", code="not_found"))
        try:
            body = await _body(request, state.prompter.limits.max_body_bytes)
            asked = parse_embeddings(body, state.prompter.model_names)
            results = await asyncio.to_thread(state.embeddings.embed, asked.texts)
            return JSONResponse(embeddings_reply(asked, results, state.model, state.embeddings.dimensions))
        except ApiError as error:
            return _error(error)
        except LlmcliError as error:  # the embedding context could not be made (memory)
            return _error(ApiError(503, error.message, "server_error"))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": state.model, **state.slots.status()})

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                             allow_headers=["authorization", "content-type"])] if cors else []
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={404: _not_found, 405: _not_allowed})


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmcli"}


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(ApiError(404, f"no route {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))


def _error(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _denied(request: Request, state: ServerState) -> Response | None:
    if state.api_key is None:
        return None
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if secrets.compare_digest(token.encode(), state.api_key.encode()):
        return None
    return _error(ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                           code="invalid_api_key"))


async def _body(request: Request, limit: int) -> Any:
    """The JSON body, read up to `limit` bytes (413 beyond it, before the rest is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def _complete(request: Request, state: ServerState, chat: bool) -> Response:
    if (denied := _denied(request, state)) is not None:
        return denied
    try:
        body = await _body(request, state.prompter.limits.max_body_bytes)
        parsed = await asyncio.to_thread(parse, body, chat, state.prompter)  # templates and tokenizing: off the loop
    except ApiError as error:
        return _error(error)
    events: asyncio.Queue[DecodeEvent] = asyncio.Queue()
    job = Job(parsed.tokens, parsed.generation, parsed.seed, events.put_nowait)  # called on this loop (deliver)
    try:
        state.slots.submit(job)
    except QueueFull as exc:
        return _error(ApiError(429, f"busy: {exc}; retry later", "rate_limit_error", code="busy"),
                      {"Retry-After": str(RETRY_AFTER_S)})
    reply = Reply.new(chat, state.model)
    if parsed.stream:
        shutdown = anyio.Event()  # set by sse-starlette on SIGTERM: the answer is cancelled and its stream ends cleanly
        return EventSourceResponse(_stream(events, job, reply, parsed, shutdown), ping=15, send_timeout=30,
                                   shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)
    return await _whole(request, events, job, reply)


async def _stream(events: asyncio.Queue[DecodeEvent], job: Job, reply: Reply, parsed: Parsed,
                  shutdown: anyio.Event) -> AsyncIterator[str]:
    """Chunks as the engine produces them; the client gone (the task cancelled): the job is cancelled. The server
    stopping: the job is cancelled too, and the stream still ends as a stream should (last chunk, [DONE])."""

    async def cancel_on_shutdown() -> None:
        await shutdown.wait()
        job.cancelled.set()

    watcher = asyncio.ensure_future(cancel_on_shutdown())
    first = True
    try:
        while True:
            event = await events.get()
            if isinstance(event, Token):
                yield json.dumps(reply.chunk(event.text, event.reasoning, first), ensure_ascii=False)
                first = False
                continue
            if isinstance(event, (CallStarted, CallArguments)):
                if first:  # the role comes first, as OpenAI sends it
                    yield json.dumps(reply.chunk("", False, True))
                    first = False
                yield json.dumps(reply.call_chunk(event), ensure_ascii=False)
                continue
            if job.failure is not None:
                yield json.dumps(ApiError(job.failure[0], job.failure[1], "server_error").body())
            else:
                yield json.dumps(reply.last_chunk(event), ensure_ascii=False)
                if parsed.include_usage:
                    yield json.dumps(reply.usage_chunk(event))
            yield "[DONE]"
            return
    finally:
        watcher.cancel()
        job.cancelled.set()  # a no-op once the answer is done


async def _whole(request: Request, events: asyncio.Queue[DecodeEvent], job: Job, reply: Reply) -> Response:
    """Wait for the whole answer, watching for the client going away meanwhile."""
    text: list[str] = []
    reasoning: list[str] = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return Response(status_code=499)
                continue
            if isinstance(event, Token):
                (reasoning if event.reasoning else text).append(event.text)
                continue
            if isinstance(event, (CallStarted, CallArguments)):
                continue  # the Done holds the calls
            if job.failure is not None:
                status, reason = job.failure
                return _error(ApiError(status, reason, "invalid_request_error" if status < 500 else "server_error"))
            return JSONResponse(reply.whole("".join(text), "".join(reasoning).strip() or None, event))
    finally:
        job.cancelled.set()
