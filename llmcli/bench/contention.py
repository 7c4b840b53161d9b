"""Decoding beside other work: two llmcli processes at once, as `xargs -P 2` or a chat beside a batch run them, and
one run while other processes keep cores busy (`--busy N`).

Each pair runs `llmcli run` twice side by side and reports the mean of the two decode rates: with the
default threads (each process takes its share of the cores, llmcli/llama/core_share.py) and with
`--threads` fixed at every core for both (llama.cpp's default: their spinning threads collide). A busy machine is
N processes spinning in a loop while one `llmcli run` decodes: with the default threads (what the machine gives now,
llmcli/llama/cpu_load.py) and with each fixed thread count.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONTENTION_PROMPT = "Write a long story about a dragon."


def pair_decode_rate(model: Path, gen_tokens: int, threads: int | None = None) -> float:
    """Mean decode rate (tokens/s) of two `llmcli run` processes started together."""
    return statistics.fmean(_decode_rates(model, gen_tokens, threads, 2))


def busy_decode_rate(model: Path, gen_tokens: int, threads: int | None = None) -> float:
    """The decode rate (tokens/s) of one `llmcli run` (in its own process, as a user's) on the machine as it is."""
    return _decode_rates(model, gen_tokens, threads, 1)[0]


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` other processes, each keeping a core busy (a spinning loop), while the block runs; ended after it."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _decode_rates(model: Path, gen_tokens: int, threads: int | None, count: int) -> list[float]:
    command = [sys.executable, "-m", "llmcli", "run", "-m", str(model), "--keep-alive", "0", "--json", "-q", "--temp", "0",
               "-n", str(gen_tokens), *(["-t", str(threads)] if threads else []),
               CONTENTION_PROMPT]
    env = {k: v for k, v in os.environ.items() if k != "LLMCLI_THREADS"}
    processes = [subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env) for _ in range(count)]
    rates = []
    for process in processes:
        out, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a contention run failed: {err.decode(errors='replace').strip()[:200]}")
        rates.append(float(json.loads(out)["timings"]["decode_tokens_per_s"]))
    return rates
