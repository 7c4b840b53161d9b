"""Token logprobs from llama.cpp's logits: the model's own distribution at one position (before any sampler —
temperature, top-k, a grammar — changed it), as OpenAI, llama-server and Ollama report it."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import TokenLogprob
from llmcli.llama.vocab import Vocabulary


def token_logprob(ctx: Any, vocab: Vocabulary, index: int, token: int, n_top: int) -> TokenLogprob:
    """`token`'s logprob at batch `index` of the last decode (-1: its last logits), and the `n_top` most likely."""
    logits = logits_at(ctx, index, vocab.n_tokens)
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum()))
    top: tuple[tuple[int, bytes, float], ...] = ()
    if n_top > 0:
        best = largest(logits, min(n_top, len(logits)))
        best = best[np.argsort(-logits[best], kind="stable")]
        top = tuple((int(t), vocab.piece(int(t)), float(logits[t]) - log_total) for t in best)
    return TokenLogprob(token, vocab.piece(token), float(logits[token]) - log_total, top)


_VIEWS: dict[tuple[int, int], np.ndarray] = {}  # (address, n_vocab) -> a numpy view of llama.cpp's logits there
VIEWS_KEPT = 64


def logits_at(ctx: Any, index: int, n_vocab: int) -> np.ndarray:
    """The logits at batch `index` of the last decode (-1: the last), a numpy view of llama.cpp's own buffer: valid
    until the next decode, written only where llama.cpp's own sampling would (a first token's bias). The view made
    for an address llama.cpp gives is kept: numpy's view of a ctypes pointer costs ~2 µs, ~45 in the caches a model
    pass leaves (the same address is given token after token)."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    if not pointer:
        raise RuntimeError(f"llama.cpp has no logits at batch index {index}")
    address = ctypes.addressof(pointer.contents)
    found = _VIEWS.get((address, n_vocab))
    if found is None:
        if len(_VIEWS) >= VIEWS_KEPT:
            _VIEWS.clear()
        found = _VIEWS[(address, n_vocab)] = np.frombuffer(
            memoryview((ctypes.c_float * n_vocab).from_address(address)).cast("B"), dtype=np.float32)
    return found


def largest(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of `values`' `k` largest (in no order). A strided sample's few largest bound them from below, so
    only the values at or above that floor are partitioned (~ 64 a sample value: its k-th largest is a floor that
    always holds k, a lower one is tried first and counted): on a 49k vocabulary ~0.02 ms, where numpy's
    argpartition of the whole array takes 0.08 ms (AVX2 EPYC) to 0.3 ms (AVX-512 EPYC, numpy 2.4) — a token's
    logprobs, a trace's top."""
    n = len(values)
    sample = values[::64]
    m = len(sample)
    if m <= 4 * k:
        return np.argpartition(values, n - k)[n - k:]
    likely = k // 16 + 2  # (~64 values of the array at or above each sample value: ~4k + 128 above this one)
    ranked = np.partition(sample, m - likely)  # (one rank asked: the floor below, only where this one falls short)
    above = np.flatnonzero(values >= ranked[m - likely]) if ranked[m - likely] > -np.inf else None
    if above is None or len(above) < k:
        floor = np.partition(sample, m - k)[m - k]  # (k values of the array are at least this)
        if floor == -np.inf:  # (most of them masked, by a grammar: the finite ones, then masked ones to make k)
            above = np.flatnonzero(values > -np.inf)
            if len(above) < k:
                return np.concatenate((above, np.flatnonzero(values == -np.inf)[:k - len(above)]))
        else:
            above = np.flatnonzero(values >= floor)
    return above[np.argpartition(values[above], len(above) - k)[len(above) - k:]]
