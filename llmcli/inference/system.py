"""Facts about this machine that inference settings depend on."""

from __future__ import annotations

import os
import platform
from functools import lru_cache


@lru_cache(maxsize=1)
def physical_cores() -> int:
    """Cores usable by this process, counting hyper-threads of one core once.

    llama.cpp decodes fastest with one thread per physical core; more threads than
    that spin against each other (4 threads on this 2-core machine: 37 tok/s, 2: 65).
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return max(1, usable)
    cores = set()
    physical = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
    if not cores:
        return max(1, usable)
    return max(1, min(usable, len(cores)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
