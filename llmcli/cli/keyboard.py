"""The keyboard while an answer streams: the terminal's echo is off, so keys typed meanwhile never move the cursor under
a rendered answer (rich redraws its open Markdown block from where it thinks the cursor is: an echoed `/retry` or `^C`
made it print lines twice). The keys themselves stay in the terminal's input queue (the echo is switched with
TCSANOW, nothing is flushed): chat's next prompt reads them. Ctrl-C still interrupts (ISIG is left on). A question
asked meanwhile (`--tools-approve`) turns the echo back on while it waits for its answer.

Only the controlling terminal of a foreground process is touched (a background job changing it would be stopped by
SIGTTOU), and it is always put back as it was: the answer's end, Ctrl-C, SIGTERM, a broken pipe.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import termios
except ImportError:  # (not a POSIX terminal)
    termios = None  # type: ignore[assignment]

_held: list[tuple[int, list[int | list[bytes | int]]]] = []  # (the terminal's fd, its settings before) while an answer streams


def _foreground_terminal() -> int | None:
    """The controlling terminal, open, if this process is in its foreground; else None."""
    if termios is None:
        return None
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        foreground = os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        foreground = False
    if foreground:
        return fd
    os.close(fd)
    return None


@contextmanager
def echo_off() -> Iterator[None]:
    """While the block runs: what is typed is not echoed (and stays queued for whoever reads next)."""
    fd = _foreground_terminal()
    if fd is None:
        yield
        return
    try:
        before = termios.tcgetattr(fd)
        quiet = list(before)
        quiet[3] &= ~termios.ECHO
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except termios.error:
        os.close(fd)
        yield
        return
    _held.append((fd, before))
    try:
        yield
    finally:
        _held.pop()
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, before)
        os.close(fd)


@contextmanager
def echo_on() -> Iterator[None]:
    """A question asked while an answer streams: the echo as it was before the answer, for the question's answer."""
    if not _held:
        yield
        return
    fd, before = _held[-1]
    try:
        quiet = termios.tcgetattr(fd)
        termios.tcsetattr(fd, termios.TCSANOW, before)
    except termios.error:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
