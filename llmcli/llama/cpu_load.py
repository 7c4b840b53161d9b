"""What the machine can give now: the CPU time other processes take on the cores this process may run on.

llama.cpp's threads wait for each other at every pass, so one thread that shares its core with a busy process holds
all of them back: with another process busy on one of two cores, two threads decoded SmolLM2 at 2.5 tok/s where one
thread gave 30. The default thread count is therefore the cores this process may use less what the others take now,
read from /proc/stat (every CPU in this process's affinity: user, nice, system, irq, softirq and a hypervisor's
steal) less this process's own CPU time (os.times), over windows of at least WINDOW_S (the kernel counts in 10 ms
ticks: a shorter window is noise). Other llmcli processes count like any other (core_share.py divides the cores
among them as well; the smaller of the two counts is used).
"""

from __future__ import annotations

import os
import time

WINDOW_S = 0.3  # shortest window a reading covers
TICK_S = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
STAT_FILE = "/proc/stat"
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # of a /proc/stat cpuN line's counters: user nice system (idle iowait) irq softirq steal


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


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class CpuLoad:
    """Cores' worth of CPU time the other processes took over the last window (0.0 until one has been read)."""

    def __init__(self) -> None:
        self.cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.others = 0.0
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self.cpus)
        return None if busy is None else (time.monotonic(), busy, _own_seconds())

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
        self._mark = now
        return self.others

    def free_cores(self, cores: int, minimum_s: float = WINDOW_S) -> int:
        """Of `cores`, those the others leave free now (at least one): a core counts as taken once more than half of
        it is used."""
        return max(1, min(cores, int(cores - self.update(minimum_s) + 0.5)))
