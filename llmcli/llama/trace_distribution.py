"""The probabilities a traced stage's candidates make (`run --trace`, sampler_trace.py): each a distribution kept as
small as what the stage left — its logits and its softmax's sum, a token's probability computed only when it is
shown — and whether a stage changed it by more than CHANGED, found without the whole vocabulary's probabilities where
that can be: a stage that moved a few logits folded into the sum before it, a cut's left-out mass read off the
weights the softmax already computed or off the kept candidates' own."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from llmcli.llama.logprobs import largest

Folded = tuple["Distribution", np.ndarray, "np.ndarray | list[float]", np.ndarray]  # (the distribution before, the
# tokens moved, their weights exp(logit - top), their logits)


class Distribution:
    """The probabilities a stage's candidates make: token `ids[i]`'s is exp(logits[i] - top) / total (`ids` None:
    every token, `logits` indexed by token); a token not among them has 0. Computed only for the tokens asked, never
    for the whole vocabulary. Over the whole vocabulary: `weights`, exp(logits - top) as float32 once multiplied by
    `scale` (what a cut left out is summed from them), or `folded` — the distribution a stage moved a few logits
    of, those tokens, their new weights and logits — to make them (and the logits) from when asked; `peak`: `top`
    is the largest logit. `change`: the largest difference from the stage before, when that was known on the way (a
    fold, a cut of a cut's last candidates) — a fold's, one difference past CHANGED where it has one (all that is
    asked of it), else the largest. `p`: a cut's probabilities, made with it (a few candidates). Not changed once
    made (a plain class: a frozen dataclass's fields cost ~2 µs to set, a stage)."""

    __slots__ = ("ids", "_logits", "top", "total", "weights", "folded", "peak", "change", "p", "_ordered", "_raw",
                 "scale")

    def __init__(self, ids: np.ndarray | None, logits: np.ndarray | None, top: float, total: float,
                 weights: np.ndarray | None = None, folded: Folded | None = None,
                 peak: bool = True, change: float | None = None, p: np.ndarray | None = None):
        self.ids, self._logits, self.top, self.total, self.weights = ids, logits, top, total, weights
        self.folded, self.peak, self.change, self.p = folded, peak, change, p
        self._ordered: bool | None = None
        self._raw: tuple[bytes, bytes] | None = None
        self.scale = 1.0  # (`weights` times this: exp(logits - top))

    @property
    def logits(self) -> np.ndarray:
        """The candidates' logits (a folded distribution's made when first asked: the one before it, those moved
        set — a copy of the whole vocabulary's that a top-k after it never needs)."""
        if self._logits is None:
            assert self.folded is not None
            before, moved, _, new = self.folded
            self._logits = before.logits.copy()
            self._logits[moved] = new
        return self._logits

    def raw(self) -> tuple[bytes, bytes]:
        """A cut's ids and logits as bytes (compared with a stage's: ~0.3 µs where np.array_equal takes ~2)."""
        if self._raw is None:
            assert self.ids is not None
            self._raw = self.ids.tobytes(), self.logits.tobytes()
        return self._raw

    @property
    def ordered(self) -> bool:
        """A cut whose candidates are in order, the most likely first (after a top-k: llama.cpp sorts them)."""
        if self._ordered is None:
            self._ordered = self.ids is not None and bool((self.logits[:-1] >= self.logits[1:]).all())
        return self._ordered

    def first(self, n: int) -> Distribution | None:
        """The distribution of this cut's first `n` candidates, as they were (a cut of a cut: top-p, min-p after a
        top-k) — itself where that is all of them; None where they held no probability."""
        assert self.ids is not None and self.p is not None
        if n == len(self.ids):
            return self
        kept = self.p[:n]
        if self.ordered:  # (the largest of those kept and left out: the first of each)
            share, rest, largest_kept = float(kept.sum()), float(self.p[n]), float(self.p[0])
        else:
            share, rest, largest_kept = float(kept.sum()), float(self.p[n:].max()), float(kept.max())
        if not share > 0:
            return None
        after = Distribution(self.ids[:n], self.logits[:n], self.top, self.total * share,
                             change=max(rest, largest_kept * (1 / share - 1)), p=kept / share)
        after._ordered = self._ordered
        return after

    def p_at(self, where: Any) -> np.ndarray:
        """The probabilities at positions `where` (tokens, over the whole vocabulary), as float64."""
        if self.p is not None:
            kept: np.ndarray = self.p[where]
            return kept
        found: np.ndarray = np.exp(self.logits[where].astype(np.float64) - self.top) / self.total
        return found

    def probs(self, tokens: list[int]) -> list[float]:
        """Each token's probability (0 for one not left)."""
        if self.ids is None:
            found: list[float] = self.p_at(tokens).tolist()
            return found
        left = dict(zip(self.ids.tolist(), self.p_at(slice(None)).tolist(), strict=True))
        return [left.get(token, 0.0) for token in tokens]

    def most_likely(self, n: int, among: np.ndarray | None = None) -> list[int]:
        """Up to `n` of the most likely tokens left (none masked: all of them when fewer are left); `among`: tokens
        known to hold them (a whole vocabulary's)."""
        if among is not None:
            kept = among[np.argsort(-self.logits[among], kind="stable")[:n]]
        elif self.ids is not None and self._ordered:  # (in order already: the first ones, the last the least)
            n = min(n, len(self.logits))
            if not n or self.logits[n - 1] > -np.inf:
                first: list[int] = self.ids[:n].tolist()
                return first
            kept = np.arange(n)
        elif len(self.logits) <= SMALL:
            kept = np.argsort(-self.logits, kind="stable")[:n]
        else:
            kept = largest(self.logits, min(n, len(self.logits)))
        if len(kept) and not self.logits[kept].min() > -np.inf:  # (a masked one among them)
            kept = kept[self.logits[kept] > -np.inf]
        tokens: list[int] = (kept if self.ids is None else self.ids[kept]).tolist()
        return tokens

    def moved_from(self, start: Distribution) -> np.ndarray | None:
        """The tokens whose logits differ from `start`'s, where this distribution is `start` with some folded in."""
        if self.folded is not None and self.folded[0] is start:
            return self.folded[1]
        found: list[np.ndarray] = []
        at: Distribution | None = self
        while at is not None and at is not start:
            if at.folded is None:
                return None
            at, moved, _, _ = at.folded
            found.append(moved)
        return None if at is None else np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.intp)

    def weighed(self) -> np.ndarray:
        """exp(logits - top) of the whole vocabulary, as float32 (a fresh array where it had to be made)."""
        if self.weights is not None:
            return self.weights if self.scale == 1.0 else self.weights * np.float32(self.scale)
        assert self.folded is not None
        before, moved, fresh, _ = self.folded
        weights: np.ndarray = before.weighed().copy()
        weights[moved] = fresh
        return weights

    def dense(self, n_vocab: int) -> np.ndarray:
        """Every token's probability, as float64, normalized here (`total` may be float32's sum)."""
        weights = np.exp(self.logits.astype(np.float64) - self.top)
        weights /= weights.sum()
        if self.ids is None:
            return weights
        found = np.zeros(n_vocab)
        found[self.ids] = weights
        return found


def whole(logits: np.ndarray, out: np.ndarray | None = None, top: float | None = None) -> Distribution:
    """The softmax of the whole vocabulary's `logits` (a token's own: indexed by token); its weights in `out` where
    given (the same memory each token: still in the cache); `top`: their largest, where known."""
    top = float(logits.max()) if top is None else top
    if not math.isfinite(top):
        return Distribution(np.zeros(0, dtype=np.int32), logits[:0], 0.0, 1.0)
    if -60.0 < top < 60.0:  # (exp(logits), scaled after: a pass over the vocabulary fewer; a logit below -87, lost
        weights = np.exp(logits, out=out)  # to float32, is 27 below the largest: < 2e-12 of its weight)
        scale = math.exp(-top)
        found = Distribution(None, logits, top, float(weights.sum()) * scale, weights)  # (numpy's pairwise sum: ~1e-7)
        found.scale = scale
        return found
    weights = np.subtract(logits, np.float32(top), out=out)
    np.exp(weights, out=weights)
    return Distribution(None, logits, top, float(weights.sum()), weights)


def cut(ids: np.ndarray, logits: np.ndarray, ordered: bool = False) -> Distribution:
    """The softmax of some candidates (`ids`, their `logits`: a stage's copy, in its order; `ordered`: known to be
    the most likely first)."""
    top = (float(logits[0]) if ordered else float(logits.max())) if len(logits) else -math.inf
    if not math.isfinite(top):
        return Distribution(ids[:0], logits[:0], 0.0, 1.0)
    weights = np.exp(logits.astype(np.float64) - top)
    total = float(weights.sum())
    found = Distribution(ids, logits, top, total, p=weights / total)
    if ordered:
        found._ordered = True
    return found


SMALL = 256  # a distribution of at most this many candidates is sorted whole where a few of its most likely are asked
FOLDED = 64  # a stage that moved at most this many logits of the whole vocabulary: folded into the softmax before it


def stage_distribution(view: np.ndarray, in_place: bool, before: Distribution, in_order: np.ndarray) -> Distribution:
    """The distribution the candidates in `view` make (`before` itself when they are the same tokens with the same
    logits: nothing to compute). `in_place`: the stage left every row where it was given (a whole vocabulary in
    llama.cpp's candidate array, whose samplers move rows whole), so one contiguous copy of the logits' column,
    compared with the logits before it, finds what moved."""
    ids, values = view["id"], view["logit"]
    if in_place and before.ids is None:
        current = np.empty(len(values), dtype=np.float32)
        np.copyto(current, values)  # (contiguous: a comparison of it takes a third of a strided one)
        moved = np.flatnonzero(current != before.logits)
        if not len(moved):
            return before  # (a row that moved with its logit is unchanged for the token: each row keeps its id)
        if len(moved) <= FOLDED and np.array_equal(ids[moved], moved) \
                and (folded := fold(before, moved, current[moved], current=current)) is not None:
            return folded
        if np.array_equal(ids, in_order):
            return whole(current)
    if before.ids is not None and before.p is not None and not in_place:  # (a few candidates before: their bytes
        n = len(ids)  # compared)
        id_bytes, logit_bytes = before.raw()
        same = ids.tobytes()
        if n <= len(before.ids) and same == id_bytes[:4 * n]:
            kept_logits = values.tobytes()
            if kept_logits == logit_bytes[:4 * n]:  # (the first ones kept as they were: top-p, min-p after top-k)
                first = before.first(n)
                if first is not None:
                    if first is not before:
                        first._raw = (same, kept_logits)
                    return first
            elif n == len(before.ids):  # (the same candidates, other logits: a temperature)
                after = cut(ids.copy(), values.copy())
                if after.p is not None and n:
                    after.change = float(np.abs(after.p - before.p).max())
                return after
    return cut(ids.copy(), values.copy())


def fold(before: Distribution, moved: np.ndarray, moved_to: np.ndarray, others: Callable[[], float] | None = None,
         current: np.ndarray | None = None, moved_from: np.ndarray | None = None) -> Distribution | None:
    """`before`'s whole-vocabulary softmax with the logits of the tokens `moved` changed to `moved_to` (the others'
    share scaled, theirs computed): None where that would lose precision — a logit far above the old largest, or
    the mass left mostly on the moved ones. `others`: the largest logit before outside `moved`, where the caller can
    find it cheaply (else found here, where the largest moved: a pass over the vocabulary). `current`: the whole
    vocabulary's logits after, where the caller has them (else made when asked); `moved_from`: the moved ones' logits
    before, where the caller has them (else read off `before`'s, which a fold before this one makes when asked). Up
    to FOLDED moved logits are folded as Python floats (~20 numpy calls on a few values cost ~40 µs in the caches a
    model pass leaves)."""
    top, total_before = before.top, before.total
    old: list[float] | np.ndarray
    fresh: list[float] | np.ndarray
    if len(moved) <= FOLDED:
        new, was = moved_to.tolist(), (before.logits[moved] if moved_from is None else moved_from).tolist()
        if not max(new, default=-math.inf) - top < 600:
            return None
        old, fresh = [math.exp(w - top) for w in was], [math.exp(n - top) for n in new]
        total = total_before - sum(old) + sum(fresh)
        moved_top, stays_top = top in was, max(new, default=-math.inf) <= top
    else:
        new_array = moved_to.astype(np.float64)
        if not bool((new_array - top < 600).all()):
            return None
        was_array = before.logits[moved] if moved_from is None else moved_from
        old, fresh = np.exp(was_array.astype(np.float64) - top), np.exp(new_array - top)
        total = total_before - float(old.sum()) + float(fresh.sum())
        moved_top, stays_top = bool((was_array == top).any()), bool((new_array <= top).all())
    if not total > total_before * 1e-6:
        return None
    peak = before.peak and not moved_top  # (the largest logit did not move: its token is the one whose share is
    if peak:  # scaled the most)
        left = 1.0 / total_before
    else:
        if others is None:
            rest = before.logits.copy()
            rest[moved] = -np.inf
            largest_other = float(rest.max())
        else:
            largest_other = others()
        left = math.exp(largest_other - top) / total_before
    change = abs(total_before / total - 1.0) * left  # (the largest unmoved one's; the moved ones' where that is not
    if not change > CHANGED:  # enough to tell)
        change = max(change, float(np.abs(np.asarray(fresh) / total - np.asarray(old) / total_before).max(initial=0.0)))
    return Distribution(None, current, top, total, None, (before, moved, fresh, moved_to), peak and stays_top, change)


CHANGED = 1e-9  # a stage changed the distribution when it moved some token's probability by more than this


def differs(a: Distribution, b: Distribution, n_vocab: int) -> bool:
    """Whether some token's probability differs by more than CHANGED between two distributions, without the whole
    vocabulary's where a cut only left tokens out (the kept ones renormalized, the left-out ones' mass from the
    weights)."""
    if a.ids is not None and b.ids is not None:
        if len(b.ids) <= len(a.ids) and a.ids[:len(b.ids)].tobytes() == b.ids.tobytes():  # (b kept a's first: top-p, min-p)
            rest = float(a.p_at(slice(len(b.ids), None)).max()) if len(a.ids) > len(b.ids) else 0.0
            kept = float(np.abs(a.p_at(slice(len(b.ids))) - b.p_at(slice(None))).max()) if len(b.ids) else 0.0
            return max(kept, rest) > CHANGED
    elif a.ids is None and b.ids is not None \
            and np.array_equal(a.logits[b.ids], b.logits):  # (the whole vocabulary cut, nothing else: top-k)
        weights = a.weighed()
        kept = weights[b.ids]
        weights[b.ids] = 0  # (for a moment: the left-out ones alone)
        try:
            if float(weights.max()) / a.total > CHANGED:  # (a token left out)
                return True
            dropped = float(weights.sum(dtype=np.float64)) / a.total
        finally:
            weights[b.ids] = kept
        if not len(b.ids) or dropped >= 1:
            return dropped > CHANGED
        return float(a.p_at(b.ids).max()) * dropped / (1 - dropped) > CHANGED  # (the kept ones renormalized)
    return float(np.abs(a.dense(n_vocab) - b.dense(n_vocab)).max()) > CHANGED
