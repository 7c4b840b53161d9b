"""Bench rows for what choosing a token costs inside the decode loop (issue 61's "no more than --logprobs"): each
answer's tokens sampled plainly, with `--logprobs 5` (the plain sample and the token's log-probabilities), or traced
(`--trace`: the chain applied stage by stage), a model pass between each — the caches as an answer leaves them, not
a loop over the same logits, which flatters every mode (each costs ~3× less there on SmolLM2) — for the chains users
run. Only the sampling is timed; a row's sample is one answer's median, in µs a token."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmcli.answer.sampling_config import SamplingConfig
from llmcli.bench.rows import Row
from llmcli.bench.speculation import UNGROUNDED_PROMPT
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig
from llmcli.llama.logprobs import token_logprob
from llmcli.llama.sampler_trace import sample_traced

N_TOP = 5  # --logprobs 5, --trace-top 5 (its default)
MODES = ("plain", f"logprobs {N_TOP}", f"trace {N_TOP}")
CHAINS = (  # what each chain is called in the rows, and its settings
    ("greedy", SamplingConfig(temp=0)),
    ("greedy + logit bias", SamplingConfig(temp=0, logit_bias=((100, -5.0), (200, 3.0)))),
    ("default", SamplingConfig()),
    ("repeat-penalty 1.3", SamplingConfig(repeat_penalty=1.3)),
    ("top-k 0 top-p 0.9", SamplingConfig(top_k=0, top_p=0.9)),
)


def sampling_rows(path: Path, threads: int, n_batch: int, gen_tokens: int, repetitions: int,
                  row: Callable[..., Row]) -> Iterator[str]:
    """The sampling time a token of each chain in each mode (an answer of `gen_tokens` each, the modes alternated),
    and trace / logprobs for each chain."""
    with Engine(path, EngineConfig(n_ctx=256 + gen_tokens, n_threads=threads, n_batch=n_batch)) as engine:
        prompt = engine.vocab.tokenize(UNGROUNDED_PROMPT, add_special=True)
        for name, config in CHAINS:
            rows = {mode: row(f"sample {name}", mode, "µs") for mode in MODES}
            for _ in range(repetitions):
                for mode in MODES:
                    rows[mode].samples.append(_answer(engine, prompt, config, mode, gen_tokens))
                    yield f"sample {name} {mode}"
            plain, logprobs, traced = (rows[mode].mean for mode in MODES)
            if logprobs:
                row(f"sample {name}", "trace / logprobs", "x").samples.append(traced / logprobs)


def _answer(engine: Engine, prompt: list[int], config: SamplingConfig, mode: str, gen_tokens: int) -> float:
    """One answer of `gen_tokens` tokens (its end tokens sampled past: the same length in every mode): the median
    time, µs, of choosing a token."""
    engine.kv.clear()
    engine.prefill(prompt)
    times = []
    with engine.sampler(config, 7, observed=mode == MODES[2]) as sampler:  # (a traced answer's chain is observed)
        for _ in range(gen_tokens):
            started = time.perf_counter_ns()
            if mode == MODES[0]:
                token = sampler.sample(-1)
            elif mode == MODES[1]:
                token = sampler.sample(-1)
                token_logprob(sampler.ctx, engine.vocab, -1, token, N_TOP)
            else:
                token = sample_traced(sampler, engine.vocab, -1, N_TOP).token
            times.append(time.perf_counter_ns() - started)
            if engine.decode_one(token) != "ok":
                break
    return statistics.median(times) / 1000
