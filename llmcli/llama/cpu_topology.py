"""Facts about this machine that inference settings depend on: the cores this process may use."""

from __future__ import annotations

import math
import os
import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores this process may run on: its CPU affinity (taskset, cpusets), hyper-threads of one
    core counted once, and capped by a cgroup CPU quota (containers).

    llama.cpp decodes fastest with one thread per physical core; more threads than
    that spin against each other (4 threads on this 2-core machine: 37 tok/s, 2: 65).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = {_core_of(cpu) for cpu in cpus}
    count = len(cores) if None not in cores else len(cpus)
    quota = _cgroup_quota()
    return max(1, min(count, math.ceil(quota)) if quota else count)


def logical_cpus() -> int:
    """Logical CPUs (hyper-threads included) this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _core_of(cpu: int) -> tuple[str, str] | None:
    """(package, core) of a logical CPU, from sysfs; None when it is not shown."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:
        return None


def _cgroup_quota() -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 `cpu.max`, or v1 `cfs_quota_us`), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
