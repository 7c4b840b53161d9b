"""Ollama's API as its own app under `/api`: chat, generate, embed, the model lists and show; its errors in Ollama's
shape. The wire format is llmcli/serve/ollama_api.py's; this module only routes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmcli.serve import ollama_api
from llmcli.serve.answering import Asked, ServerState, check_key, requested_model
from llmcli.serve.model_pool import Served
from llmcli.serve.route_kit import ModelLists, answering, embedded, guarded, posted, protocol_app

SHAPE = ollama_api.error_body


def app(state: ServerState, models: ModelLists, hosts: tuple[str, ...] | None) -> Starlette:
    pool = state.pool

    def answers(chat: bool) -> Callable[[Any, Served], Asked | dict[str, Any]]:
        parse = ollama_api.parse_chat if chat else ollama_api.parse_generate

        def asked(body: Any, served: Served) -> Asked | dict[str, Any]:
            requests = parse(body, served.prompter)
            if ollama_api.loads_only(body, "messages" if chat else "prompt"):
                return ollama_api.loaded_reply(chat, body["model"])
            return Asked(requests, lambda prepared: ollama_api.OllamaReply(chat, body["model"], requests))

        return asked

    def embed(legacy: bool) -> Callable[[Any], Any]:
        async def embedding(body: Any) -> Any:
            served, release = await requested_model(state, body)
            try:
                texts, truncate = ollama_api.parse_embed(body, served.prompter, legacy)
                started = time.perf_counter()
                results = await embedded(served, texts, normalize=not legacy, truncate=truncate) if texts else []
                return ollama_api.embed_reply(body["model"], results, time.perf_counter() - started, legacy)
            finally:
                release()

        return embedding

    async def tags(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(ollama_api.tags(await models.listed()))

    async def running(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(ollama_api.running([(served.facts, served.expires_in()) for served in pool.loaded.values()]))

    async def show(body: Any) -> Any:
        return ollama_api.show(body, await models.facts_of(body.get("model") or body.get("name")))

    async def version(request: Request) -> Response:
        return JSONResponse({"version": ollama_api.VERSION})

    return protocol_app([
        Route("/api/version", version, methods=["GET"]),
        Route("/api/tags", guarded(tags, SHAPE), methods=["GET"]),
        Route("/api/ps", guarded(running, SHAPE), methods=["GET"]),
        Route("/api/show", posted(state, SHAPE, show), methods=["POST"]),
        Route("/api/chat", answering(state, answers(True), SHAPE, ndjson=True), methods=["POST"]),
        Route("/api/generate", answering(state, answers(False), SHAPE, ndjson=True), methods=["POST"]),
        Route("/api/embed", posted(state, SHAPE, embed(False)), methods=["POST"]),
        Route("/api/embeddings", posted(state, SHAPE, embed(True)), methods=["POST"]),
    ], SHAPE, hosts)
