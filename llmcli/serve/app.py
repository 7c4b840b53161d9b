"""`llmcli serve`'s HTTP side: the routes of three protocols over the one slot server (llmcli/decode/serving.py).

    OpenAI      POST /v1/chat/completions  /v1/completions  /v1/responses  /v1/embeddings
                GET  /v1/models  /v1/models/{id}
    Anthropic   POST /v1/messages  /v1/messages/count_tokens
    Ollama      GET  /api/version  /api/tags  /api/ps    POST /api/show  /api/chat  /api/generate  /api/embed
                /api/embeddings
    llmcli      GET  /health (no key needed)   GET / the chat page (llmcli/serve/chat_page.py; --no-webui: off)
                CORS for the origins of --cors only

Each route is a thin adapter: its protocol's module parses the body into AnswerRequests and writes the events in its
wire format; llmcli/serve/answering.py runs every request the same way. A server with a key needs it on every route
but /health (`Authorization: Bearer KEY` or `x-api-key: KEY`). Errors come in the shape of the protocol asked.
The engine runs on its own thread; each request waits on an asyncio queue that the engine's thread fills.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmcli import __version__
from llmcli.errors import LlmcliError
from llmcli.serve import anthropic_api, chat_page, ollama_api, openai_api, responses_api
from llmcli.serve.answer_request import ApiError, count_tokens
from llmcli.serve.answering import (
    Asked,
    ErrorShape,
    ServerState,
    answer,
    check_key,
    error_response,
    read_body,
    requested_model,
)
from llmcli.serve.host_guard import HostGuard
from llmcli.serve.model_facts import ModelFacts
from llmcli.serve.model_pool import Served

__all__ = ["ServerState", "create_app"]

Handler = Callable[[Request], Any]


def create_app(state: ServerState, describe: Callable[[str, Any, int], ModelFacts],
               loadable: Callable[[], list[tuple[str, Any]]], cors: tuple[str, ...] = (), webui: bool = True,
               hosts: tuple[str, ...] | None = ()) -> Starlette:
    """The routes over the models' slots; `describe` and `loadable`: what the model lists say of models not loaded
    (setup.ServerModels); `cors`: the origins whose pages may call from a browser (none by default); `webui`: the
    chat page at `/`; `hosts`: the names a request's `Host` may give besides IP addresses and localhost (None: any,
    for a server on a Unix socket, which no browser reaches; llmcli/serve/host_guard.py)."""
    pool = state.pool

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:  # SIGTERM: uvicorn has stopped taking requests; in-flight answers were cut or finished
            await pool.close()

    kept: OrderedDict[str, Any] = OrderedDict()  # Responses stored for previous_response_id, oldest first

    def keep(response_id: str, conversation: Any) -> None:
        kept[response_id] = conversation
        while len(kept) > responses_api.MAX_KEPT:
            kept.popitem(last=False)

    def openai_answers(chat: bool) -> Callable[[Any, Served], Asked]:
        parse = openai_api.parse_chat if chat else openai_api.parse_completion

        def asked(body: Any, served: Served) -> Asked:
            requests = parse(body, served.prompter)
            return Asked(requests, lambda prepared: openai_api.Reply.new(chat, served.name, requests))

        return asked

    def responses(body: Any, served: Served) -> Asked:
        request = responses_api.parse_response_request(body, served.prompter, kept)
        return Asked([request.answer], lambda prepared: responses_api.ResponsesReply(served.name, request, keep))

    def messages(body: Any, served: Served) -> Asked:
        return Asked(anthropic_api.parse_messages(body, served.prompter),
                     lambda prepared: anthropic_api.MessagesReply(served.name, len(prepared[0].tokens)))

    def ollama_answers(chat: bool) -> Callable[[Any, Served], Asked | dict[str, Any]]:
        parse = ollama_api.parse_chat if chat else ollama_api.parse_generate

        def asked(body: Any, served: Served) -> Asked | dict[str, Any]:
            requests = parse(body, served.prompter)
            if ollama_api.loads_only(body, "messages" if chat else "prompt"):
                return ollama_api.loaded_reply(chat, body["model"])
            return Asked(requests, lambda prepared: ollama_api.OllamaReply(chat, body["model"], requests))

        return asked

    def handler(parse: Callable[[Any, Served], Any], shape: ErrorShape = openai_api.error_body,
                ndjson: bool = False) -> Handler:
        async def handle(request: Request) -> Response:
            return await answer(request, state, parse, shape, ndjson)

        return handle

    async def facts_of(name: Any) -> ModelFacts:
        """A model's facts: the loaded one's, else its header's (nothing is loaded to say them)."""
        if not isinstance(name, str):
            raise ApiError(400, "model is required")
        for served in pool.loaded.values():
            if name.removesuffix(":latest") in served.prompter.model_names:
                return served.facts
        key = await pool.key(name)
        return await asyncio.to_thread(describe, name.removesuffix(":latest"), key, 0)

    async def listed() -> list[ModelFacts]:
        loaded = {served.key: served.facts for served in pool.loaded.values()}
        found = await asyncio.to_thread(loadable)
        facts = list(loaded.values())
        for name, path in found:
            if path.resolve() not in loaded:
                loaded[path.resolve()] = await asyncio.to_thread(describe, name, path, 0)
                facts.append(loaded[path.resolve()])
        return facts

    def status(served: Served) -> dict[str, Any]:
        expires = served.expires_in()
        return {"name": served.name, "path": str(served.key), "size": served.facts.size, "slots": served.slots.status(),
                "in_flight": served.in_flight, "pinned": served.pinned,
                "expires_in_s": None if expires is None else round(expires, 1)}

    async def health(request: Request) -> Response:
        """Open to anyone (a load balancer's probe); the pid and the models' paths only to a caller with the key, or
        on a Unix socket (only its user reaches it)."""
        default = pool.default
        first = default.slots.status() if default is not None and default.key in pool.loaded else {}
        trusted = hosts is None if state.api_key is None else _has_key(request, state)
        models = [status(served) for served in pool.loaded.values()]
        found = {"status": "ok", "model": default.name if default else None, **first, "version": __version__}
        if trusted:
            return JSONResponse({**found, "models": models, "pid": os.getpid()})
        return JSONResponse({**found, "models": [{k: v for k, v in m.items() if k != "path"} for m in models]})

    async def models_list(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse({"object": "list", "data": [_model_card(f) for f in await listed()]})

    async def one_model(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(_model_card(await facts_of(request.path_params["name"])))

    async def tags(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(ollama_api.tags(await listed()))

    async def running(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(ollama_api.running([(served.facts, served.expires_in()) for served in pool.loaded.values()]))

    async def show(body: Any) -> Any:
        name = body.get("model") or body.get("name") if isinstance(body, dict) else None
        return ollama_api.show(body, await facts_of(name))

    async def count(body: Any) -> Any:
        served, release = await requested_model(state, body)
        try:
            (asked,) = anthropic_api.parse_messages(body, served.prompter, counting=True)
            return anthropic_api.count_reply(await asyncio.to_thread(count_tokens, asked, served.prompter))
        finally:
            release()

    async def openai_embeddings(body: Any) -> Any:
        served, release = await requested_model(state, body)
        try:
            asked = openai_api.parse_embeddings(body, served.prompter)
            results = await _embed(served, asked.texts)
            return openai_api.embeddings_reply(asked, results, served.name, served.embeddings.dimensions)
        finally:
            release()

    def ollama_embed(legacy: bool) -> Callable[[Any], Any]:
        async def embed(body: Any) -> Any:
            served, release = await requested_model(state, body)
            try:
                texts, truncate = ollama_api.parse_embed(body, served.prompter, legacy)
                started = time.perf_counter()
                results = await _embed(served, texts, normalize=not legacy, truncate=truncate) if texts else []
                return ollama_api.embed_reply(body["model"], results, time.perf_counter() - started, legacy)
            finally:
                release()

        return embed

    async def llmcli_embed(body: Any) -> Any:
        """llmcli's own: per-text results (a text that fails is its own error), normalize and truncate as asked."""
        served, release = await requested_model(state, body)
        try:
            texts = body.get("input")
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "input must be a list of strings", param="input")
            results = await _embed(served, texts, normalize=body.get("normalize") is True,
                                   truncate=body.get("truncate") is True)
            return {"results": [{"embedding": None if r.vector is None else list(r.vector), "tokens": r.tokens,
                                 "error": r.error, "too_long": r.too_long} for r in results]}
        finally:
            release()

    routes = [
        Route("/llmcli/embed", _posted(state, openai_api.error_body, llmcli_embed), methods=["POST"]),
        # OpenAI
        Route("/v1/chat/completions", handler(openai_answers(True)), methods=["POST"]),
        Route("/v1/completions", handler(openai_answers(False)), methods=["POST"]),
        Route("/v1/responses", handler(responses), methods=["POST"]),
        Route("/v1/embeddings", _posted(state, openai_api.error_body, openai_embeddings), methods=["POST"]),
        Route("/v1/models", _guarded(models_list, openai_api.error_body), methods=["GET"]),
        Route("/v1/models/{name:path}", _guarded(one_model, openai_api.error_body), methods=["GET"]),
        # Anthropic
        Route("/v1/messages", handler(messages, anthropic_api.error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", _posted(state, anthropic_api.error_body, count), methods=["POST"]),
        # Ollama
        Route("/api/version", lambda request: JSONResponse({"version": ollama_api.VERSION}), methods=["GET"]),
        Route("/api/tags", _guarded(tags, ollama_api.error_body), methods=["GET"]),
        Route("/api/ps", _guarded(running, ollama_api.error_body), methods=["GET"]),
        Route("/api/show", _posted(state, ollama_api.error_body, show), methods=["POST"]),
        Route("/api/chat", handler(ollama_answers(True), ollama_api.error_body, ndjson=True), methods=["POST"]),
        Route("/api/generate", handler(ollama_answers(False), ollama_api.error_body, ndjson=True), methods=["POST"]),
        Route("/api/embed", _posted(state, ollama_api.error_body, ollama_embed(False)), methods=["POST"]),
        Route("/api/embeddings", _posted(state, ollama_api.error_body, ollama_embed(True)), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        *chat_page.routes(webui),  # `/`: the chat page for a browser, one line for anything else
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                             allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"])
                  ] if cors else []
    if hosts is not None:
        middleware.insert(0, Middleware(HostGuard, allowed=hosts, shape_of=_shape_of))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal})


def _shape_of(path: str) -> ErrorShape:
    """The error shape of the protocol a path belongs to."""
    if path.startswith("/api/"):
        return ollama_api.error_body
    if path.startswith("/v1/messages"):
        return anthropic_api.error_body
    return openai_api.error_body


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"), _shape_of(request.url.path))


async def _internal(request: Request, exc: Exception) -> Response:
    """A bug, not a request's fault: still the protocol's error shape, and the reason in the server's log."""
    import logging

    logging.getLogger("llmcli.serve").error("internal error on %s", request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}"), _shape_of(request.url.path))


def _has_key(request: Request, state: ServerState) -> bool:
    try:
        check_key(request, state)
    except ApiError:
        return False
    return True


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"),
                          _shape_of(request.url.path))


def _guarded(route: Handler, shape: ErrorShape) -> Handler:
    """A GET route whose errors (the key's among them) come in `shape`."""
    async def handle(request: Request) -> Response:
        try:
            response: Response = await route(request)
            return response
        except ApiError as error:
            return error_response(error, shape)

    return handle


def _posted(state: ServerState, shape: ErrorShape, make: Callable[[Any], Awaitable[Any]]) -> Handler:
    """A POST route whose whole reply `make` builds from the body (behind the key; errors in `shape`)."""
    async def handle(request: Request) -> Response:
        try:
            return JSONResponse(await make(await read_body(request, state)))
        except ApiError as error:
            return error_response(error, shape)

    return handle


def _model_card(facts: ModelFacts) -> dict[str, Any]:
    return {"id": facts.name, "object": "model", "created": int(facts.modified), "owned_by": "llmcli"}


async def _embed(served: Served, texts: list[str], normalize: bool = False, truncate: bool = False) -> list[Any]:
    try:
        return await asyncio.to_thread(served.embeddings.embed, texts, normalize, truncate)
    except LlmcliError as error:  # the embedding context could not be made (memory)
        raise ApiError(503, error.message) from None
