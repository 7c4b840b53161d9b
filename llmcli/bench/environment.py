"""What a benchmark ran on: the machine, the builds, the models (for records that can be compared later)."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Sequence

from llmcli.llama import cpu_topology
from llmcli.llama import llama_log as backend
from llmcli.llama.weight_buffers import weight_buffers_summary
from llmcli.store.file_hashes import sha256_of
from llmcli.store.models import ResolvedModel


def memory_bandwidth(threads: int, megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second of a large copy (read + write), split over `threads` threads; best of `repeats`."""
    import numpy as np  # a llama-cpp-python dependency

    chunk = megabytes * 1024 * 1024 // 8 // threads
    sources = [np.ones(chunk) for _ in range(threads)]
    targets = [np.empty(chunk) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(t, s)) for t, s in zip(targets, sources, strict=True)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, 2 * chunk * 8 * threads / (time.perf_counter() - started))
    return best


def machine() -> dict[str, object]:
    """The machine and the builds (cheap: no file is read)."""
    return {
        "cpu": cpu_topology.cpu_model(),
        "physical_cores": cpu_topology.physical_cores(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **backend.build_info(),
        "weight_buffers": weight_buffers_summary(),  # the extra buffer types the weights may use
    }


def environment(models: Sequence[ResolvedModel], threads: Sequence[int]) -> dict[str, object]:
    return {
        **machine(),
        "threads": list(threads),
        "models": [{"name": m.name, "path": str(m.path), "sha256": sha256_of(m.path)} for m in models],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
