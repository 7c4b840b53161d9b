"""One token sampled with every stage seen (`run --trace`): llama.cpp's `llama_sampler_sample` done by hand — the
logits into a candidate array, each sampler of the chain applied in turn (a snapshot after each), the selected token
accepted by the chain — so the token is the one the plain call would give, and each stage's effect is visible: which
candidates it left and whether it changed the distribution. Only a traced answer comes here (it costs a copy of the
vocabulary's logits and a softmax a stage); the plain path is Sampler.sample."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.logprobs import largest
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
    logits = np.ctypeslib.as_array(pointer, shape=(n_vocab,))  # (llama.cpp's own: read only, no decode until done)
    buffer = _candidates(sampler, n_vocab)
    top = float(logits.max())
    p_model = buffer[4]  # (the model's distribution, in place: the fewer whole-vocabulary arrays, the fewer cache misses)
    np.subtract(logits, np.float32(top), out=p_model)
    np.exp(p_model, out=p_model)
    total = float(p_model.sum(dtype=np.float64))
    p_model /= np.float32(total)  # (the distribution before any stage: no softmax of the whole vocabulary again)
    log_total = top + math.log(total)  # a token's log-probability is its logit less this (the first token's lead included)
    start = Distribution(None, p_model, logits, top, total)
    stages, changed, final, token, note = _through(sampler, "chain", start, buffer)
    if sampler.grammar is not None:  # (the lazy check: the grammar alone on the chosen token; rejected, sampled again)
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)
        array = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
        if one.logit != -math.inf:
            llama_cpp.llama_sampler_accept(sampler.constrained, token)
        else:
            refused = vocab.piece(token, special=True).decode("utf-8", "replace")
            stages, changed, final, token, _ = _through(sampler, "constrained", start, buffer)
            note = f"the grammar refused {refused!r}: sampled again under it"
        llama_cpp.llama_sampler_accept(sampler.grammar, token)
    greedy = any(name == "greedy" for name, _ in stages)
    chosen = {token: None}  # (the chosen token first; a dict keeps the order)
    if n_top:
        k = min(n_top, n_vocab)
        chosen.update(dict.fromkeys(largest(logits, k).tolist()))
        if final.p is not p_model:  # (no stage changed anything: the sampler's most likely are the model's)
            chosen.update(dict.fromkeys(final.most_likely(k)))  # (those the chain left, never a masked one)
    tokens = list(chosen)
    p_sampler = final.probs(tokens)
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), logit - log_total, math.exp(logit - log_total), p)
                         for t, logit, p in zip(tokens, logits[tokens].tolist(), p_sampler, strict=True)),
                        key=lambda c: (-c.p_sampler, -c.p_model))
    return Traced(token, "argmax" if greedy else "drawn", p_sampler[0], tuple(candidates), stages, changed, note)


def _candidates(sampler: Sampler, n_vocab: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The candidate array a traced sampler fills each token, its numpy view, the same as rows of three 32-bit words
    (id, logit, p), those rows as each token starts them (every id in order, p 0), and room for the model's
    distribution: made once for the sampler (16 bytes a vocabulary entry each, 4 for the last)."""
    found = getattr(sampler, "_traced_candidates", None)
    if found is None or len(found[0]) != n_vocab:
        data = (llama_cpp.llama_token_data * n_vocab)()
        view = np.ctypeslib.as_array(data)
        words = view.view(np.int32).reshape(n_vocab, 3)
        fresh = np.zeros((n_vocab, 3), dtype=np.int32)
        fresh[:, 0] = np.arange(n_vocab, dtype=np.int32)
        found = (data, view, words, fresh, np.empty(n_vocab, dtype=np.float32))
        sampler._traced_candidates = found  # type: ignore[attr-defined]
    return found


