"""Which `Host` a request may name: the defence against DNS rebinding (the class of Ollama's CVE-2024-28224).

A web page the user opens can make its own domain resolve to 127.0.0.1 and then talk to the server as a same-origin
page, reading every answer (`/health` included). Its requests still carry its own name in `Host`. So a request is
answered only when its `Host` is an IP address (no name to rebind), `localhost` or a name under it, the name the server
was told to listen on, or a name given with `--allow-host` (a reverse proxy's; `*`: any); anything else is a 403 in
the protocol's own shape. A server on a Unix socket is out of a browser's reach and takes any `Host`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from llmcli.serve.answer_request import ApiError
from llmcli.serve.answering import ErrorShape, error_response

Scope = dict[str, Any]
Asgi = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def host_allowed(header: str, allowed: Collection[str]) -> bool:
    """Whether a `Host` header (`name`, `name:port`, `[v6]:port`) names this server."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.rstrip(".")
    if not host or "*" in allowed or host in allowed or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware of one protocol's app: a request whose `Host` is not this server's gets a 403 in `shape`."""

    def __init__(self, app: Asgi, allowed: Collection[str], shape: ErrorShape):
        self.app, self.allowed, self.shape = app, frozenset(a.lower().rstrip(".") for a in allowed), shape

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            header = next((value.decode("latin-1") for name, value in scope.get("headers", ()) if name == b"host"), "")
            if not host_allowed(header, self.allowed):
                error = ApiError(403, f"the Host {header!r} is not this server's: a page from elsewhere may not call it "
                                 "(a reverse proxy's name is allowed with serve --allow-host NAME)", code="host_not_allowed")
                await error_response(error, self.shape)(scope, receive, send)
                return
        await self.app(scope, receive, send)
