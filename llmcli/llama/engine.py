"""One model and one context on llama.cpp: load, evaluate, sample — the only caller of `llama_decode`.

Inference talks to llama.cpp through llama-cpp-python's C API, not its high-level `Llama`
class: that one copies the logits into numpy for every token and costs ~14% of decode speed
on a small model. The engine offers decode passes; the loop that drives them, for run, --batch
and serve alike, is the scheduler's (llmcli/decode/scheduler.py).

The public API: vocabulary (`engine.vocab`), the KV cache (`engine.kv`: keep, share, cut and shift,
save and restore sequences), `decode` of a `Batch` (any sequences), `prefill` and `evaluate` of
sequence 0 (a draft model, the bench), a `sampler` for a SamplingConfig, `greedy_token`, `embedding`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp

from llmcli.answer.context_budget import overflow
from llmcli.answer.sampling_config import SamplingConfig
from llmcli.errors import ContextLost, LlmcliError, ResourceError, UsageError
from llmcli.interrupt import Cancellation
from llmcli.llama.batch import Batch
from llmcli.llama.context_size import default_context
from llmcli.llama.core_share import CoreShare
from llmcli.llama.cpu_load import WINDOW_S, CpuLoad
from llmcli.llama.cpu_topology import physical_cores
from llmcli.llama.engine_config import FLASH_ATTN, KV_TYPES, POOLING, SIZED_START, EngineConfig, padded_cells
from llmcli.llama.kv_cache import KVCache
from llmcli.llama.llama_log import llama_backend
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.vision import Vision
from llmcli.llama.vocab import Vocabulary
from llmcli.llama.weights import load_weights
from llmcli.store.gguf_header import GGUFHeader, read_header
from llmcli.store.projector import Projector, check_projector, read_projector

FIRST_WINDOW_S = 0.2  # the first reading of what other processes take covers at least this (10 ms ticks)


class Engine:
    """One model and one context (one KV cache, `n_seq_max` sequences) loaded from a GGUF file."""

    def __init__(self, path: Path, config: EngineConfig | None = None, cancel: Cancellation | None = None):
        self.path = path
        self.config = config = config or EngineConfig()
        self.cancel = cancel if cancel is not None else Cancellation()
        self.header: GGUFHeader = read_header(path)  # pre-flight: llama.cpp never sees a malformed file
        log = llama_backend()
        log.verbose = config.verbose
        log.errors.clear()  # only what this load reports explains its failure
        started = time.perf_counter()
        load = CpuLoad() if config.n_threads is None else None  # (what other processes take, read over the load)

        self._weights = load_weights(path, config, self.cancel)
        self._model = self._weights.pointer
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(self._model)
        self.n_threads = threads = config.n_threads or physical_cores()
        self.n_swa: int = llama_cpp.llama_model_n_swa(self._model)  # sliding-window attention span (0: none)
        per_sequence = config.n_ctx or default_context(self.n_ctx_train)
        self._ctx: Any = None
        self.kv: KVCache  # what the KV cache holds, and its operations (made with the context)
        padded = padded_cells(per_sequence)
        cells = min(SIZED_START, padded) if config.kv_later else per_sequence * (1 if config.pooling else config.n_seq_max)
        try:
            self._create_context(cells, config.n_seq_max, unified=config.pooling is not None)
        except ResourceError:
            self._weights.free()
            raise
        # What one sequence may use: llama.cpp's (it pads), or, sized later, what it would have been.
        self.n_ctx: int = padded if config.kv_later else llama_cpp.llama_n_ctx_seq(self._ctx)
        self._share = CoreShare(threads, load) if load is not None else None  # --threads given: fixed
        if self._share is not None:  # about to compute: peers that start now see this one before they prefill
            self._share.register(self._share.threads(window_s=FIRST_WINDOW_S, starting=True))  # (cpu_load.mark_start)
        self.vocab = Vocabulary(llama_cpp.llama_model_get_vocab(self._model))
        self._abort = llama_cpp.ggml_abort_callback(lambda _: bool(self.cancel))  # referenced while installed
        self._one = (llama_cpp.llama_token * 1)()  # the token of a 1-token pass
        self._batch: Batch | None = None  # a pass of several tokens (a draft to verify)
        self._greedy: Any = None  # a greedy sampler, made on first use (a draft model drafts with it)
        self.projector: Projector | None = None  # a vision projector, checked against this model (`use_projector`)
        self.vision: Vision | None = None  # ... loaded on the first image (`load_vision`)
        self.load_s = time.perf_counter() - started
        self.weights_kept = not self._weights.owned  # the process's kept weights (inherited: none loaded now)

    def _create_context(self, n_cells: int, n_seq_max: int, unified: bool) -> None:
        """A llama.cpp context of `n_cells` KV cells for `n_seq_max` sequences (each its own n_cells / n_seq_max
        cells, or, `unified`, all of them in one pool); replaces the current one."""
        config = self.config
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_cells
        params.n_seq_max = n_seq_max
        params.kv_unified = unified
        params.type_k = params.type_v = KV_TYPES[config.kv_type]
        # llama.cpp keeps a quantized V cache only with flash attention
        params.flash_attn_type = FLASH_ATTN["on" if config.kv_type != "f16" else config.flash_attn]
        params.n_batch = params.n_ubatch = config.n_batch
        params.n_threads = params.n_threads_batch = self.n_threads
        params.no_perf = True
        if config.pooling is not None:
            params.embeddings, params.pooling_type = True, POOLING[config.pooling]
        if self._ctx:
            llama_cpp.llama_free(self._ctx)  # first: the two never hold memory at once
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise ResourceError(
                f"llama.cpp could not create a context of {n_cells} tokens: {llama_backend().take_error() or 'out of memory?'}",
                hint="Try a smaller --ctx-size (or --parallel).",
            )
        self.kv = KVCache(self._ctx, llama_cpp.llama_n_ctx_seq(self._ctx), self.n_swa)
        self._n_seq_max = n_seq_max

    def grow_to(self, n_cells: int) -> None:
        """Give each sequence at least `n_cells` cells (rounded up as llama.cpp pads them, at most `n_ctx`), keeping
        what every sequence holds: its state is copied into the larger cache as it is, so no answer changes (a cache
        sized to its work: run, chat, --batch). Nothing happens if the sequences have as many already."""
        cells, had, n_seq = min(padded_cells(n_cells), self.n_ctx), self.kv.n_ctx, self._n_seq_max
        if cells <= had:
            return
        kept = self.kv.snapshot()
        try:
            self.resize(cells * n_seq, n_seq)
        except ResourceError as grown:  # (memory taken since the load, or --force): the cache it had, and what it
            try:  # held, back
                self.resize(had * n_seq, n_seq)
            except ResourceError:
                raise ContextLost(f"{grown.message}; nor could the {had}-token cache it had be made again",
                                  hint=grown.hint) from None
            self.kv.take(kept)
            raise
        self.kv.take(kept)

    def resize(self, n_cells: int, n_seq_max: int) -> None:
        """A new, empty KV cache of `n_cells` cells for `n_seq_max` sequences, n_cells / n_seq_max cells each
        (run --batch sizes it to its work); an answer still ends at `n_ctx` tokens. The weights stay loaded."""
        self._create_context(n_cells, n_seq_max, unified=False)

    def use_projector(self, path: Path) -> Projector:
        """The vision projector at `path` for images in prompts: its header read and checked against this model now
        (IntegrityError), the projector itself loaded on the first image (a text prompt never waits for it)."""
        projector = read_projector(path)
        check_projector(projector, self.header)
        self.projector = projector
        return projector

    def load_vision(self) -> Vision:
        """The projector, loaded (once); UsageError when this model has none."""
        if self.vision is None:
            if self.projector is None:
                raise UsageError("this model does not see images: it has no vision projector",
                                 hint="Give the model's mmproj file with --mmproj PATH, or use a vision model.")
            self.vision = Vision(self.projector.path, self._model, self.n_threads, llama_cpp.llama_model_n_embd(self._model))
        return self.vision

    def close(self) -> None:
        vision: Vision | None = getattr(self, "vision", None)
        if vision is not None:
            vision.close()
            self.vision = None
        share: CoreShare | None = getattr(self, "_share", None)
        if share is not None:
            share.unregister()
        batch: Batch | None = getattr(self, "_batch", None)
        if batch is not None:
            batch.close()
            self._batch = None
        if getattr(self, "_greedy", None) is not None:
            llama_cpp.llama_sampler_free(self._greedy)
            self._greedy = None
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._weights.free()
            self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sharing_problem(self) -> str | None:
        """Why this engine cannot share the cores with other llmcli processes (it runs alone), or None."""
        return self._share.problem if self._share is not None else None

    @property
    def llama_context(self) -> Any:
        """The llama_context pointer, for a sampler chain that samples from its logits."""
        return self._ctx

    def kv_signature(self) -> dict[str, Any]:
        """What a saved state of the KV cache depends on besides the model file: restored into a context
        that differs in any of these it would be wrong."""
        return {
            "llama_cpp": llama_cpp.__version__,
            "system": llama_cpp.llama_print_system_info().decode("utf-8", "replace"),
            "n_ctx": self.n_ctx,
            "kv_type": self.config.kv_type,
            "flash_attn": self.config.flash_attn,  # without it the V cache is stored transposed
            "n_swa": self.n_swa,
        }

    # -- threads ----------------------------------------------------------

    @contextmanager
    def sharing_cores(self) -> Iterator[None]:
        """While generating: registered among the llmcli processes that generate, on this one's share of the cores."""
        if self._share is None:
            yield
            return
        share = self._share
        threads = share.threads(starting=True)
        share.register(threads)
        share.wait_for_room(threads)
        try:
            self.set_threads(threads)
            yield
        finally:
            share.unregister()

    def take_busy_notice(self) -> str | None:
        """Once: why decoding was slower than when idle (CoreShare.take_squeezed_notice); None with --threads."""
        return self._share.take_squeezed_notice() if self._share is not None else None

    @property
    def load_read_s(self) -> float | None:
        """While idle, how often to `read_load` (None: --threads fixed the count, nothing to read)."""
        return WINDOW_S if self._share is not None else None

    def read_load(self) -> None:
        """Idle: read what other processes take now, for the next answer's first pass (see CoreShare.read_load)."""
        if self._share is not None:
            self._share.read_load()

    def adapt_threads(self, now: float) -> None:
        """Between decode steps: take this process's share of the cores again, when a look is due."""
        share = self._share
        if share is not None and now >= share.due:
            self.set_threads(share.threads(now))

    def set_threads(self, threads: int) -> None:
        if threads != self.n_threads:
            llama_cpp.llama_set_n_threads(self._ctx, threads, threads)
            self.n_threads = threads
            if self._share is not None:
                self._share.publish(threads)

    # -- evaluation -------------------------------------------------------

    def sampler(self, sampling: SamplingConfig, seed: int, observed: bool = False) -> Sampler:
        """A sampler chain for this model, sampling from this context's logits (`observed`: a traced answer's)."""
        return Sampler(sampling, self.vocab.handle, seed, self._ctx, self.n_ctx, observed)

    def check_budget(self, n_prompt: int, max_tokens: int | None) -> None:
        if n_prompt + (max_tokens or 1) > self.n_ctx:
            raise overflow(n_prompt, max_tokens, self.n_ctx, self.n_ctx_train)

    def prefill(self, prompt: Sequence[int], start: int = 0) -> bool:
        """Evaluate prompt[start:] into sequence 0 in batches of n_batch; False when Ctrl-C aborted it
        (at once, inside a running batch)."""
        tokens = (llama_cpp.llama_token * len(prompt))(*prompt)
        item = ctypes.sizeof(llama_cpp.llama_token)
        with self.abortable():
            for begin in range(start, len(prompt), self.config.n_batch):
                count = min(self.config.n_batch, len(prompt) - begin)
                start_ptr = ctypes.cast(ctypes.addressof(tokens) + begin * item, llama_cpp.llama_token_p)
                batch = llama_cpp.llama_batch_get_one(start_ptr, count)
                if self.cancel or not self._decode_seq0(prompt[begin : begin + count], batch, "evaluating the prompt"):
                    return False
                self.adapt_threads(time.perf_counter())
        return True

    @contextmanager
    def abortable(self) -> Iterator[None]:
        """While active, Ctrl-C (`cancel`) stops a pass inside llama.cpp, between two nodes of its graph (llama_decode
        returns 2). The callback runs once a node: too costly for token-by-token passes, where Ctrl-C is checked
        between tokens instead."""
        llama_cpp.llama_set_abort_callback(self._ctx, self._abort, None)
        try:
            yield
        finally:
            llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)

    def decode(self, batch: Batch, what: str = "decoding a batch", abortable: bool = False) -> str:
        """Evaluate a batch of any sequences: `ok`; `full` when the KV cache has no room for it (nothing was
        evaluated then); `aborted` when Ctrl-C stopped it (`abortable`: at once, inside the pass — a prompt chunk;
        what llama.cpp had stored stays). As every evaluation here, what it stored is recorded in the KV
        bookkeeping (`kv`): the caller never records it."""
        if abortable:
            with self.abortable():
                rc = llama_cpp.llama_decode(self._ctx, batch.raw)
        else:
            rc = llama_cpp.llama_decode(self._ctx, batch.raw)
        if rc == 0:
            for seq, tokens in batch.runs:
                self.kv.appended(tokens, seq)
            return "ok"
        if rc == 1:
            return "full"
        if rc == 2 and self.cancel:
            for seq in {seq for seq, _ in batch.runs}:
                self.kv.resync(seq)  # the micro-batches llama.cpp stored before it stopped stay
            return "aborted"
        raise self._decode_error(rc, what)

    def decode_image(self, token: int, pos: int, seq: int) -> str:
        """Evaluate the image whose placeholder run begins with `token` into sequence `seq` at `pos` (encoded first,
        unless its embeddings are cached): `ok`, `full` (nothing evaluated) or `aborted` (Ctrl-C; what llama.cpp
        stored stays); recorded in the KV bookkeeping as `decode`'s are."""
        vision = self.vision
        assert vision is not None
        ids = vision.run(token)
        if not ids:
            raise LlmcliError("an image of the prompt is no longer prepared (more than 32 images in flight?)")
        if pos + len(ids) > self.kv.n_ctx:
            return "full"
        llama_cpp.llama_set_abort_callback(self._ctx, self._abort, None)
        try:
            rc = vision.evaluate(self._ctx, token, pos, seq, self.config.n_batch)
        finally:
            llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)
        if rc == 0:
            self.kv.appended(ids, seq)
            return "ok"
        self.kv.resync(seq)
        if self.cancel:
            return "aborted"
        raise self._decode_error(rc, "evaluating an image")

    def decode_one(self, token: int) -> str:
        """Evaluate one token appended to sequence 0: a single answer's plain step, without building a batch
        (positions from the cache itself); recorded as `decode`'s. `ok`, `full` or, failing, an error."""
        self._one[0] = token
        rc = llama_cpp.llama_decode(self._ctx, llama_cpp.llama_batch_get_one(self._one, 1))
        if rc == 0:
            self.kv.appended((token,))
            return "ok"
        if rc == 1:
            return "full"
        raise self._decode_error(rc, "decoding")

    def greedy_token(self) -> int:
        """The most likely next token after the last pass of sequence 0 (a draft model's guess)."""
        if self._greedy is None:
            self._greedy = llama_cpp.llama_sampler_init_greedy()
        return int(llama_cpp.llama_sampler_sample(self._greedy, self._ctx, -1))

    def embed(self, batch: Batch) -> None:
        """Evaluate a batch of whole texts in embedding mode (an encoder-only model encodes it)."""
        model = llama_cpp.llama_get_model(self._ctx)
        encoder_only = bool(llama_cpp.llama_model_has_encoder(model)) and not llama_cpp.llama_model_has_decoder(model)
        rc = llama_cpp.llama_encode(self._ctx, batch.raw) if encoder_only else llama_cpp.llama_decode(self._ctx, batch.raw)
        if rc != 0:
            self.kv.clear()
            raise LlmcliError(f"llama.cpp failed to embed a batch (code {rc})")

    def embedding(self, seq: int, n_embd: int) -> list[float] | None:
        """The pooled embedding of sequence `seq` after the last `embed` pass, or None (the model cannot pool)."""
        pointer = llama_cpp.llama_get_embeddings_seq(self._ctx, seq)
        return None if not pointer else list(pointer[:n_embd])

    def evaluate(self, tokens: Sequence[int], all_logits: bool = False) -> None:
        """Append `tokens` to sequence 0 in one pass: logits for the last one, or for each (a draft to verify)."""
        if len(tokens) == 1 and not all_logits:
            self._one[0] = tokens[0]
            self._decode_seq0(tokens, llama_cpp.llama_batch_get_one(self._one, 1), "decoding")
            return
        if self._batch is None or self._batch.capacity < len(tokens):
            if self._batch is not None:
                self._batch.close()
            self._batch = Batch(max(len(tokens), 16))
        batch, start = self._batch, self.kv.n_cached
        batch.clear()
        for i, token in enumerate(tokens):
            batch.add(token, start + i, 0, all_logits or i == len(tokens) - 1)
        self._decode_seq0(tokens, batch.raw, "decoding")

    def _decode_seq0(self, tokens: Sequence[int], batch: Any, what: str) -> bool:
        """Evaluate `batch` (holding `tokens`, appended to sequence 0); False when Ctrl-C aborted it."""
        self.kv.appended(tokens)
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc == 0:
            return True
        self.kv.resync()  # after an abort or error the micro-batches already processed stay in the KV cache
        if rc == 2 and self.cancel:
            return False
        raise self._decode_error(rc, what)

    def _decode_error(self, rc: int, what: str) -> LlmcliError:
        if rc == 1:
            return ResourceError(f"the KV cache is full while {what} ({self.n_ctx} tokens)", hint="Use a larger --ctx-size.")
        return LlmcliError(f"llama.cpp failed while {what} (code {rc}): {llama_backend().take_error() or 'no reason given'}")
