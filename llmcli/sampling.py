"""How the next token is chosen: one frozen config, validated, mapped once to llama.cpp's sampler chain.

Chain order (llama.cpp's own for the same controls):
penalties -> top-k -> top-p -> min-p -> temperature -> dist (seeded).
A temperature of 0 means greedy: penalties -> greedy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from llmcli.errors import UsageError

DEFAULT_TEMPERATURE = 0.8


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None  # None: a fresh random seed for every answer

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "--temp", "must be >= 0"),
            (self.top_k >= 0, "--top-k", "must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "--top-p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "--min-p", "must be in [0, 1]"),
            (self.repeat_penalty > 0, "--repeat-penalty", "must be > 0"),
            (self.repeat_last_n >= -1, "--repeat-last-n", "must be >= -1 (-1: whole context)"),
            (self.seed is None or 0 <= self.seed < 2**32, "--seed", "must be in [0, 2^32)"),
        ]
        for ok, flag, rule in checks:
            if not ok:
                raise UsageError(f"{flag} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def to_llama(self, llama_cpp: Any, vocab: Any, seed: int) -> Any:
        """Build the llama.cpp sampler chain; the caller frees it with `llama_sampler_free`."""
        del vocab  # grammar and logit-bias samplers need it; none is used yet
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = llama_cpp.llama_sampler_chain_init(params)
        add = lambda sampler: llama_cpp.llama_sampler_chain_add(chain, sampler)  # noqa: E731
        if self.repeat_penalty != 1.0:
            add(llama_cpp.llama_sampler_init_penalties(self.repeat_last_n, self.repeat_penalty, 0.0, 0.0))
        if self.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
            return chain
        if self.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(self.top_k))
        if self.top_p < 1:
            add(llama_cpp.llama_sampler_init_top_p(self.top_p, 1))
        if self.min_p > 0:
            add(llama_cpp.llama_sampler_init_min_p(self.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(self.temperature))
        add(llama_cpp.llama_sampler_init_dist(seed))
        return chain

    def effective_seed(self) -> int:
        """The configured seed, else a fresh random one (reported in the stats so a run can be repeated)."""
        return self.seed if self.seed is not None else random.randrange(2**32 - 1)
