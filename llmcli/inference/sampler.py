"""A SamplingConfig as llama.cpp's sampler chain: the one mapping point to llama.cpp's sampler names.

Chain order, llama.cpp's own (common/sampling.cpp) for the same controls:

    logit-bias -> grammar -> penalties -> top-k -> typical-p -> top-p -> min-p -> temperature -> dist
    mirostat 1/2:   logit-bias -> grammar -> penalties -> temperature -> mirostat
    greedy (temp 0): logit-bias -> grammar -> penalties -> greedy

llama.cpp applies the grammar after sampling and resamples on a rejected token; applying it
first, as here, gives the same distribution at a higher cost per token (only when a grammar is set).
"""

from __future__ import annotations

from typing import Any

import llama_cpp

from llmcli.errors import UsageError
from llmcli.inference.backend import llama_backend, stderr_captured
from llmcli.inference.sampling import SamplingConfig


class Sampler:
    """A llama.cpp sampler chain for one answer, reading the logits of context `ctx`; close() frees it."""

    def __init__(self, config: SamplingConfig, vocab: Any, seed: int, ctx: Any):
        self.seed = seed
        self.ctx = ctx
        if config.grammar is None:
            self.chain = _build_chain(config, vocab, seed)
            return
        with stderr_captured() as captured:  # the grammar parser writes its reason to fd 2, not the log
            try:
                self.chain = _build_chain(config, vocab, seed)
            except UsageError as exc:
                reason = " ".join(captured().split()) or llama_backend().take_error() or "no reason given"
                raise UsageError(f"{exc.message}: {reason}") from None

    def sample(self, index: int = -1) -> int:
        """The next token from the logits at batch `index` (-1: the last)."""
        return int(llama_cpp.llama_sampler_sample(self.chain, self.ctx, index))

    def close(self) -> None:
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _build_chain(config: SamplingConfig, vocab: Any, seed: int) -> Any:
    params = llama_cpp.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def add(sampler: Any, what: str = "") -> None:
        if not sampler:
            llama_cpp.llama_sampler_free(chain)
            raise UsageError(f"llama.cpp rejected the {what or 'sampler settings'}")
        llama_cpp.llama_sampler_chain_add(chain, sampler)

    if config.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(config.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in config.logit_bias))
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(config.logit_bias), biases))
    if config.grammar is not None:
        add(llama_cpp.llama_sampler_init_grammar(vocab, config.grammar.encode(), b"root"),
            f"grammar from {config.grammar_origin}")
    if config.repeat_penalty != 1.0 or config.presence_penalty or config.frequency_penalty:
        add(llama_cpp.llama_sampler_init_penalties(
            n_vocab, config.repeat_last_n, config.repeat_penalty, config.frequency_penalty, config.presence_penalty
        ))
    if config.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
    elif config.mirostat == 1:
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, config.mirostat_tau, config.mirostat_eta, 100))
    elif config.mirostat == 2:
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_mirostat_v2(seed, config.mirostat_tau, config.mirostat_eta))
    else:
        if config.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(config.top_k))
        if config.typical_p < 1:
            add(llama_cpp.llama_sampler_init_typical(config.typical_p, 1))
        if config.top_p < 1:
            add(llama_cpp.llama_sampler_init_top_p(config.top_p, 1))
        if config.min_p > 0:
            add(llama_cpp.llama_sampler_init_min_p(config.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain
