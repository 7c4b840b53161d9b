"""Two llmcli processes decoding at once, as `xargs -P 2` or a chat beside a batch run them.

Each pair runs `llmcli run` twice side by side and reports the mean of the two decode rates: with the
default threads (each process takes its share of the cores, llmcli/llama/core_share.py) and with
`--threads` fixed at every core for both (llama.cpp's default: their spinning threads collide).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CONTENTION_PROMPT = "Write a long story about a dragon."


def pair_decode_rate(model: Path, gen_tokens: int, threads: int | None = None) -> float:
    """Mean decode rate (tokens/s) of two `llmcli run` processes started together."""
    command = [sys.executable, "-m", "llmcli", "run", "-m", str(model), "--json", "-q", "--temp", "0",
               "-n", str(gen_tokens), *(["-t", str(threads)] if threads else []), CONTENTION_PROMPT]
    env = {k: v for k, v in os.environ.items() if k != "LLMCLI_THREADS"}
    processes = [subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env) for _ in range(2)]
    rates = []
    for process in processes:
        out, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"a contention run failed: {err.decode(errors='replace').strip()[:200]}")
        rates.append(float(json.loads(out)["timings"]["decode_tokens_per_s"]))
    return statistics.fmean(rates)
