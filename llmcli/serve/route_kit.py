"""What every protocol's small app is made of: its routes answer through the one request runner (answering.py), its
errors — a refused Host, an unknown route, a method not allowed, a bug — come in its own shape, and it is mounted at
its own prefix (`PrefixMount`: the exact path too, which Starlette's `Mount` leaves out). Also what the model lists of
every protocol say (`ModelLists`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import Receive, Scope, Send

from llmcli.answer.openai_wire import WireError
from llmcli.errors import LlmcliError
from llmcli.serve.answer_request import ApiError
from llmcli.serve.answering import ErrorShape, ServerState, answer, error_response, read_body
from llmcli.serve.host_guard import HostGuard
from llmcli.serve.model_facts import ModelFacts
from llmcli.serve.model_pool import Served

Handler = Callable[[Request], Awaitable[Response]]


def protocol_app(routes: Sequence[BaseRoute], shape: ErrorShape, hosts: tuple[str, ...] | None) -> Starlette:
    """One protocol's app: its routes, and every error of its own in `shape` (a Host not this server's when `hosts` is
    given: llmcli/serve/host_guard.py)."""
    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"), shape)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"), shape)

    async def internal(request: Request, exc: Exception) -> Response:
        """A bug, not a request's fault: still the protocol's error shape, and the reason in the server's log."""
        logging.getLogger("llmcli.serve").error("internal error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"), shape)

    middleware = [Middleware(HostGuard, allowed=hosts, shape=shape)] if hosts is not None else []
    return Starlette(routes=list(routes), middleware=middleware,
                     exception_handlers={404: not_found, 405: not_allowed, Exception: internal})


class PrefixMount(BaseRoute):
    """Requests whose path is `prefix` or under it (`prefix/…`; "" for every path) go to `app`, paths unchanged."""

    def __init__(self, prefix: str, app: Starlette):
        self.prefix, self.app = prefix, app

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        path = scope.get("path", "")
        if scope["type"] == "http" and (not self.prefix or path == self.prefix or path.startswith(self.prefix + "/")):
            return Match.FULL, {}
        return Match.NONE, {}

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def answering(state: ServerState, parse: Callable[[Any, Served], Any], shape: ErrorShape,
              ndjson: bool = False) -> Handler:
    """A route whose body asks for answers (`parse` turns it into what it asks of its model)."""
    async def handle(request: Request) -> Response:
        return await answer(request, state, parse, shape, ndjson)

    return handle


def guarded(route: Handler, shape: ErrorShape) -> Handler:
    """A GET route whose errors (the key's among them) come in `shape`."""
    async def handle(request: Request) -> Response:
        try:
            return await route(request)
        except WireError as error:
            return error_response(error, shape)

    return handle


def posted(state: ServerState, shape: ErrorShape, make: Callable[[Any], Awaitable[Any]]) -> Handler:
    """A POST route whose whole reply `make` builds from the body (behind the key; errors in `shape`)."""
    async def handle(request: Request) -> Response:
        try:
            return JSONResponse(await make(await read_body(request, state)))
        except WireError as error:
            return error_response(error, shape)

    return handle


class ModelLists:
    """What the model lists of every protocol say: the loaded models' facts, else their headers' (nothing is loaded
    to say them); `describe` and `loadable` come from llmcli/serve/setup.py's ServerModels."""

    def __init__(self, state: ServerState, describe: Callable[[str, Any, int], ModelFacts],
                 loadable: Callable[[], list[tuple[str, Any]]]):
        self.pool, self.describe, self.loadable = state.pool, describe, loadable

    async def facts_of(self, name: Any) -> ModelFacts:
        if not isinstance(name, str):
            raise ApiError(400, "model is required")
        for served in self.pool.loaded.values():
            if name.removesuffix(":latest") in served.prompter.model_names:
                return served.facts
        key = await self.pool.key(name)
        return await asyncio.to_thread(self.describe, name.removesuffix(":latest"), key, 0)

    async def listed(self) -> list[ModelFacts]:
        loaded = {served.key: served.facts for served in self.pool.loaded.values()}
        found = await asyncio.to_thread(self.loadable)
        facts = list(loaded.values())
        names = {f.name for f in facts}
        for name, path in found:  # (a file whose name a loaded model answers to is not reached by it: not listed)
            if path.resolve() not in loaded and name not in names:
                loaded[path.resolve()] = await asyncio.to_thread(self.describe, name, path, 0)
                facts.append(loaded[path.resolve()])
        return facts


async def embedded(served: Served, texts: list[str], normalize: bool = False, truncate: bool = False) -> list[Any]:
    """The embedding results of `texts` (one per text), off the event loop."""
    try:
        return await asyncio.to_thread(served.embeddings.embed, texts, normalize, truncate)
    except LlmcliError as error:  # the embedding context could not be made (memory)
        raise ApiError(503, error.message) from None
