"""Ctrl-C and SIGTERM as a request to stop, not an exception.

While `Cancellation.on_signals()` is active, the signals set a flag that the decode loop
checks between tokens and llama.cpp's abort callback checks inside a running prefill,
so generation ends cleanly: partial answer kept, stats reported, exit code 128 + signal.

A signal's Python handler runs only once the main thread is back in Python. A call into llama.cpp that does not come
back — a grammar whose parse stacks multiply with each character (`r ::= "a" r "b" | "a" r "c" | ""` fed `aaaa…`
grows them 2^n, and llama.cpp dedups them pairwise: minutes a token) — would hold Ctrl-C and SIGTERM off for as
long. So while `on_signals` is active a watcher thread hears each signal too (Python's wakeup fd, written by the C
handler at once), and if the handler has not run STUCK_S later, the process says so and exits 128 + signal there and
then (nothing is being written: the main thread is inside llama.cpp).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

STUCK_S = 3.0  # a signal the main thread has not taken this long after it came: llama.cpp is not coming back
_requests = 0  # signals a handler has taken, in this process (any Cancellation's): what the watcher waits for


class Cancellation:
    """Set from a signal handler; checked between tokens and inside a running prefill."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGINT) -> None:
        global _requests
        self.signum = signum
        _requests += 1

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
            with _StuckWatch(signums):
                yield
        finally:
            for s, handler_before in previous.items():
                signal.signal(s, handler_before)

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


class _StuckWatch:
    """Hears the signals `signums` through Python's wakeup fd; one that no handler has taken (`_requests` unchanged:
    `on_signals`' and `raising`'s both count) STUCK_S later ends the process. Main thread only (set_wakeup_fd)."""

    def __init__(self, signums: Sequence[int]):
        self.signums = frozenset(int(s) for s in signums)
        self._done = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = -1
        self._taken = 0

    def __enter__(self) -> _StuckWatch:
        self._taken = _requests  # (before any byte can come)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="llmcli-signal-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous)  # (the C handler writes here no more)
        self._done.set()
        os.close(self._write)  # the watcher reads the end of its pipe, and closes it

    def _watch(self) -> None:
        taken = self._taken  # the handlers' count when last looked at: a rise since says the main thread took them
        try:
            while True:
                data = os.read(self._read, 64)
                if not data or self._done.is_set():  # (the pipe's end: the watch is over)
                    return
                came = [signum for signum in data if signum in self.signums]
                if not came or _requests > taken:  # (the handler may run before this reads the byte; several
                    taken = _requests              # signals before it runs are one run of it)
                    continue
                if not self._done.wait(STUCK_S) and _requests == taken:
                    _exit_stuck(came[-1])
                taken = _requests
        finally:
            os.close(self._read)


def _exit_stuck(signum: int) -> None:
    """The main thread is inside a call that does not return: say so on stderr, end now (128 + signal)."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

    def flush() -> None:  # the answer so far (a pipe's buffer); a write stuck on a full pipe must not hold us
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    flushing = threading.Thread(target=flush, daemon=True)
    flushing.start()
    flushing.join(0.5)
    with_cursor = "\x1b[?25h" if os.isatty(2) else ""  # (a live display may have hidden it)
    message = f"{with_cursor}\nllmcli: llama.cpp did not return within {STUCK_S:g} s of {name}; stopped at once\n"
    try:
        os.write(2, message.encode())
    except OSError:
        pass
    os._exit(128 + signum)
