"""What the machine can give now: the CPU time other processes take on the cores this process may run on.

llama.cpp's threads wait for each other at every pass, so one thread that shares its core with a busy process holds
all of them back: with another process busy on one of two cores, two threads decoded SmolLM2 at 2.5 tok/s where one
thread gave 30. The default thread count is therefore the cores this process may use less what the others take now,
read from /proc/stat (every CPU in this process's affinity: user, nice, system, irq, softirq and a hypervisor's
steal) less this process's own CPU time (os.times), over windows of at least WINDOW_S (the kernel counts in 10 ms
ticks: a shorter window is noise). Other llmcli processes count like any other (core_share.py divides the cores
among them as well; the smaller of the two counts is used).

The first window begins when the process starts (the CLI calls `mark_start`), so that a model loaded in 0.1 s still
gets a reading before its first prompt is evaluated: without one, a warm server's first prompt ran on both cores
beside a busy one (SmolLM2, 34 tokens: 2.2 s instead of 0.27). A process that did not mark its start (llmcli used as
a library) waits for the rest of the first window once. Before a first pass (a model's, or a server's after idling)
the last window may hold a burst that is over — the warm run that sent the request, starting up — so a core counts
as taken only if the others held it over the last RECENT_WINDOWS readings and one of their threads is runnable at
that instant (/proc/loadavg); a server reads the load while idle (CoreShare.read_load), so that those windows are
the last ones, not an average over the idle time.
"""

from __future__ import annotations

import os
import time
from collections import deque

WINDOW_S = 0.3  # shortest window a reading covers
RECENT_WINDOWS = 3  # readings a first pass's decision looks back on (a server reads one a window while idle)
START_WITHIN_S = 5.0  # a model loaded this soon after the process started reads from its start (later: from its own)
TICK_S = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
STAT_FILE = "/proc/stat"
LOADAVG_FILE = "/proc/loadavg"  # its fourth field: the threads runnable now / all of them
TASKS_DIR = "/proc/self/task"  # this process's threads, each with its state
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # of a /proc/stat cpuN line's counters: user nice system (idle iowait) irq softirq steal


_start: tuple[int, frozenset[int], tuple[float, float, float] | None] | None = None  # (pid, CPUs, the first mark)


def _affinity() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def mark_start() -> None:
    """Where this process's first window begins: as it starts (a reading of /proc/stat, some 50 µs)."""
    global _start
    cpus = _affinity()
    _start = (os.getpid(), frozenset(cpus), _sample(cpus))


def _sample(cpus: set[int]) -> tuple[float, float, float] | None:
    """(now, busy seconds of `cpus` by anyone, this process's own CPU seconds), or None without /proc/stat."""
    busy = _busy_seconds(cpus)
    return None if busy is None else (time.monotonic(), busy, _own_seconds())


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU time spent busy so far on `cpus`, by anyone (None where /proc/stat cannot be read)."""
    busy = 0
    try:
        with open(STAT_FILE, encoding="ascii") as handle:
            for line in handle:
                if not line.startswith("cpu"):
                    break
                name, *counters = line.split()
                if name != "cpu" and int(name[3:]) in cpus:
                    busy += sum(int(counters[i]) for i in BUSY_FIELDS if i < len(counters))
    except (OSError, ValueError):
        return None
    return busy * TICK_S


def _running_others() -> int | None:
    """Threads of other processes runnable at this instant, on the whole machine: /proc/loadavg's count less this
    process's own threads in state R (the reading one among them; counted before and after, so that one of them
    going to sleep or waking meanwhile, as a server's event loop does after handing over a request, is still its
    own). None where /proc cannot be read."""
    try:
        before = _own_running()
        with open(LOADAVG_FILE, encoding="ascii") as handle:
            running = int(handle.read().split()[3].partition("/")[0])
        own = max(before, _own_running())
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - max(1, own))


def _own_running() -> int:
    own = 0
    for tid in os.listdir(TASKS_DIR):
        try:
            with open(f"{TASKS_DIR}/{tid}/stat", encoding="ascii", errors="replace") as handle:
                own += handle.read().rpartition(")")[2].split()[:1] == ["R"]
        except OSError:  # (a thread that just ended)
            continue
    return own


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class CpuLoad:
    """Cores' worth of CPU time the other processes took over the last window (0.0 until one has been read)."""

    def __init__(self) -> None:
        self.cpus = _affinity()
        self.others = 0.0
        self.read = False  # whether a reading has covered a window yet
        self.recent: deque[float] = deque(maxlen=RECENT_WINDOWS)  # the last readings' others, the latest last
        self._mark = self._sample()
        started = _start  # (a forked child inherits its parent's mark: its own pid's only)
        if started is not None and started[0] == os.getpid() and started[1] == self.cpus and started[2] is not None \
                and self._mark is not None and self._mark[0] - started[2][0] < START_WITHIN_S:
            self._mark = started[2]

    def _sample(self) -> tuple[float, float, float] | None:
        return _sample(self.cpus)

    def update(self, minimum_s: float = WINDOW_S) -> float:
        """The others' share since the last reading, once at least `minimum_s` has passed (else the last one)."""
        if self._mark is None or time.monotonic() - self._mark[0] < minimum_s:
            return self.others  # (asked every 50 ms between decode steps: /proc/stat is read once a window)
        now = self._sample()
        if now is None:
            return self.others
        elapsed = now[0] - self._mark[0]
        others_s = (now[1] - self._mark[1]) - (now[2] - self._mark[2])
        self.others = max(0.0, min(float(len(self.cpus)), others_s / elapsed))
        self.recent.append(self.others)
        self._mark, self.read = now, True
        return self.others

    def first(self, minimum_s: float = WINDOW_S) -> float:
        """The first reading: once `minimum_s` has passed since the mark, waiting for the rest when it has not."""
        if not self.read and self._mark is not None:
            time.sleep(max(0.0, minimum_s - (time.monotonic() - self._mark[0])))
        return self.update(minimum_s)

    def free_cores(self, cores: int, minimum_s: float = WINDOW_S, starting: bool = False) -> int:
        """Of `cores`, those the others leave free now (at least one): a core counts as taken once more than half of
        it is used. `starting`: before a first pass (a model's first, or a server's first after an idle time), when
        the last window may hold a burst that is over or about to be: the process that sent the request, starting up
        and reading the answer (a warm run, a script that imported its HTTP client). Then a core is taken only if
        the others held it in each of the last RECENT_WINDOWS readings and one of their threads runs now; the first
        reading is waited for (`first`), and the next window begins now: it measures the others while this process
        computes, not what came before."""
        others = self.first(minimum_s) if starting else self.update(minimum_s)
        if starting:
            others, running = min(self.recent, default=others), _running_others()
            self.others = others = others if running is None else min(others, float(running))
            if self.read:
                self._mark = self._sample() or self._mark
        return max(1, min(cores, int(cores - others + 0.5)))
