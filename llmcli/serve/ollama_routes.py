"""Ollama's API as its own app under `/api`: chat, generate, embed, the model lists and show, pull (--allow-pull);
its errors in Ollama's shape. The wire format is llmcli/serve/ollama_api.py's; this module only routes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmcli.answer.openai_wire import WireError
from llmcli.serve import ollama_api, ollama_store_api, pulling
from llmcli.serve.answer_request import ApiError
from llmcli.serve.answering import (
    DISCONNECT_POLL_S,
    Asked,
    ServerState,
    check_key,
    error_response,
    read_body,
    requested_model,
)
from llmcli.serve.model_pool import Served
from llmcli.serve.route_kit import Handler, ModelLists, answering, embedded, guarded, posted, protocol_app

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

    puller = pulling.Puller(state.pull, state.report) if state.pull is not None else None

    async def pull(request: Request) -> Response:
        try:
            name, stream = ollama_store_api.parse_pull(await read_body(request, state))
            if puller is None:
                raise ApiError(403, "this server does not download models: start it with `llmcli serve --allow-pull`")
        except WireError as error:
            return error_response(error, SHAPE)
        if stream:
            return StreamingResponse(_pull_lines(puller.events(name)), media_type="application/x-ndjson")
        return await _pull_whole(request, puller.events(name))

    def store_route(what: str) -> Handler:
        async def refuse(request: Request) -> Response:
            check_key(request, state)
            raise ApiError(501, f"llmcli serve does not {ollama_store_api.STORE_ROUTES[what]}")

        return guarded(refuse, SHAPE)

    return protocol_app([
        Route("/api/version", version, methods=["GET"]),
        Route("/api/tags", guarded(tags, SHAPE), methods=["GET"]),
        Route("/api/ps", guarded(running, SHAPE), methods=["GET"]),
        Route("/api/show", posted(state, SHAPE, show), methods=["POST"]),
        Route("/api/chat", answering(state, answers(True), SHAPE, ndjson=True), methods=["POST"]),
        Route("/api/generate", answering(state, answers(False), SHAPE, ndjson=True), methods=["POST"]),
        Route("/api/embed", posted(state, SHAPE, embed(False)), methods=["POST"]),
        Route("/api/embeddings", posted(state, SHAPE, embed(True)), methods=["POST"]),
        Route("/api/pull", pull, methods=["POST"]),
        *[Route(f"/api/{what}", store_route(what), methods=["POST", "DELETE", "HEAD"])
          for what in ollama_store_api.STORE_ROUTES],
        Route("/api/blobs/{digest}", store_route("blobs"), methods=["POST", "HEAD"]),
    ], SHAPE, hosts)


async def _pull_lines(events: AsyncGenerator[pulling.PullEvent, None]) -> AsyncIterator[bytes]:
    reply = ollama_store_api.PullReply()
    try:
        async for event in events:
            for line in reply.lines(event):
                yield (json.dumps(line) + "\n").encode()
    finally:
        await events.aclose()  # the client gone: the download stops now


async def _pull_whole(request: Request, events: AsyncGenerator[pulling.PullEvent, None]) -> Response:
    """`stream: false`: one reply once the pull ends, watching for the client going away meanwhile."""
    async def last() -> pulling.PullEvent:
        async for event in events:
            if isinstance(event, (pulling.Pulled, pulling.Failed)):
                return event
        raise AssertionError("a pull ends in Pulled or Failed")

    ending = asyncio.ensure_future(last())
    try:
        while not ending.done():
            await asyncio.wait({ending}, timeout=DISCONNECT_POLL_S)
            if not ending.done() and await request.is_disconnected():
                return Response(status_code=499)
        event = ending.result()
    finally:
        ending.cancel()
        await events.aclose()
    if isinstance(event, pulling.Failed):
        return error_response(ollama_store_api.pull_failure(event.error), SHAPE)
    return JSONResponse({"status": "success"})
