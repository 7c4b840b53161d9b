"""`llmcli serve`'s HTTP side: each protocol its own small app, mounted at its prefix, over the one slot server
(llmcli/decode/serving.py) and the one request runner (llmcli/serve/answering.py).

    OpenAI      POST /v1/chat/completions  /v1/completions  /v1/responses  /v1/embeddings      (openai_routes.py)
                GET  /v1/models  /v1/models/{id}
    Anthropic   POST /v1/messages  /v1/messages/count_tokens                                   (anthropic_routes.py)
    Ollama      GET  /api/version  /api/tags  /api/ps    POST /api/show  /api/chat  /api/generate  /api/embed
                /api/embeddings  /api/pull (--allow-pull)                                         (ollama_routes.py)
    llmcli      GET  /health (no key needed)   GET / the chat page (llmcli/serve/chat_page.py; --no-webui: off)
                POST /llmcli/embed (the warm servers' embeddings)                                         (here)
    Tokenizer   POST /tokenize  /detokenize   GET /tokenizer_info   (vLLM's and llama-server's: tokenizer_api.py)
                CORS for the origins of --cors only

Each app answers its own errors in its protocol's shape — a refused Host, an unknown route, a method not allowed, a
bug (llmcli/serve/route_kit.py) — and keeps its own state (the Responses kept for previous_response_id). A server
with a key needs it on every route but /health (`Authorization: Bearer KEY` or `x-api-key: KEY`). The engine runs on
its own thread; each request waits on an asyncio queue that the engine's thread fills.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
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
from llmcli.answer.reasoning import reads_thinking_switch
from llmcli.serve import anthropic_routes, chat_page, ollama_routes, openai_api, openai_routes, tokenizer_api
from llmcli.serve.answer_request import ApiError, Prompter
from llmcli.serve.answering import ServerState, check_key, requested_model
from llmcli.serve.model_facts import ModelFacts
from llmcli.serve.model_pool import Served
from llmcli.serve.route_kit import ModelLists, PrefixMount, embedded, guarded, posted, protocol_app

__all__ = ["ServerState", "create_app"]


def create_app(state: ServerState, describe: Callable[[str, Any, int], ModelFacts],
               loadable: Callable[[], list[tuple[str, Any]]], cors: tuple[str, ...] = (), webui: bool = True,
               hosts: tuple[str, ...] | None = ()) -> Starlette:
    """The protocols' apps over the models' slots; `describe` and `loadable`: what the model lists say of models not
    loaded (setup.ServerModels); `cors`: the origins whose pages may call from a browser (none by default); `webui`: the
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

    models = ModelLists(state, describe, loadable)
    mounts = [PrefixMount("/v1/messages", anthropic_routes.app(state, hosts)),  # (before /v1: the longer prefix)
              PrefixMount("/v1", openai_routes.app(state, models, hosts)),
              PrefixMount("/api", ollama_routes.app(state, models, hosts)),
              PrefixMount("", _own_app(state, hosts, webui))]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                             allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"])
                  ] if cors else []
    return Starlette(routes=mounts, lifespan=lifespan, middleware=middleware)


# What /health tells of a model only with the key (or on a Unix socket): a warm run's client reads them
PRIVATE_FACTS = ("path", "notices", "thinking_switch", "template_sha256", "template_system", "embedding_pid")

