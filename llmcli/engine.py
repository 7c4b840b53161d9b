"""Load, tokenize, prefill, decode, stop: the pipeline's steps 3-6 on llama.cpp.

Inference talks to llama.cpp here only (backend.py holds its process-wide state and messages), through
llama-cpp-python's C API, not its high-level `Llama` class: that one copies the logits
into numpy for every token and costs ~14% of decode speed on a small model. It never
prints: `Engine.generate` yields `Token` events and one final `Done`. The raw loop at the
end is the baseline `llmcli bench` measures this one against.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from llmcli.errors import IntegrityError, LlmcliError, ResourceError, UsageError
from llmcli.gguf_header import GGUFHeader, read_header
from llmcli.interrupt import Cancellation
from llmcli.backend import llama_backend, stderr_captured
from llmcli.sampling import SamplingConfig
from llmcli.stats import Stats
from llmcli.streaming import AnswerText
from llmcli.system import physical_cores

DEFAULT_MAX_CTX = 4096  # llama-cpp-python's 512 is too small for chat; the training context is often too big


def default_context(n_ctx_train: int | None) -> int:
    """The model's training context, capped at DEFAULT_MAX_CTX."""
    return min(n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int | None = None  # None: the model's training context, capped at DEFAULT_MAX_CTX
    n_threads: int | None = None  # None: one per physical core
    n_batch: int = 512  # prompt tokens evaluated per llama_decode call
    verbose: bool = False  # llama.cpp's own log lines on stderr
    mmap: bool = True  # map the file instead of reading it into memory
    mlock: bool = False  # keep the weights in RAM (no swapping)
    n_seq_max: int = 1  # parallel sequences (slots), each with n_ctx tokens of its own


@dataclass(frozen=True)
class Token:
    """A piece of the answer, safe to print: complete characters, no part of a stop sequence."""

    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # stop | length | stop_sequence | context_full | interrupted
    stats: Stats
    stop_sequence: str | None = None


class Engine:
    """One model and one context (one KV cache) loaded from a GGUF file."""

    def __init__(self, path: Path, config: EngineConfig = EngineConfig(), cancel: Cancellation | None = None):
        self.path = path
        self.config = config
        self.cancel = cancel if cancel is not None else Cancellation()
        self.header: GGUFHeader = read_header(path)  # pre-flight: llama.cpp never sees a malformed file
        log = llama_backend()
        log.verbose = config.verbose
        log.errors.clear()  # only what this load reports explains its failure
        started = time.perf_counter()

        model_params = llama_cpp.llama_model_default_params()
        # Called as loading proceeds; returning False aborts it: Ctrl-C during a load is honoured at once.
        self._load_progress = llama_cpp.llama_progress_callback(lambda progress, data: not self.cancel)
        model_params.progress_callback = self._load_progress
        model_params.load_mode = {
            (True, False): llama_cpp.LLAMA_LOAD_MODE_AUTO,  # llama.cpp picks mmap on the CPU
            (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
            (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
            (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
        }[(config.mmap, config.mlock)]
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        log.raise_if_interrupted()
        if self.cancel:
            if self._model:
                llama_cpp.llama_model_free(self._model)
            self.cancel.raise_for_signal()
        if not self._model:
            raise IntegrityError(
                f"llama.cpp could not load {path}: {log.take_error() or 'unknown reason'}",
                hint="Check that the file is a complete GGUF model supported by this llama.cpp build.",
            )
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)
        threads = config.n_threads or physical_cores()
        ctx_params = llama_cpp.llama_context_default_params()
        per_sequence = config.n_ctx or default_context(self.n_ctx_train)
        ctx_params.n_ctx = per_sequence * config.n_seq_max
        ctx_params.n_seq_max = config.n_seq_max
        ctx_params.kv_unified = False  # each sequence gets its own n_ctx cells
        ctx_params.n_batch = ctx_params.n_ubatch = config.n_batch
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ResourceError(
                f"llama.cpp could not create a context of {ctx_params.n_ctx} tokens: "
                f"{log.take_error() or 'out of memory?'}",
                hint="Try a smaller --ctx-size.",
            )
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self._ctx)  # what one sequence may use
        self.n_threads = threads
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._abort = llama_cpp.ggml_abort_callback(lambda _: bool(self.cancel))  # referenced while installed
        self._piece_buf = ctypes.create_string_buffer(256)
        self._cached: list[int] = []  # the tokens whose keys and values are in the KV cache, in order
        self.load_s = time.perf_counter() - started

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def n_cached(self) -> int:
        """Tokens whose keys and values are in the KV cache now."""
        return len(self._cached)

    def reset(self) -> None:
        """Empty the KV cache."""
        llama_cpp.llama_memory_clear(self._memory, True)
        self._cached.clear()

    # -- vocabulary -------------------------------------------------------

    def end_of_generation_tokens(self) -> tuple[int, ...]:
        return tuple(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return (llama_cpp.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", "replace")

    @property
    def bos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_eos(self._vocab))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Text to tokens; special tokens written in the text (`<|im_start|>`) are parsed as such."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, True)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def piece(self, token: int) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 character); control tokens give b''."""
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, -n, 0, False)
        return ctypes.string_at(self._piece_buf, n)

    # -- generation -------------------------------------------------------

    def check_budget(self, n_prompt: int, max_tokens: int | None) -> None:
        needed = n_prompt + (max_tokens or 1)
        if needed > self.n_ctx:
            what = f"{n_prompt} prompt tokens" + (f" + {max_tokens} max tokens" if max_tokens else "")
            raise ResourceError(
                f"{what} do not fit the context window of {self.n_ctx} tokens",
                hint=f"Use --ctx-size {_round_up(needed)} (the model was trained on {self.n_ctx_train}), "
                "a shorter input, a smaller -n, or --on-overflow truncate.",
            )

    def generate(
        self,
        prompt: Sequence[int],
        sampling: SamplingConfig,
        seed: int,
        max_tokens: int | None = None,
        stops: Sequence[str] = (),
        started: float | None = None,
        prompt_s: float = 0.0,
        load_s: float = 0.0,
    ) -> Iterator[Token | Done]:
        """Prefill `prompt` (reusing the cached prefix), then sample until a stop; yield the answer.

        `started` is the perf_counter() of the request, so TTFT counts template and tokenization.
        """
        started = time.perf_counter() if started is None else started
        self.check_budget(len(prompt), max_tokens)
        chain = self._sampler_chain(sampling, seed)
        try:
            cached = self._reuse_prefix(prompt)
            prefill_started = time.perf_counter()
            self._prefill(prompt, cached)
            prefill_s = time.perf_counter() - prefill_started
            prefilled = max(0, len(self._cached) - cached)

            answer = AnswerText(stops)
            limit = max_tokens if max_tokens is not None else sys.maxsize
            one = (llama_cpp.llama_token * 1)()
            n_out = steps = 0
            first = last = ttft = 0.0
            finish = "interrupted"
            while not self.cancel:
                token = llama_cpp.llama_sampler_sample(chain, self._ctx, -1)
                last = time.perf_counter()
                if first:
                    steps += 1
                else:
                    first = last
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    finish = "stop"
                    break
                n_out += 1
                text = answer.feed(self.piece(token))
                if text:
                    ttft = ttft or time.perf_counter() - started
                    yield Token(text)
                if answer.stop is not None:
                    finish = "stop_sequence"
                    break
                if n_out >= limit:
                    finish = "length"
                    break
                if len(self._cached) >= self.n_ctx:
                    finish = "context_full"
                    break
                one[0] = token
                self._decode((token,), llama_cpp.llama_batch_get_one(one, 1), "decoding")

            if answer.stop is None:
                text = answer.finish()
                if answer.stop is not None:
                    finish = "stop_sequence"
                if text:
                    ttft = ttft or time.perf_counter() - started
                    yield Token(text)
            done = time.perf_counter()
            stats = Stats(
                load_s=load_s,
                prompt_s=prompt_s,
                prompt_tokens=len(prompt),
                cached_tokens=cached,
                prefill_tokens=prefilled,
                prefill_s=prefill_s,
                ttft_s=ttft or ((first or done) - started),
                completion_tokens=n_out,
                decode_steps=steps,
                decode_s=last - first if steps else 0.0,
                total_s=done - started,
                seed=None if sampling.greedy else seed,
            )
            yield Done(finish, stats, answer.stop)
        finally:
            llama_cpp.llama_sampler_free(chain)

    def _sampler_chain(self, sampling: SamplingConfig, seed: int) -> Any:
        """The llama.cpp sampler chain; a grammar llama.cpp rejects is a usage error with its reason."""
        if sampling.grammar is None:
            return sampling.to_llama(llama_cpp, self._vocab, seed)
        with stderr_captured() as captured:  # the grammar parser writes its reason to fd 2, not the log
            try:
                return sampling.to_llama(llama_cpp, self._vocab, seed)
            except UsageError as exc:
                reason = " ".join(captured().split()) or llama_backend().take_error() or "no reason given"
                raise UsageError(f"{exc.message}: {reason}") from None

    def _reuse_prefix(self, prompt: Sequence[int]) -> int:
        """Keep the longest cached prefix of `prompt` (at most all but its last token); drop the rest."""
        keep = 0
        limit = min(len(self._cached), len(prompt) - 1)
        while keep < limit and self._cached[keep] == prompt[keep]:
            keep += 1
        if keep < len(self._cached):
            if not llama_cpp.llama_memory_seq_rm(self._memory, 0, keep, -1):
                llama_cpp.llama_memory_clear(self._memory, True)
                keep = 0
            del self._cached[keep:]
        return keep

    def _prefill(self, prompt: Sequence[int], start: int) -> None:
        """Evaluate prompt[start:] in batches of n_batch; Ctrl-C aborts a running batch at once."""
        tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
        item = ctypes.sizeof(llama_cpp.llama_token)
        llama_cpp.llama_set_abort_callback(self._ctx, self._abort, None)
        try:
            for begin in range(start, len(prompt), self.config.n_batch):
                count = min(self.config.n_batch, len(prompt) - begin)
                start_ptr = ctypes.cast(ctypes.addressof(tokens) + begin * item, llama_cpp.llama_token_p)
                batch = llama_cpp.llama_batch_get_one(start_ptr, count)
                if self.cancel or not self._decode(prompt[begin : begin + count], batch, "evaluating the prompt"):
                    return
        finally:
            # The callback runs once per graph node: too costly to leave on while decoding
            # token by token, where Ctrl-C is checked between tokens instead.
            llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)

    def _decode(self, tokens: Sequence[int], batch: llama_cpp.llama_batch, what: str) -> bool:
        """Evaluate `batch` (holding `tokens`); False when Ctrl-C aborted it."""
        self._cached.extend(tokens)
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc == 0:
            return True
        # After an abort or error the micro-batches already processed stay in the KV cache.
        del self._cached[max(0, llama_cpp.llama_memory_seq_pos_max(self._memory, 0) + 1) :]
        if rc == 2 and self.cancel:
            return False
        if rc == 1:
            raise ResourceError(f"the KV cache is full while {what} ({self.n_ctx} tokens)", hint="Use a larger --ctx-size.")
        raise LlmcliError(f"llama.cpp failed while {what} (code {rc}): {llama_backend().take_error() or 'no reason given'}")


class RawLoop:
    """The baseline: llama.cpp driven with no Python work per token beyond the C calls themselves.

    `llmcli bench` divides the rates of `Engine.generate` by these to show what the Python layer costs.
    Both leave the engine's KV cache empty.
    """

    def __init__(self, engine: Engine):
        self.engine = engine

    def prefill(self, tokens: Sequence[int], depth: int = 0) -> float:
        """Seconds to evaluate tokens[depth:] in batches of n_batch, after tokens[:depth] (untimed)."""
        engine = self.engine
        engine.reset()
        if depth:
            engine._prefill(tokens[:depth], 0)
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        base, item, step = ctypes.addressof(array), ctypes.sizeof(llama_cpp.llama_token), engine.config.n_batch
        decode, get_batch, token_p, ctx = llama_cpp.llama_decode, llama_cpp.llama_batch_get_one, llama_cpp.llama_token_p, engine._ctx
        started = time.perf_counter()
        for begin in range(depth, len(tokens), step):
            if decode(ctx, get_batch(ctypes.cast(base + begin * item, token_p), min(step, len(tokens) - begin))):
                raise LlmcliError("llama.cpp failed in the raw prefill loop")
        elapsed = time.perf_counter() - started
        engine.reset()
        return elapsed

    def decode(self, prompt: Sequence[int], sampling: SamplingConfig, n_tokens: int, seed: int = 0) -> float:
        """Seconds for the n_tokens - 1 {decode, sample} steps after the first sample, as `generate` counts them."""
        engine = self.engine
        engine.reset()
        engine._prefill(prompt, 0)  # untimed: the decode steps start from the same cache as generate's
        chain = sampling.to_llama(llama_cpp, engine._vocab, seed)
        sample, decode, get_one, ctx = llama_cpp.llama_sampler_sample, llama_cpp.llama_decode, llama_cpp.llama_batch_get_one, engine._ctx
        one = (llama_cpp.llama_token * 1)()
        try:
            token = sample(chain, ctx, -1)
            started = time.perf_counter()
            for _ in range(n_tokens - 1):
                one[0] = token
                if decode(ctx, get_one(one, 1)):
                    raise LlmcliError("llama.cpp failed in the raw decode loop")
                token = sample(chain, ctx, -1)
            elapsed = time.perf_counter() - started
        finally:
            llama_cpp.llama_sampler_free(chain)
            engine.reset()
        return elapsed


def _round_up(n_tokens: int) -> int:
    size = 256
    while size < n_tokens:
        size *= 2
    return size
