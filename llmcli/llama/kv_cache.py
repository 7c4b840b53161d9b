"""The KV cache of one llama.cpp context: which tokens each sequence holds, and what can be done to them
without evaluating anything — keep a prefix, share it, cut a span out and shift the rest, save the
state to bytes and load it back.

The scheduler evaluates (and records here what it evaluated into which sequence); the prompt cache, chat,
--batch and serve use these operations. Sequence 0 is the one a single answer (run, chat) uses.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp

from llmcli.answer.shared_prefix import shared_prefix
from llmcli.errors import LlmcliError


@dataclass(frozen=True)
class Snapshot:
    """A KV cache's contents as bytes (`KVCache.snapshot`): sequence -> (tokens, llama.cpp's state), and the
    checkpoints."""

    sequences: dict[int, tuple[list[int], memoryview]]
    checkpoints: dict[int, tuple[list[int], memoryview]]


class KVCache:
    def __init__(self, ctx: Any, n_ctx: int, n_swa: int):
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.n_ctx = n_ctx  # cells one sequence may use
        self.n_swa = n_swa  # the model's sliding-window span (0: none): its state holds only the last window
        self._held: dict[int, list[int]] = {0: []}  # sequence -> the tokens whose keys and values are cached, in order
        # Where a prefill of a sliding-window model was split, per sequence: (tokens, state bytes); `checkpoint_here`.
        self.checkpoints: dict[int, tuple[list[int], memoryview]] = {}

    @property
    def _tokens(self) -> list[int]:
        return self._held[0]

    @property
    def n_cached(self) -> int:
        """Tokens of sequence 0 in the cache now."""
        return len(self._held[0])

    def n_held(self, seq: int) -> int:
        """Tokens of sequence `seq` in the cache now."""
        return len(self._held.get(seq, ()))

    @property
    def tokens(self) -> list[int]:
        """The tokens of sequence 0 in the cache, in order (a copy)."""
        return list(self._held[0])

    def tokens_of(self, seq: int) -> list[int]:
        """The tokens of sequence `seq` in the cache, in order (a copy)."""
        return list(self._held.get(seq, ()))

    def shared_prefix(self, prompt: Sequence[int], seq: int = 0) -> int:
        """How many leading tokens of `prompt` sequence `seq` holds now."""
        return shared_prefix(self._held.get(seq, ()), prompt)

    # -- bookkeeping of what the engine evaluates ----------------------------------------------

    def appended(self, tokens: Sequence[int], seq: int = 0) -> None:
        """`tokens` were evaluated into sequence `seq`, after the ones it holds."""
        self._held.setdefault(seq, []).extend(tokens)

    def resync(self, seq: int = 0) -> None:
        """After a failed or aborted evaluation: keep what llama.cpp did store (its micro-batches so far)."""
        held = self._held.setdefault(seq, [])
        del held[max(0, llama_cpp.llama_memory_seq_pos_max(self._memory, seq) + 1) :]

    # -- editing ---------------------------------------------------------------------------------

    def clear(self) -> None:
        """Empty the cache, every sequence."""
        llama_cpp.llama_memory_clear(self._memory, True)
        self._held = {0: []}

    def remove(self, seq: int, start: int = 0, end: int = -1) -> bool:
        """Drop positions [start, end) of sequence `seq` (end -1: to its end); False if llama.cpp cannot."""
        removed = bool(llama_cpp.llama_memory_seq_rm(self._memory, seq, start, end))
        if removed and seq in self._held:
            del self._held[seq][start : None if end < 0 else end]
        return removed

    def copy(self, source: int, target: int) -> None:
        """Give `target` (empty) what sequence `source` holds, whole: llama.cpp copies between the sequences of
        a non-unified cache no other way."""
        llama_cpp.llama_memory_seq_cp(self._memory, source, target, 0, -1)
        self._held[target] = list(self._held.get(source, ()))

    def cut(self, start: int, end: int) -> bool:
        """Drop positions [start, end) of sequence 0 and move the later ones back by end - start (a context
        shift: their keys are rotated to the new positions, nothing is evaluated again); False when this
        model's cache cannot shift (the cache is unchanged then)."""
        if not (0 <= start < end <= len(self._tokens)) or not llama_cpp.llama_memory_can_shift(self._memory):
            return False
        if not llama_cpp.llama_memory_seq_rm(self._memory, 0, start, end):
            return False
        llama_cpp.llama_memory_seq_add(self._memory, 0, end, -1, start - end)
        del self._tokens[start:end]
        return True

    def keep_prefix(self, prompt: Sequence[int], seq: int = 0, at_least: int = 1) -> int:
        """Keep the longest prefix of `prompt` sequence `seq` holds (at most all but its last token: its logits
        are needed) when it has `at_least` tokens or is all of that, and drop the rest; returns how many are kept."""
        keep = self.shared_prefix(prompt[: len(prompt) - 1], seq)
        if keep < min(at_least, len(prompt) - 1):
            keep = 0
        # A sliding-window cache may lack the positions the next token must see (llama-server's check).
        if keep and llama_cpp.llama_memory_seq_pos_min(self._memory, seq) > max(0, keep - max(1, self.n_swa)):
            keep = 0
        if keep < self.n_held(seq) and not self.remove(seq, keep, -1):
            self.remove(seq)  # whole: always possible
            self._held[seq] = []
            keep = 0
        return keep

    # -- saved states ----------------------------------------------------------------------------

    def seq_bytes(self, seq: int) -> int:
        """The size of sequence `seq`'s cells (keys, values, positions), as llama.cpp would save them."""
        return int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))

    def state_of(self, seq: int) -> memoryview:
        """llama.cpp's state of sequence `seq` (its cells' keys and values, and positions), as bytes."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        return memoryview(buffer).cast("B")[:written]

    def load_state(self, seq: int, payload: memoryview) -> bool:
        """Put a state from `state_of` into sequence `seq` (empty before); False if llama.cpp refuses it."""
        source = (ctypes.c_uint8 * payload.nbytes).from_buffer(payload)
        return bool(llama_cpp.llama_state_seq_set_data(self._ctx, source, payload.nbytes, seq))

    def snapshot(self) -> Snapshot:
        """What every sequence holds (its tokens and state) and the checkpoints, as bytes: what another context of
        this model takes back with `take` (a larger one: the cache grows, no answer changes)."""
        return Snapshot({seq: self.save_state(seq) for seq, tokens in self._held.items() if tokens}, dict(self.checkpoints))

    def take(self, snapshot: Snapshot) -> None:
        """Load a `snapshot` into this (empty) cache; LlmcliError if llama.cpp refuses a state it made itself."""
        for seq, (tokens, state) in snapshot.sequences.items():
            if not self.load_state(seq, state):
                raise LlmcliError("llama.cpp refused a sequence's own state while growing the KV cache")
            self.appended(tokens, seq)
        self.checkpoints.update(snapshot.checkpoints)

    def save_state(self, seq: int = 0) -> tuple[list[int], memoryview]:
        """A sequence's tokens and llama.cpp's state of them (bytes)."""
        return self.tokens_of(seq), self.state_of(seq)

    def restore_state(self, tokens: Sequence[int], payload: memoryview, seq: int = 0) -> bool:
        """Replace sequence `seq` with a saved state of `tokens`; False (and an empty sequence) if llama.cpp refuses
        it. The caller checks the bytes first: llama.cpp detects a damaged header but not damaged values."""
        self.remove(seq)
        self._held[seq] = []
        if len(tokens) > self.n_ctx:
            return False
        if not self.load_state(seq, payload) or llama_cpp.llama_memory_seq_pos_max(self._memory, seq) + 1 != len(tokens):
            self.remove(seq)
            return False
        self._held[seq] = list(tokens)
        return True

    def checkpoint_here(self, seq: int = 0) -> bool:
        """At the split point of a prefill: keep the state of sequence `seq` for the prompt cache to save later.

        A sliding-window model's state holds only the last window, and restoring it lays the cells out
        differently from a context that evaluated everything, which changes the rounding of later steps.
        So such a model continues from the restored checkpoint, cold or warm: the same numbers, and the same
        greedy answer, with or without the prompt cache (a copy of the window: milliseconds). False if
        llama.cpp refused its own state (the sequence is empty then)."""
        if self.n_swa <= 0:
            return True
        tokens, payload = self.save_state(seq)
        data = memoryview(bytearray(payload))
        if not self.restore_state(tokens, data, seq):
            return False
        self.checkpoints[seq] = (tokens, data)
        return True
