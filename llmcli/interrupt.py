"""Ctrl-C and SIGTERM as a request to stop, not an exception.

While `Cancellation.on_signals()` is active, the signals set a flag that the decode loop
checks between tokens and llama.cpp's abort callback checks inside a running prefill,
so generation ends cleanly: partial answer kept, stats reported, exit code 128 + signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class Cancellation:
    """Set from a signal handler; checked between tokens and inside a running prefill."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum

    def raise_for_signal(self) -> None:
        """Outside generation there is nothing to finish: unwind as the signal would have."""
        from llmcli.errors import Terminated

        if self.signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt

    @contextmanager
    def on_signals(self, signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
        """While active, Ctrl-C and SIGTERM end generation gracefully instead of raising."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, lambda signum, frame: self.request(signum)) for s in signums}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def raising(self, signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
        """While active (a tool's Python code runs: no decode loop looks at the flag), a signal is recorded and
        raised at once as KeyboardInterrupt."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:
            self.request(signum)
            raise KeyboardInterrupt

        previous = {s: signal.signal(s, handler) for s in signums}
        try:
            if self.signum is not None:  # it came just before: stop now, not after the code has run
                raise KeyboardInterrupt
            yield
        finally:
            for s, handler_before in previous.items():
                signal.signal(s, handler_before)
