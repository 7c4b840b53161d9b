"""Token logprobs from llama.cpp's logits: the model's own distribution at one position (before any sampler —
temperature, top-k, a grammar — changed it), as OpenAI, llama-server and Ollama report it."""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import TokenLogprob
from llmcli.llama.vocab import Vocabulary


def token_logprob(ctx: Any, vocab: Vocabulary, index: int, token: int, n_top: int) -> TokenLogprob:
    """`token`'s logprob at batch `index` of the last decode (-1: its last logits), and the `n_top` most likely."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    logits = np.ctypeslib.as_array(pointer, shape=(vocab.n_tokens,))
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum()))
    top: tuple[tuple[int, bytes, float], ...] = ()
    if n_top > 0:
        best = largest(logits, min(n_top, len(logits)))
        best = best[np.argsort(-logits[best], kind="stable")]
        top = tuple((int(t), vocab.piece(int(t)), float(logits[t]) - log_total) for t in best)
    return TokenLogprob(token, vocab.piece(token), float(logits[token]) - log_total, top)


def largest(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of `values`' `k` largest (in no order). A strided sample's k-th largest bounds them from below, so
    only the few values at or above it are partitioned: on a 49k vocabulary ~0.03 ms, where numpy's argpartition of
    the whole array takes 0.08 ms (AVX2 EPYC) to 0.3 ms (AVX-512 EPYC, numpy 2.4) — a token's logprobs, a trace's top."""
    n = len(values)
    sample = values[::64]
    if len(sample) <= 4 * k:
        return np.argpartition(values, n - k)[n - k:]
    floor = np.partition(sample, len(sample) - k)[len(sample) - k]  # (k values of the array are at least this)
    if floor == -np.inf:  # (most of them masked, by a grammar: the finite ones, then masked ones to make k)
        above = np.flatnonzero(values > -np.inf)
        if len(above) < k:
            return np.concatenate((above, np.flatnonzero(values == -np.inf)[:k - len(above)]))
    else:
        above = np.flatnonzero(values >= floor)
    return above[np.argpartition(values[above], len(above) - k)[len(above) - k:]]
