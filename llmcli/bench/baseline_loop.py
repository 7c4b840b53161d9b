"""The baseline: llama.cpp driven with no Python work per token beyond the C calls themselves.

`llmcli bench` divides the rates of the engine's own loop (`bench/measure.py`) by these to show what the Python layer costs.
Both leave the engine's KV cache empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Sequence

import llama_cpp

from llmcli.answer.sampling_config import SamplingConfig
from llmcli.errors import LlmcliError
from llmcli.llama.engine import Engine


class RawLoop:
    """`stoppable`: the engine's cancellation (Ctrl-C) ends a measure — inside a prefill pass too, at the next node of
    its graph — with KeyboardInterrupt; off (bench's baseline), llama.cpp's raw loop and nothing else."""

    def __init__(self, engine: Engine, stoppable: bool = False):
        self.engine, self.stoppable = engine, stoppable

    def _stop_if_asked(self) -> None:
        if self.stoppable and self.engine.cancel:
            self.engine.kv.clear()
            raise KeyboardInterrupt

    def prefill(self, tokens: Sequence[int], depth: int = 0) -> float:
        """Seconds to evaluate tokens[depth:] in batches of n_batch, after tokens[:depth] (untimed)."""
        engine = self.engine
        engine.kv.clear()
        if depth:
            engine.prefill(tokens[:depth])
        self._stop_if_asked()
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        base, item, step = ctypes.addressof(array), ctypes.sizeof(llama_cpp.llama_token), engine.config.n_batch
        decode, get_batch, token_p = llama_cpp.llama_decode, llama_cpp.llama_batch_get_one, llama_cpp.llama_token_p
        ctx = engine.llama_context
        with engine.abortable() if self.stoppable else contextlib.nullcontext():
            started = time.perf_counter()
            for begin in range(depth, len(tokens), step):
                if decode(ctx, get_batch(ctypes.cast(base + begin * item, token_p), min(step, len(tokens) - begin))):
                    self._stop_if_asked()
                    raise LlmcliError("llama.cpp failed in the raw prefill loop")
            elapsed = time.perf_counter() - started
        engine.kv.clear()
        self._stop_if_asked()
        return elapsed

    def decode(self, prompt: Sequence[int], sampling: SamplingConfig, n_tokens: int, seed: int = 0) -> float:
        """Seconds for the n_tokens - 1 {decode, sample} steps after the first sample, as `generate` counts them."""
        engine = self.engine
        engine.kv.clear()
        engine.prefill(prompt)  # untimed: the decode steps start from the same cache as generate's
        self._stop_if_asked()
        sample, decode, get_one = llama_cpp.llama_sampler_sample, llama_cpp.llama_decode, llama_cpp.llama_batch_get_one
        ctx = engine.llama_context
        one = (llama_cpp.llama_token * 1)()
        cancel = engine.cancel if self.stoppable else None  # (looked at between tokens: no more than a branch)
        try:
            with engine.sampler(sampling, seed) as sampler:
                chain = sampler.chain
                token = sample(chain, ctx, -1)
                started = time.perf_counter()
                for _ in range(n_tokens - 1):
                    one[0] = token
                    if decode(ctx, get_one(one, 1)):
                        raise LlmcliError("llama.cpp failed in the raw decode loop")
                    token = sample(chain, ctx, -1)
                    if cancel:
                        raise KeyboardInterrupt
                elapsed = time.perf_counter() - started
        finally:
            engine.kv.clear()
        return elapsed
