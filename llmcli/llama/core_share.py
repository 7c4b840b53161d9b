"""Sharing the cores with the other llmcli processes that generate at the same time.

llama.cpp's OpenMP threads spin while they wait for each other, so two processes that each use every
core slow each other down many times over (two runs on 2 cores: 1.3 tok/s each instead of 130; on a
16-core machine 0.44 tok/s each instead of 90). Each generating llmcli therefore registers itself (a
file named by its pid in the runtime dir, holding the threads it uses now) and uses its share of the
cores: cores // processes generating now, at least one. It looks again every RECHECK_S seconds, between
two decode steps, so a run that started alone gives half its cores back when a second one starts and
takes them again when that one ends; a newcomer waits (at most ROOM_WAIT_S) until the others have made
room before its first decode, so the two never run more threads than cores. A solo run does what it
did before: all its cores.

A process registers as soon as its model is loaded and unregisters when an answer ends (an idle chat
takes no share) or the model closes. The folder is the user's alone (paths.private_dir: in a shared
temporary dir another user could have made it first, with a link where a pid's file goes): one that is
not means running alone, said once (`problem`); files are never opened through a link.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from llmcli import paths, reaper
from llmcli.llama.cpu_load import WINDOW_S, CpuLoad

RECHECK_S = 0.05
ROOM_WAIT_S = 1.0


class CoreShare:
    """This process's registration while it generates, and its share of `cores`."""

    def __init__(self, cores: int, load: CpuLoad | None = None):
        self.cores = cores
        self.load = load  # what other processes (any) take of the cores now
        self.squeezed: tuple[float, int] | None = None  # (cores others took, threads left) when that cut the count
        self.folder = paths.runtime_dir() / "generating"
        self.mine: Path | None = None
        self.due = 0.0  # perf_counter() time of the next look at the others
        self.problem: str | None = None  # why this process cannot share (it runs alone), to be said once
        self._said_squeezed = False  # the notice that other processes cut the thread count: said once

    def register(self, threads: int | None = None) -> None:
        """Count this process among those generating (idempotent)."""
        if self.mine is not None or self.problem is not None:
            return
        try:
            paths.private_dir(self.folder, paths.runtime_dir())
            mine = self.folder / str(os.getpid())
            mine.unlink(missing_ok=True)  # a dead process's of the same pid (or anything else at the name)
            os.close(paths.open_private(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            self.mine = mine
            self.publish(threads or self.cores)
        except paths.UnsafeDirectory as exc:
            self.mine, self.problem = None, f"{exc.filename} is not this user's alone: running without sharing " \
                                            "the cores with other llmcli processes"
        except OSError:
            self.mine = None  # no shared folder: behave as if alone

    def unregister(self) -> None:
        if self.mine is not None:
            self.mine.unlink(missing_ok=True)
            self.mine = None

    def publish(self, threads: int) -> None:
        """Tell the others how many threads this process uses now."""
        if self.mine is not None:
            handle = paths.open_private(self.mine, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(handle, str(threads).encode())
            finally:
                os.close(handle)

    def threads(self, now: float | None = None, window_s: float = WINDOW_S, starting: bool = False) -> int:
        """This process's share of the cores now: of the other llmcli processes' and of what any process leaves free
        (read over at least `window_s`; `starting`: before a first pass, see CpuLoad.free_cores); the next look is
        due RECHECK_S later."""
        self.due = (time.perf_counter() if now is None else now) + RECHECK_S
        shared = max(1, self.cores // (1 + len(self._others())))
        if self.load is None:
            return shared
        free = self.load.free_cores(self.cores, window_s, starting)
        if free < shared:
            self.squeezed = (self.load.others, free)
        return min(shared, free)

    def take_squeezed_notice(self) -> str | None:
        """Once: why decoding was slower than this machine gives when idle — other processes took cores, and the
        thread count was cut to what they left (what to try: free them, or -t)."""
        if self.squeezed is None or self._said_squeezed:
            return None
        self._said_squeezed = True
        others, left = self.squeezed
        return (f"other processes kept ~{others:.1f} of {self.cores} cores busy: decoded on {left} "
                f"thread{'' if left == 1 else 's'}, the fastest meanwhile (-t N fixes it)")

    def read_load(self) -> None:
        """While idle (a server between answers): read what the others take, so that the next answer's first pass
        is decided on the last window, not on an average over the whole idle time."""
        if self.load is not None:
            self.load.update()

    def wait_for_room(self, threads: int) -> None:
        """Before computing: wait until the others' threads and these fit the cores (they adapt within
        RECHECK_S of a step), or ROOM_WAIT_S has passed."""
        deadline = time.perf_counter() + ROOM_WAIT_S
        while sum(self._others().values()) + threads > self.cores and time.perf_counter() < deadline:
            time.sleep(0.005)

    def _others(self) -> dict[int, int]:
        """pid -> threads of the other generating processes (stale entries of dead ones removed)."""
        if self.mine is None:
            return {}
        try:
            entries = [entry.name for entry in os.scandir(self.folder)]
        except OSError:
            return {}
        others = {}
        for name in entries:
            if not name.isdigit() or int(name) == os.getpid():
                continue
            if not reaper.alive(int(name)):  # a process that died without cleaning up
                (self.folder / name).unlink(missing_ok=True)
                continue
            try:
                handle = paths.open_private(self.folder / name, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    others[int(name)] = int(os.read(handle, 16) or self.cores)
                finally:
                    os.close(handle)
            except (OSError, ValueError):
                others[int(name)] = self.cores
        return others


