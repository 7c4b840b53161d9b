"""A llama_batch with explicit positions and sequence ids: many sequences, or many tokens, in one decode."""

from __future__ import annotations

import llama_cpp


class Batch:
    """Filled with `add`, evaluated with `Engine.decode`, emptied with `clear`; reused every step."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0
        self.runs: list[tuple[int, list[int]]] = []  # what it holds, as the KV bookkeeping records it: (seq, tokens)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token at `pos` of sequence `seq`; returns its index (where its logits will be)."""
        raw, i = self.raw, self.n
        raw.token[i], raw.pos[i], raw.n_seq_id[i], raw.logits[i] = token, pos, 1, int(logits)
        raw.seq_id[i][0] = seq
        self.n += 1
        raw.n_tokens = self.n
        runs = self.runs
        if runs and runs[-1][0] == seq:
            runs[-1][1].append(token)
        else:
            runs.append((seq, [token]))
        return i

    @property
    def full(self) -> bool:
        return self.n >= self.capacity

    def clear(self) -> None:
        self.n = 0
        self.raw.n_tokens = 0
        self.runs = []

    def close(self) -> None:
        if self.raw is not None:
            llama_cpp.llama_batch_free(self.raw)
            self.raw = None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
