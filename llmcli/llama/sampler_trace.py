"""One token sampled with every stage seen (`run --trace`): llama.cpp's `llama_sampler_sample` done by hand — the
logits into a candidate array, each sampler of the chain applied in turn (a snapshot after each), the selected token
accepted by the chain — so the token is the one the plain call would give, and each stage's effect is visible: which
candidates it left and whether it changed the distribution. Only a traced answer comes here (it costs a copy of the
vocabulary's logits and a softmax a stage); the plain path is Sampler.sample."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.vocab import Vocabulary

SELECTORS = ("greedy", "dist", "mirostat", "mirostat-v2")  # the last stage: picks the token, changes no probability


@dataclass(frozen=True)
class Traced:
    token: int
    how: str  # argmax, or drawn
    p: float  # the chosen token's probability under the sampler's final distribution
    candidates: tuple[Candidate, ...]
    stages: tuple[tuple[str, int], ...]  # each stage's name and the candidates it left
    changed: tuple[str, ...]
    note: str = ""


def sample_traced(sampler: Sampler, vocab: Vocabulary, index: int, n_top: int) -> Traced:
    """The next token from the logits at batch `index`, as `sampler.sample` would choose it, with its trace."""
    n_vocab = vocab.n_tokens
    pointer = llama_cpp.llama_get_logits_ith(sampler.ctx, index)
    if sampler.first_bias:  # (as Sampler.sample applies it: into llama.cpp's logits, then dropped)
        for token_id, bias in sampler.first_bias:
            pointer[token_id] += bias
        sampler.first_bias = ()
    logits = np.ctypeslib.as_array(pointer, shape=(n_vocab,)).copy()  # (float32, as llama.cpp's: the chain reads it)
    model = logits - logits.max()
    exp = np.exp(model)
    total = float(exp.sum(dtype=np.float64))
    model -= np.float32(math.log(total))  # the model's log-probabilities (the first token's lead included)
    p_model = exp / np.float32(total)  # (the distribution before any stage: no softmax of the whole vocabulary again)
    start = Distribution(None, p_model, logits, float(logits.max()), total)
    buffer = _candidates(sampler, n_vocab)
    stages, changed, final, token, note = _through(sampler.chain, start, buffer)
    if sampler.grammar is not None:  # (the lazy check: the grammar alone on the chosen token; rejected, sampled again)
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)
        array = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
        if one.logit != -math.inf:
            llama_cpp.llama_sampler_accept(sampler.constrained, token)
        else:
            refused = vocab.piece(token, special=True).decode("utf-8", "replace")
            stages, changed, final, token, _ = _through(sampler.constrained, start, buffer)
            note = f"the grammar refused {refused!r}: sampled again under it"
        llama_cpp.llama_sampler_accept(sampler.grammar, token)
    greedy = any(name == "greedy" for name, _ in stages)
    chosen = {token}
    if n_top:
        k = min(n_top, n_vocab) - 1
        chosen.update(np.argpartition(model, n_vocab - 1 - k)[n_vocab - 1 - k:].tolist())
        if final.p is not p_model:  # (no stage changed anything: the sampler's most likely are the model's)
            chosen.update(final.most_likely(k + 1))  # (those the chain left, never a masked one)
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), float(model[t]), math.exp(float(model[t])),
                                   final.prob(t)) for t in chosen), key=lambda c: (-c.p_sampler, -c.p_model))
    return Traced(token, "argmax" if greedy else "drawn", final.prob(token), tuple(candidates), stages, changed,
                  note)


def _candidates(sampler: Sampler, n_vocab: int) -> tuple[Any, np.ndarray]:
    """The candidate array a traced sampler fills each token, and its numpy view (made once for it: 12 bytes a
    vocabulary entry)."""
    found = getattr(sampler, "_traced_candidates", None)
    if found is None or len(found[0]) != n_vocab:
        data = (llama_cpp.llama_token_data * n_vocab)()
        found = (data, np.ctypeslib.as_array(data))
        sampler._traced_candidates = found  # type: ignore[attr-defined]
    return found


def _through(chain: object, start: Distribution, buffer: tuple[Any, np.ndarray]) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """Apply each sampler of `chain` in turn to the candidates (all of the vocabulary, `start` the model's
    distribution): each stage and the candidates it left, the stages that changed the distribution, the final
    distribution (before the selecting stage: the probability of each candidate left, 0 for one masked), the token
    selected (accepted by the chain, as llama_sampler_sample does)."""
    n_vocab = len(start.logits)
    data, view = buffer
    view["id"] = _ids(n_vocab)
    view["logit"] = start.logits
    view["p"] = 0.0
    array = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
    home = ctypes.addressof(data)

    def candidates(size: int) -> np.ndarray:  # (the stages work in place: the view made once, not a new one a stage —
        # numpy reads a ctypes array's type anew each time, ~90 µs)
        if ctypes.cast(array.data, ctypes.c_void_p).value == home:
            return view[:size]
        return np.ctypeslib.as_array(array.data, shape=(size,))

    stages: list[tuple[str, int]] = []
    changed: list[str] = []
    before = final = start
    for i in range(llama_cpp.llama_sampler_chain_n(chain)):
        stage = llama_cpp.llama_sampler_chain_get(chain, i)
        name = (llama_cpp.llama_sampler_name(stage) or b"?").decode()
        llama_cpp.llama_sampler_apply(stage, ctypes.byref(array))
        size = int(array.size)
        stages.append((name, size))
        if name in SELECTORS:
            break
        after = _distribution(candidates(size), n_vocab, before)
        if after is not before and (after.change if after.change is not None else
                                    _largest_change(before, after, n_vocab)) > 1e-9:
            changed.append(name)
        before = final = after
    selected = int(array.selected)
    token = int(candidates(int(array.size))["id"][selected])
    llama_cpp.llama_sampler_accept(chain, token)
    return tuple(stages), tuple(changed), final, token, ""


@functools.lru_cache(maxsize=2)
def _ids(n_vocab: int) -> np.ndarray:
    """Every token id, in order (the candidate array's ids before the first stage)."""
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True)
class Distribution:
    """The probabilities a stage's candidates make: `p[i]` is token `ids[i]`'s (`ids` None: every token, in id order,
    `p` the vocabulary's); a token not among them has 0. `logits`, the candidates' own, tell a stage that changed
    nothing without a softmax. Kept this small after a stage that cut the candidates (top-k: 40), never scattered
    back over the vocabulary. Over the whole vocabulary, `top` and `total` are its softmax's (the largest logit,
    the sum of exp(logit - top)), so a stage that moved a few logits (a bias, penalties) is folded in without
    another; `change`: the largest difference from the stage before, when that was known on the way."""

    ids: np.ndarray | None
    p: np.ndarray
    logits: np.ndarray
    top: float = 0.0
    total: float = 0.0
    change: float | None = None

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.p[token])
        found = np.flatnonzero(self.ids == token)
        return float(self.p[found[0]]) if len(found) else 0.0

    def most_likely(self, n: int) -> list[int]:
        """Up to `n` of the most likely tokens left (none masked: all of them when fewer are left)."""
        if np.count_nonzero(self.p) > n:
            kept = np.argpartition(self.p, len(self.p) - n)[len(self.p) - n:]  # (0 is below any that is left)
        else:
            kept = np.flatnonzero(self.p)
        tokens: list[int] = (kept if self.ids is None else self.ids[kept]).tolist()
        return tokens


