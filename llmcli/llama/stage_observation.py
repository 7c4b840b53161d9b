"""What each stage of a traced answer's sampler chain left, seen from inside llama.cpp's own `llama_sampler_sample`
(`run --trace`): a small sampler of ours after each stage of the chain, which copies what the stage left — the
candidates it kept (a cut: top-k, top-p, min-p; a temperature's logits), or, where it kept the whole vocabulary in
place (a logit bias), the logits of the few tokens it moved; none after a temperature (its division is the
reader's). The chain fills its candidates, cuts and sorts them in C, as an untraced answer's does; sampler_trace.py
reads what was seen. Only a traced answer's chain has them (Sampler(observed=True)): an untraced one is the same chain
without them."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import llama_cpp

_APPLY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # (sampler, llama_token_data_array *): as addresses
_NAME = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_NAME_TEXT = ctypes.create_string_buffer(b"llmcli-observe")
_name = _NAME(lambda _sampler: ctypes.addressof(_NAME_TEXT))  # (llama.cpp may ask a sampler's name: it is never NULL)


class Seen:
    """What one stage left, the last time the chain ran: `size` candidates; `raw` their bytes (id, logit, p: 12 a
    candidate) where the stage cut or reordered them; where it kept the whole vocabulary in place, `moved` the
    logits of the tokens `touched` names (`moved_ids`, as they were then). Plain Python, no numpy call: each is
    ~10 µs the first time after a model pass."""

    __slots__ = ("name", "size", "raw", "moved", "moved_ids", "touched", "n_vocab", "narrow", "_whole", "_rows",
                 "_narrower")

    def __init__(self, name: str, n_vocab: int):
        self.name, self.n_vocab = name, n_vocab
        self._whole = ctypes.c_float * (3 * n_vocab)  # (the array as floats: its type made once, ~10 µs)
        self.size = 0
        self.raw = b""
        self._rows: tuple[list[int], list[float]] | None = None
        self.moved: list[float] | None = None
        self.moved_ids: list[int] = []
        self.touched: Callable[[], list[int]] | None = None  # (set by the reader: the tokens a bias moves)
        self.narrow = 0  # (set by the reader: before a greedy choice, keep only this many of the largest: `_narrowed`)
        self._narrower: Any = None  # (llama.cpp's top-k of `narrow`, made when first asked)

    def take(self, address: int) -> None:
        """What the candidate array at `address` (a llama_token_data_array) holds now."""
        data = _pointer(address).value or 0
        size = self.size = _size(address + 8).value
        if size == self.n_vocab and self.touched is not None:  # (kept in place, in id order: a few tokens' logits)
            self.moved_ids = self.touched()
            values = self._whole.from_address(data)
            self.moved = [values[3 * token + 1] for token in self.moved_ids]
            if self.narrow:
                self._narrowed(address, data)
            return
        self.moved, self._rows = None, None
        self.raw = ctypes.string_at(data, 12 * size)

    def _narrowed(self, address: int, data: int) -> None:
        """Before a greedy choice: the array cut to its `narrow` largest, in order (llama.cpp's top-k, in C) and kept
        in `raw` — the most likely, the trace's candidates, found without a pass of numpy's. Greedy takes the first
        largest logit in the array's order, the lowest id of those tied: the one it would have taken from the whole
        vocabulary is put first."""
        if self._narrower is None:
            self._narrower = llama_cpp.llama_sampler_init_top_k(self.narrow)
        array = llama_cpp.llama_token_data_array.from_address(address)
        llama_cpp.llama_sampler_apply(self._narrower, ctypes.byref(array))
        size = int(array.size)
        rows = (llama_cpp.llama_token_data * self.n_vocab).from_address(data)
        best = rows[0].logit
        tied = [i for i in range(size) if rows[i].logit == best]
        if len(tied) == size < self.n_vocab:  # (more tied than kept: the lowest id of all of them)
            ids = [i for i in range(self.n_vocab) if rows[i].logit == best]
            tied = [min(ids, key=lambda i: int(rows[i].id))]
        first = min(tied, key=lambda i: int(rows[i].id))
        if first:
            rows[0], rows[first] = llama_cpp.llama_token_data(rows[first].id, rows[first].logit, rows[first].p), \
                llama_cpp.llama_token_data(rows[0].id, rows[0].logit, rows[0].p)
        self.raw, self._rows = ctypes.string_at(data, 12 * size), None

    def close(self) -> None:
        if self._narrower is not None:
            llama_cpp.llama_sampler_free(self._narrower)
            self._narrower = None

    def rows(self) -> tuple[list[int], list[float]]:
        """The candidates' ids and logits, in the stage's order."""
        if self._rows is None:
            view = memoryview(self.raw)
            logits: list[float] = view.cast("f")[1::3].tolist()  # type: ignore[assignment]  # (typeshed says int)
            self._rows = view.cast("i")[0::3].tolist(), logits
        return self._rows


_pointer, _size = ctypes.c_void_p.from_address, ctypes.c_size_t.from_address


class Observation:
    """The observing samplers of one chain, in the chain's order (`seen`), and their addresses (the stage list of a
    chain leaves them out)."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self.seen: list[Seen] = []
        self.addresses: set[int] = set()
        self.readable: bool | None = None  # (whether the chain's shape is one its records are read for: not yet asked)
        self.selector = ""  # (the chain's last stage, which picks the token)
        self._kept: list[Any] = []  # (the callbacks and interfaces llama.cpp points to: alive as long as the chain)

    def after(self, name: str) -> Any:
        """A new observing sampler for the stage `name` (added to the chain after it: the chain owns and frees it);
        None after a temperature, which divides each candidate's logit by itself: the reader divides them (a call
        from C into Python costs ~15 µs the first time after a model pass)."""
        if name == "temp":
            return None
        seen = Seen(name, self.n_vocab)

        def apply(_sampler: int, array: int) -> None:
            try:
                seen.take(array)
            except Exception:  # (never into llama.cpp: the reader says it could not see this stage)
                seen.size = -1

        callback = _APPLY(apply)
        interface = llama_cpp.llama_sampler_i()
        interface.name = ctypes.cast(_name, llama_cpp.llama_sampler_i_name)
        interface.apply = ctypes.cast(callback, llama_cpp.llama_sampler_i_apply)
        sampler = llama_cpp.llama_sampler_init(ctypes.pointer(interface), None)
        self._kept += [callback, interface]
        self.seen.append(seen)
        self.addresses.add(ctypes.cast(sampler, ctypes.c_void_p).value or 0)
        return sampler

    def close(self) -> None:
        for seen in self.seen:
            seen.close()