def _through(sampler: Sampler, which: str, start: Distribution,
             buffer: tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """Apply each sampler of the sampler's chain `which` in turn to the candidates (all of the vocabulary, `start` the model's
    distribution): each stage and the candidates it left, the stages that changed the distribution, the final
    distribution (before the selecting stage: the probability of each candidate left, 0 for one masked), the token
    selected (accepted by the chain, as llama_sampler_sample does)."""
    n_vocab = len(start.logits)
    chain = _stages(sampler, which)
    if len(chain) == 1 and chain[0][1] == "greedy":  # (greedy alone: llama.cpp's first largest logit, numpy's too —
        token = int(start.logits.argmax())  # no candidate array to fill: ~0.04 ms a token)
        llama_cpp.llama_sampler_accept(getattr(sampler, which), token)
        return (("greedy", n_vocab),), (), start, token, ""
    data, view, words, fresh, _ = buffer
    words[:] = fresh  # (the rows whole, then the logits' column: ~1.6 × faster than three fields)
    words[:, 1] = start.logits.view(np.int32)
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
    for stage, name in chain:
        llama_cpp.llama_sampler_apply(stage, ctypes.byref(array))
        size = int(array.size)
        stages.append((name, size))
        if name in SELECTORS:
            break
        after = _distribution(candidates(size), n_vocab, before)
        if after is not before and (after.change > CHANGED if after.change is not None else
                                    _changed(before, after, n_vocab)):
            changed.append(name)
        before = final = after
    selected = int(array.selected)
    token = int(candidates(int(array.size))["id"][selected])
    llama_cpp.llama_sampler_accept(getattr(sampler, which), token)
    return tuple(stages), tuple(changed), final, token, ""


def _stages(sampler: Sampler, which: str) -> tuple[tuple[Any, str], ...]:
    """The samplers of the sampler's chain `which` ("chain", or "constrained": under its grammar), each with its name:
    read from llama.cpp once for the sampler (its chains never change while it lives)."""
    kept: dict[str, tuple[tuple[Any, str], ...]] = sampler.__dict__.setdefault("_traced_stages", {})
    found = kept.get(which)
    if found is None:
        chain = getattr(sampler, which)
        stages = [llama_cpp.llama_sampler_chain_get(chain, i) for i in range(llama_cpp.llama_sampler_chain_n(chain))]
        found = kept[which] = tuple((stage, (llama_cpp.llama_sampler_name(stage) or b"?").decode()) for stage in stages)
    return found


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

    def probs(self, tokens: list[int]) -> list[float]:
        """Each token's probability (0 for one not left)."""
        if self.ids is None:
            found: list[float] = self.p[tokens].tolist()
            return found
        left = dict(zip(self.ids.tolist(), self.p.tolist(), strict=True))
        return [left.get(token, 0.0) for token in tokens]

    def most_likely(self, n: int) -> list[int]:
        """Up to `n` of the most likely tokens left (none masked: all of them when fewer are left)."""
        if np.count_nonzero(self.p) > n:
            kept = largest(self.p, n)  # (0 is below any that is left)
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
    if before.ids is not None and size == len(before.ids) and np.array_equal(ids, before.ids) \
            and np.array_equal(values, before.logits):
        return before  # (a cut that cut nothing: top-p or min-p past the candidates left)
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


CHANGED = 1e-9  # a stage changed the distribution when it moved some token's probability by more than this


def _changed(a: Distribution, b: Distribution, n_vocab: int) -> bool:
    """Whether some token's probability differs by more than CHANGED between two distributions (the candidates both
    kept compared first: a cut that renormalized them is seen without reading the whole vocabulary)."""
    if a.ids is None and b.ids is None:
        return float(np.abs(a.p - b.p).max()) > CHANGED
    if a.ids is not None and b.ids is not None:
        if len(b.ids) <= len(a.ids) and np.array_equal(a.ids[:len(b.ids)], b.ids):  # (b kept a's first: top-p, min-p)
            rest = float(a.p[len(b.ids):].max()) if len(a.ids) > len(b.ids) else 0.0
            return max(float(np.abs(a.p[:len(b.ids)] - b.p).max()) if len(b.ids) else 0.0, rest) > CHANGED
    elif a.ids is None and b.ids is not None:  # (the whole vocabulary cut: top-k)
        if len(b.ids) and float(np.abs(a.p[b.ids] - b.p).max()) > CHANGED:
            return True
        if not len(b.ids):
            return float(a.p.max()) > CHANGED
        floor = float(b.logits.min())  # (top-k keeps the largest logits: the largest left out is the next one down)
        if np.count_nonzero(a.logits >= floor) > len(b.ids):  # (a tie at the cut left out)
            return math.exp(floor - a.top) / a.total > CHANGED
        below = a.logits[a.logits < floor]
        return bool(len(below)) and math.exp(float(below.max()) - a.top) / a.total > CHANGED
    dense_a, dense_b = _dense(a, n_vocab), _dense(b, n_vocab)
    return float(np.abs(dense_a - dense_b).max()) > CHANGED


def _dense(d: Distribution, n_vocab: int) -> np.ndarray:
    if d.ids is None:
        return d.p
    found = np.zeros(n_vocab)
    found[d.ids] = d.p
    return found
