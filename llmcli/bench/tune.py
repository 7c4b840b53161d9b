"""`llmcli bench --tune`: which engine settings serve a model best on this machine.

One dimension at a time (threads, batch size, flash attention, KV type, mmap), each candidate is measured on
the same job — a prompt and an answer (bench's -p and -n: 512 and 128 tokens), through the raw llama.cpp loop — in rounds
that alternate the candidates (so drift hits them alike), until the time budget is spent. The best candidate
replaces the built-in default only when it is better beyond the noise (Welch's t-test at 95 %, as `bench
compare` judges); the winner of one dimension is kept while the next is measured.

The core never prints: `Tuner.run` yields progress and fills `dimensions`; the CLI renders them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmcli.answer.sampling_config import greedy_without_end
from llmcli.bench.baseline_loop import RawLoop
from llmcli.bench.compare import welch_significant
from llmcli.bench.measure import FILLER, Progress
from llmcli.config.settings import default
from llmcli.llama import cpu_topology
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig

DECODE_SAMPLE = 16  # decode steps timed per sample (the answer's time is extrapolated from their rate)
BATCH_SIZES = (64, 128, 256, 512, 1024)
MIN_ROUNDS = 2  # samples per candidate below which a dimension is not judged


@dataclass
class Candidate:
    value: Any
    job_s: list[float] = field(default_factory=list)  # seconds for the job, one per round
    prefill_tps: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """mean, sd and n of the job time, as bench rows carry them (for the significance test)."""
        n = len(self.job_s)
        return {"mean": statistics.fmean(self.job_s) if n else 0.0,
                "sd": statistics.stdev(self.job_s) if n > 1 else 0.0, "n": n}


@dataclass
class Dimension:
    setting: str  # the settings-table name it tunes
    candidates: list[Candidate]
    baseline: Any  # the value llmcli uses without a profile (the built-in default, as this machine resolves it)
    winner: Any = None  # the value chosen: the best, if better than the baseline beyond the noise; else the baseline
    verdict: str = "not measured (time budget)"

    def __post_init__(self) -> None:
        self.winner = self.baseline  # until measured and judged

    def judge(self) -> None:
        measured = [c for c in self.candidates if len(c.job_s) >= MIN_ROUNDS]
        base = next((c for c in measured if c.value == self.baseline), None)
        if base is None or len(measured) < 2:
            self.winner = self.baseline
            return
        best = min(measured, key=lambda c: c.summary()["mean"])
        if best is base:
            self.winner, self.verdict = self.baseline, "the default is best"
        elif welch_significant(base.summary(), best.summary()):
            gain = base.summary()["mean"] / best.summary()["mean"]
            self.winner, self.verdict = best.value, f"{gain:.2f}× faster than the default"
        else:
            self.winner, self.verdict = self.baseline, f"{best.value} is within the noise of the default: kept the default"

    @property
    def won(self) -> bool:
        return self.winner is not None and self.winner != self.baseline


def thread_candidates(cores: int, logical: int) -> list[int]:
    """1, 2, 4, … up to the physical cores, the cores themselves, and the logical CPUs if there are more."""
    found = {1, cores, logical}
    step = 2
    while step < cores:
        found.add(step)
        step *= 2
    return sorted(found)


class Tuner:
    def __init__(self, path: Path, budget_s: float, prompt_tokens: int = 512, answer_tokens: int = 128, rounds: int = 8):
        self.path, self.budget_s, self.rounds = path, budget_s, rounds
        self.prompt_tokens, self.answer_tokens = prompt_tokens, answer_tokens
        cores = cpu_topology.physical_cores()
        self.config = EngineConfig(n_ctx=prompt_tokens + DECODE_SAMPLE + 64, n_threads=cores)
        # batch sizes beyond the prompt would all evaluate it in one step: the default stands for them
        batch_sizes = sorted({b for b in BATCH_SIZES if b <= prompt_tokens} | {default("batch_size")})
        self.dimensions = [
            Dimension("threads", [Candidate(t) for t in thread_candidates(cores, cpu_topology.logical_cpus())], cores),
            Dimension("batch_size", [Candidate(b) for b in batch_sizes], default("batch_size")),
            Dimension("flash_attn", [Candidate(v) for v in ("auto", "on", "off")], default("flash_attn")),
            Dimension("kv_type", [Candidate(v) for v in ("f16", "q8_0")], default("kv_type")),
            Dimension("mmap", [Candidate(v) for v in (True, False)], default("mmap")),
        ]
        self.elapsed_s = 0.0

    def run(self) -> Iterator[Progress]:
        """Measure dimension after dimension within the budget; yields progress (done, total, what)."""
        started = time.perf_counter()
        total = sum(len(d.candidates) for d in self.dimensions) * self.rounds
        done = 0
        for index, dimension in enumerate(self.dimensions):
            if len(dimension.candidates) < 2:  # (batch sizes, for a prompt shorter than the smallest other)
                dimension.verdict = "one value applies: nothing to compare"
                continue
            if time.perf_counter() - started > self.budget_s:
                break  # the budget is spent: the rest is reported as not measured
            # this dimension's share: what is left of the budget, over the dimensions still to measure
            to_measure = sum(len(d.candidates) > 1 for d in self.dimensions[index:])
            per_dimension = (self.budget_s - (time.perf_counter() - started)) / to_measure
            dimension_started = time.perf_counter()
            for round_number in range(self.rounds):
                spent = time.perf_counter() - dimension_started
                if round_number >= MIN_ROUNDS and spent * (round_number + 1) / round_number > per_dimension:
                    break  # a dimension begun gets its MIN_ROUNDS rounds; more only while they fit its share
                for candidate in dimension.candidates:
                    if dimension.setting == "flash_attn" and candidate.value == "off" and self.config.kv_type != "f16":
                        continue
                    self._measure(dimension.setting, candidate)
                    done += 1
                    yield Progress(done, total, f"{dimension.setting} = {_shown(candidate.value)}")
            dimension.judge()
            if dimension.won:
                self.config = _with(self.config, dimension.setting, dimension.winner)
            done = sum(len(d.candidates) for d in self.dimensions[: index + 1]) * self.rounds
        self.elapsed_s = time.perf_counter() - started

    def _measure(self, setting: str, candidate: Candidate) -> None:
        config = _with(self.config, setting, candidate.value)
        if config.kv_type != "f16" and config.flash_attn == "off":
            config = replace(config, flash_attn="on")
        with Engine(self.path, config) as engine:
            corpus = engine.vocab.tokenize(FILLER * (self.prompt_tokens // 20 + 8), add_special=True)[: self.prompt_tokens]
            loop = RawLoop(engine)
            sampling = greedy_without_end(engine.vocab.end_of_generation_tokens())
            loop.prefill(corpus[:32])  # warm: the graphs are built, the weights paged in
            prefill_s = loop.prefill(corpus)
            decode_s = loop.decode(corpus, sampling, DECODE_SAMPLE + 1) / DECODE_SAMPLE
            candidate.load_s.append(engine.load_s)
        candidate.prefill_tps.append(len(corpus) / prefill_s)
        candidate.decode_tps.append(1 / decode_s)
        # mmap changes nothing once loaded: its job includes the load
        candidate.job_s.append(prefill_s + self.answer_tokens * decode_s + (engine.load_s if setting == "mmap" else 0.0))

    def profile(self) -> dict[str, Any]:
        """The settings that won (better than the default beyond the noise), for a config profile."""
        return {d.setting: d.winner for d in self.dimensions if d.won}


def _with(config: EngineConfig, setting: str, value: Any) -> EngineConfig:
    field_name = {"threads": "n_threads", "batch_size": "n_batch"}.get(setting, setting)
    return replace(config, **{field_name: value})


def _shown(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
