"""Connections a client cannot hold open for nothing: uvicorn's HTTP/1.1 protocol (h11) with a deadline for each
request's headers and a cap on open connections.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but not one that never sends a request, nor
one that sends its headers a byte at a time (slowloris): both held a descriptor for as long as the client liked.
Here every request's headers — the first one from when the connection opens, each later one from the end of the
previous response — must be complete within `header_timeout`. Open connections are capped at `max_connections`, and no
client may hold them all: when the cap (or one client address's share of it, half) is reached, the connection that has
been idle longest — waiting for a request, none being answered — is closed to make room (the client's own first, when
its share is full); only when none is idle is the new one closed as it opens. So 512 idle connections from one client
cannot lock the others out. A slow body is bounded where it is read (llmcli/serve/answering.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 512
    _deadline: asyncio.TimerHandle | None = None
    _idle_since: float = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        for same_client, cap in ((True, max(1, self.max_connections // 2)), (False, self.max_connections)):
            crowd = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                     and not c.transport.is_closing() and (not same_client or c.client_host() == self.client_host())]
            if len(crowd) + 1 > cap and not _evict_idlest(crowd):
                transport.abort()  # at once: the descriptor is free again
                return
        self._arm()

    def client_host(self) -> str | None:
        return self.client[0] if self.client else None

    def idle(self) -> bool:
        """Waiting for a request's headers (none being answered), not closing already."""
        return (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete: it is answered now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, if any, have the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._idle_since = time.monotonic()
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered (a pipelined one, whose headers came with the previous request)
        if not self.transport.is_closing():
            self.transport.close()


def _evict_idlest(connections: list[GuardedH11Protocol]) -> bool:
    """Close the connection of `connections` idle longest; False if none is idle."""
    idle = [c for c in connections if c.idle()]
    if not idle:
        return False
    oldest = min(idle, key=lambda c: c._idle_since)
    oldest._disarm()
    oldest.transport.abort()
    return True


def guarded(header_timeout: float, max_connections: int) -> Any:
    """The protocol class uvicorn takes as `http=`, with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout,
                                                              "max_connections": max_connections})