FOLDED = 64  # a stage that moved at most this many logits of the whole vocabulary: folded into the softmax before it


def _distribution(view: np.ndarray, n_vocab: int, before: Distribution) -> Distribution:
    """The distribution the candidates in `view` make (`before` itself when they are the same tokens with the same
    logits: nothing to compute)."""
    size = len(view)
    ids, values = view["id"], view["logit"]
    in_order = size == n_vocab and ids[0] == 0 and ids[-1] == n_vocab - 1 and bool((ids[1:] > ids[:-1]).all())
    if in_order and before.ids is None:
        moved = np.flatnonzero(values != before.logits)
        if not len(moved):
            return before
        if len(moved) <= FOLDED and (folded := _folded(before, values, moved)) is not None:
            return folded
    values = values.copy()
    top = float(values.max()) if size else -math.inf
    if not math.isfinite(top):
        return Distribution(np.zeros(0, dtype=np.int32), np.zeros(0), values[:0])
    p: np.ndarray = np.exp((values - top).astype(np.float64))  # (a masked candidate's -inf: 0)
    total = float(p.sum())
    p /= total
    return Distribution(None if in_order else ids.copy(), p, values, top, total)


def _folded(before: Distribution, values: np.ndarray, moved: np.ndarray) -> Distribution | None:
    """`before`'s whole-vocabulary softmax with the logits at `moved` changed to `values`' (the others' share scaled,
    theirs computed): None where that would lose precision — a logit far above the old largest, or the mass left
    mostly on the moved ones."""
    new = values[moved].astype(np.float64)
    if not bool((new - before.top < 600).all()):
        return None
    old = before.p[moved].astype(np.float64) * before.total
    fresh = np.exp(new - before.top)
    total = before.total - float(old.sum()) + float(fresh.sum())
    if not total > before.total * 1e-6:
        return None
    scale = before.total / total
    p = np.multiply(before.p, scale, dtype=np.float64)
    p[moved] = fresh / total
    peak = int(before.p.argmax())
    if peak in set(moved.tolist()):
        rest = before.p.copy()
        rest[moved] = 0
        left = float(rest.max())
    else:
        left = float(before.p[peak])
    change = max(abs(scale - 1.0) * left, float(np.abs(p[moved] - before.p[moved]).max()))
    return Distribution(None, p, values.copy(), before.top, total, change)


def _largest_change(a: Distribution, b: Distribution, n_vocab: int) -> float:
    """The largest difference between two distributions' probabilities of any token."""
    if a.ids is None and b.ids is None:
        return float(np.abs(a.p - b.p).max())
    if a.ids is not None and b.ids is not None:
        if len(b.ids) <= len(a.ids) and np.array_equal(a.ids[:len(b.ids)], b.ids):  # (b kept a's first: top-p, min-p)
            rest = float(a.p[len(b.ids):].max()) if len(a.ids) > len(b.ids) else 0.0
            return max(float(np.abs(a.p[:len(b.ids)] - b.p).max()) if len(b.ids) else 0.0, rest)
    elif a.ids is None and b.ids is not None:  # (the whole vocabulary cut: top-k)
        rest = a.p.copy()
        rest[b.ids] = 0
        kept = float(np.abs(a.p[b.ids] - b.p).max()) if len(b.ids) else 0.0
        return max(kept, float(rest.max()))
    dense_a, dense_b = _dense(a, n_vocab), _dense(b, n_vocab)
    return float(np.abs(dense_a - dense_b).max())


def _dense(d: Distribution, n_vocab: int) -> np.ndarray:
    if d.ids is None:
        return d.p
    found = np.zeros(n_vocab)
    found[d.ids] = d.p
    return found
