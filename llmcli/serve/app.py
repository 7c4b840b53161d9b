"""`llmcli serve`'s HTTP side: the routes of three protocols over the one slot server (llmcli/decode/serving.py).

    OpenAI      POST /v1/chat/completions  /v1/completions  /v1/responses  /v1/embeddings
                GET  /v1/models  /v1/models/{id}
    Anthropic   POST /v1/messages  /v1/messages/count_tokens
    Ollama      GET  /api/version  /api/tags  /api/ps    POST /api/show  /api/chat  /api/generate  /api/embed
                /api/embeddings
    llmcli      GET  /health (no key needed)   CORS for the origins of --cors only

Each route is a thin adapter: its protocol's module parses the body into AnswerRequests and writes the events in its
wire format; llmcli/serve/answering.py runs every request the same way. A server with a key needs it on every route
but /health (`Authorization: Bearer KEY` or `x-api-key: KEY`). Errors come in the shape of the protocol asked.
The engine runs on its own thread; each request waits on an asyncio queue that the engine's thread fills.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llmcli.decode.serving import deliver_here
from llmcli.errors import LlmcliError
from llmcli.serve import anthropic_api, ollama_api, openai_api, responses_api
from llmcli.serve.answer_request import ApiError, count_tokens
from llmcli.serve.answering import Asked, ErrorShape, ServerState, answer, check_key, error_response, read_body
from llmcli.serve.model_facts import ModelFacts

__all__ = ["ServerState", "create_app"]

Handler = Callable[[Request], Any]


def create_app(state: ServerState, facts: ModelFacts, cors: tuple[str, ...] = ()) -> Starlette:
    """The routes over the slots; `cors`: the origins whose pages may call from a browser (none by default)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        import threading

        loop = asyncio.get_running_loop()

        def deliver(events: list[Any]) -> None:  # on the engine's thread: one wake-up a step
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

    kept: OrderedDict[str, Any] = OrderedDict()  # Responses stored for previous_response_id, oldest first

    def keep(response_id: str, conversation: Any) -> None:
        kept[response_id] = conversation
        while len(kept) > responses_api.MAX_KEPT:
            kept.popitem(last=False)

    model, prompter = state.model, state.prompter

    def openai_answers(chat: bool) -> Callable[[Any], Asked]:
        parse = openai_api.parse_chat if chat else openai_api.parse_completion

        def asked(body: Any) -> Asked:
            requests = parse(body, prompter)
            return Asked(requests, lambda prepared: openai_api.Reply.new(chat, model, requests))

        return asked

    def responses(body: Any) -> Asked:
        request = responses_api.parse_response_request(body, prompter, kept)
        return Asked([request.answer], lambda prepared: responses_api.ResponsesReply(model, request, keep))

    def messages(body: Any) -> Asked:
        return Asked(anthropic_api.parse_messages(body, prompter),
                     lambda prepared: anthropic_api.MessagesReply(model, len(prepared[0].tokens)))

    def ollama_answers(chat: bool) -> Callable[[Any], Asked | dict[str, Any]]:
        parse = ollama_api.parse_chat if chat else ollama_api.parse_generate

        def asked(body: Any) -> Asked | dict[str, Any]:
            requests = parse(body, prompter)
            if ollama_api.loads_only(body, "messages" if chat else "prompt"):
                return ollama_api.loaded_reply(chat, body["model"])
            return Asked(requests, lambda prepared: ollama_api.OllamaReply(chat, body["model"], requests))

        return asked

    def handler(parse: Callable[[Any], Any], shape: ErrorShape = openai_api.error_body, ndjson: bool = False) -> Handler:
        async def handle(request: Request) -> Response:
            return await answer(request, state, parse, shape, ndjson)

        return handle

    routes = [
        # OpenAI
        Route("/v1/chat/completions", handler(openai_answers(True)), methods=["POST"]),
        Route("/v1/completions", handler(openai_answers(False)), methods=["POST"]),
        Route("/v1/responses", handler(responses), methods=["POST"]),
        Route("/v1/embeddings", _openai_embeddings(state), methods=["POST"]),
        Route("/v1/models", _guarded(state, openai_api.error_body, lambda request: {
            "object": "list", "data": [_model_card(facts)]}), methods=["GET"]),
        Route("/v1/models/{name:path}", _guarded(state, openai_api.error_body, lambda request: _one_model(
            request, state, facts)), methods=["GET"]),
        # Anthropic
        Route("/v1/messages", handler(messages, anthropic_api.error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", _count_tokens(state), methods=["POST"]),
        # Ollama
        Route("/", lambda request: PlainTextResponse("llmcli is running (Ollama's API at /api, OpenAI's and "
                                                     "Anthropic's at /v1)"), methods=["GET", "HEAD"]),
        Route("/api/version", lambda request: JSONResponse({"version": ollama_api.VERSION}), methods=["GET"]),
        Route("/api/tags", _guarded(state, ollama_api.error_body, lambda request: ollama_api.tags(facts)),
              methods=["GET"]),
        Route("/api/ps", _guarded(state, ollama_api.error_body, lambda request: ollama_api.running(facts)),
              methods=["GET"]),
        Route("/api/show", _ollama_show(state, facts), methods=["POST"]),
        Route("/api/chat", handler(ollama_answers(True), ollama_api.error_body, ndjson=True), methods=["POST"]),
        Route("/api/generate", handler(ollama_answers(False), ollama_api.error_body, ndjson=True), methods=["POST"]),
        Route("/api/embed", _ollama_embed(state, legacy=False), methods=["POST"]),
        Route("/api/embeddings", _ollama_embed(state, legacy=True), methods=["POST"]),
        Route("/health", lambda request: JSONResponse({"status": "ok", "model": model, **state.slots.status()}),
              methods=["GET"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                             allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"])
                  ] if cors else []
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={404: _not_found, 405: _not_allowed})


def _shape_of(path: str) -> ErrorShape:
    """The error shape of the protocol a path belongs to."""
    if path.startswith("/api/"):
        return ollama_api.error_body
    if path.startswith("/v1/messages"):
        return anthropic_api.error_body
    return openai_api.error_body


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"), _shape_of(request.url.path))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                          _shape_of(request.url.path))


def _guarded(state: ServerState, shape: ErrorShape, make: Callable[[Request], Any]) -> Handler:
    """A GET route whose object `make` builds, behind the key."""
    async def handle(request: Request) -> Response:
        try:
            check_key(request, state)
            return JSONResponse(make(request))
        except ApiError as error:
            return error_response(error, shape)

    return handle


def _model_card(facts: ModelFacts) -> dict[str, Any]:
    return {"id": facts.name, "object": "model", "created": int(facts.loaded), "owned_by": "llmcli"}


def _one_model(request: Request, state: ServerState, facts: ModelFacts) -> dict[str, Any]:
    name = request.path_params["name"]
    state.prompter.check_model(name)
    return _model_card(facts)


def _posted(state: ServerState, shape: ErrorShape, make: Callable[[Any], Awaitable[Any]]) -> Handler:
    """A POST route whose whole reply `make` builds from the body (behind the key; errors in `shape`)."""
    async def handle(request: Request) -> Response:
        try:
            return JSONResponse(await make(await read_body(request, state)))
        except ApiError as error:
            return error_response(error, shape)

    return handle


def _count_tokens(state: ServerState) -> Handler:
    async def count(body: Any) -> Any:
        (asked,) = anthropic_api.parse_messages(body, state.prompter, counting=True)
        return anthropic_api.count_reply(await asyncio.to_thread(count_tokens, asked, state.prompter))

    return _posted(state, anthropic_api.error_body, count)


def _ollama_show(state: ServerState, facts: ModelFacts) -> Handler:
    async def show(body: Any) -> Any:
        return ollama_api.show(body, facts, state.prompter)

    return _posted(state, ollama_api.error_body, show)


async def _embed(state: ServerState, texts: list[str], normalize: bool = False, truncate: bool = False) -> list[Any]:
    if state.embeddings is None:
        raise ApiError(404, "this server makes no embeddings", code="not_found")
    try:
        return await asyncio.to_thread(state.embeddings.embed, texts, normalize, truncate)
    except LlmcliError as error:  # the embedding context could not be made (memory)
        raise ApiError(503, error.message) from None


def _openai_embeddings(state: ServerState) -> Handler:
    async def embeddings(body: Any) -> Any:
        asked = openai_api.parse_embeddings(body, state.prompter)
        results = await _embed(state, asked.texts)
        dimensions = state.embeddings.dimensions if state.embeddings is not None else 0
        return openai_api.embeddings_reply(asked, results, state.model, dimensions)

    return _posted(state, openai_api.error_body, embeddings)


def _ollama_embed(state: ServerState, legacy: bool) -> Handler:
    async def embed(body: Any) -> Any:
        texts, truncate = ollama_api.parse_embed(body, state.prompter, legacy)
        started = time.perf_counter()
        results = await _embed(state, texts, normalize=not legacy, truncate=truncate) if texts else []
        return ollama_api.embed_reply(body["model"], results, time.perf_counter() - started, legacy)

    return _posted(state, ollama_api.error_body, embed)