def _own_app(state: ServerState, hosts: tuple[str, ...] | None, webui: bool) -> Starlette:
    """llmcli's own routes: /health, the warm servers' /llmcli/embed, the chat page; errors in OpenAI's shape."""
    pool = state.pool

    def status(served: Served) -> dict[str, Any]:
        expires = served.expires_in()
        return {"name": served.name, "path": str(served.key), "size": served.facts.size, "slots": served.slots.status(),
                "n_ctx": served.prompter.limits.n_ctx,
                # (whether its template reads --think: a warm run says, as a run does, when it would change nothing)
                "thinking_switch": reads_thinking_switch(served.prompter.template_source)
                if served.prompter.template_source else None,
                "template_sha256": hashlib.sha256(served.prompter.template_source.encode()).hexdigest()
                if served.prompter.template_source else None, "template_system": served.template_system,
                "in_flight": served.in_flight, "pinned": served.pinned, "notices": list(served.notices),
                "expires_in_s": None if expires is None else round(expires, 1),
                "idle_s": 0.0 if served.in_flight else round(time.monotonic() - served.last_used, 1),
                "embedding_pid": served.embeddings.pid if served.embeddings is not None else None}

    async def health(request: Request) -> Response:
        """Open to anyone (a load balancer's probe); the pid and the models' paths only to a caller with the key, or
        on a Unix socket (only its user reaches it)."""
        default = pool.default
        first = default.slots.status() if default is not None and default.key in pool.loaded else {}
        trusted = hosts is None if state.api_key is None else _has_key(request, state)
        models = [status(served) for served in pool.loaded.values()]
        mending = any(served.slots.state != "running" for served in pool.loaded.values())  # (an engine restarting)
        found = {"status": "degraded" if mending else "ok", "model": default.name if default else None, **first,
                 "version": __version__}
        if trusted:
            return JSONResponse({**found, "models": models, "pid": os.getpid()})
        return JSONResponse({**_without_pid(found), "models": [_without_pid({k: v for k, v in m.items()
                                                                             if k not in PRIVATE_FACTS})
                                                               for m in models]})

    async def llmcli_embed(body: Any) -> Any:
        """Per-text results (a text that fails is its own error), normalize and truncate as asked."""
        served, release = await requested_model(state, body)
        try:
            texts = body.get("input")
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "input must be a list of strings", param="input")
            results = await embedded(served, texts, normalize=body.get("normalize") is True,
                                     truncate=body.get("truncate") is True)
            return {"results": [{"embedding": None if r.vector is None else list(r.vector), "tokens": r.tokens,
                                 "error": r.error, "too_long": r.too_long} for r in results]}
        finally:
            release()

    def with_tokenizer(make: Callable[[Any, Prompter], dict[str, Any]]) -> Callable[[Any], Awaitable[Any]]:
        async def route(body: Any) -> Any:
            served, release = await requested_model(state, body)
            try:
                return await asyncio.to_thread(make, body, served.prompter)
            finally:
                release()

        return route

    async def tokenizer_facts(request: Request) -> Response:
        check_key(request, state)
        served, release = await requested_model(state, {"model": request.query_params.get("model")})
        release()
        return JSONResponse(tokenizer_api.tokenizer_info(served.prompter))

    return protocol_app([
        Route("/health", health, methods=["GET"]),
        Route("/llmcli/embed", posted(state, openai_api.error_body, llmcli_embed), methods=["POST"]),
        # (the model's tokenizer, as vLLM and llama-server serve it: lm-evaluation-harness's remote tokenizer)
        Route("/tokenize", posted(state, openai_api.error_body, with_tokenizer(tokenizer_api.tokenized)),
              methods=["POST"]),
        Route("/detokenize", posted(state, openai_api.error_body, with_tokenizer(tokenizer_api.detokenized)),
              methods=["POST"]),
        Route("/tokenizer_info", guarded(tokenizer_facts, openai_api.error_body), methods=["GET"]),
        *chat_page.routes(webui),  # `/`: the chat page for a browser, one line for anything else
    ], openai_api.error_body, hosts)


def _without_pid(facts: dict[str, Any]) -> dict[str, Any]:
    """A model's (or the default model's) facts without its engine's pid: for a caller without the key."""
    slots: dict[str, Any] = facts["slots"] if isinstance(facts.get("slots"), dict) else facts
    engine = slots.get("engine")
    if not isinstance(engine, dict):
        return facts
    hidden = {k: v for k, v in engine.items() if k != "pid"}
    if slots is facts:
        return {**facts, "engine": hidden}
    return {**facts, "slots": {**slots, "engine": hidden}}


def _has_key(request: Request, state: ServerState) -> bool:
    try:
        check_key(request, state)
    except ApiError:
        return False
    return True
