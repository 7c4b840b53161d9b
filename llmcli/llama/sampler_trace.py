"""One token sampled with every stage seen (`run --trace`): llama.cpp's `llama_sampler_sample` done by hand — the
logits into a candidate array, each sampler of the chain applied in turn (a snapshot after each), the selected token
accepted by the chain — so the token is the one the plain call would give, and each stage's effect is visible: which
candidates it left and whether it changed the distribution. Only a traced answer comes here; the plain path is
Sampler.sample.

What it costs (issue 61: no more than `--logprobs` would be the goal; `bench --sampling` measures it) is kept low: a
top-k or greedy after stages that move a few known tokens (a bias, penalties) is given those tokens and the model's
largest, not the whole vocabulary (_sparse); a stage that kept the whole vocabulary is read as one contiguous copy of
the logits' column; each stage's distribution is computed as trace_distribution.py keeps it, as small as what it
left."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.logprobs import largest, logits_at
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.trace_distribution import CHANGED, Distribution, cut, differs, fold, stage_distribution, whole
from llmcli.llama.vocab import Vocabulary

SELECTORS = ("greedy", "dist", "mirostat", "mirostat-v2")  # the last stage: picks the token, changes no probability


class _Top:
    """The k largest of the model's logits, the largest first, found once for the largest k asked — at least FOUND:
    finding 5 costs what finding 64 does — (a top-k stage's pool, the shown candidates)."""

    def __init__(self, logits: np.ndarray):
        self.logits = logits
        self.found: np.ndarray | None = None

    def of(self, k: int) -> np.ndarray:
        if self.found is None or len(self.found) < k:
            found = largest(self.logits, min(max(k, FOUND), len(self.logits)))
            self.found = found[np.argsort(-self.logits[found], kind="stable")]
        return self.found[:k]


FOUND = 64


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
    logits = logits_at(sampler.ctx, index, n_vocab)  # (llama.cpp's own: no decode until done)
    if sampler.first_bias:  # (as Sampler.sample applies it: into llama.cpp's logits, then dropped)
        for token_id, bias in sampler.first_bias:
            logits[token_id] += np.float32(bias)
        sampler.first_bias = ()
    buffer = _candidates(sampler, n_vocab)
    start = whole(logits, buffer.weights)
    log_total = start.top + math.log(start.total)  # a token's log-probability is its logit less this
    top = _Top(logits)
    top.of(FOUND)  # (the model's largest found while its logits are in the cache: before a stage sorts the vocabulary)
    stages, changed, final, token, note = _through(sampler, "chain", start, buffer, top)
    if sampler.grammar is not None and sampler.armed:  # (the lazy check: the grammar alone on the chosen token;
        # rejected, sampled again)
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)
        array = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
        if one.logit != -math.inf:
            llama_cpp.llama_sampler_accept(sampler.constrained, token)
        else:
            refused = vocab.piece(token, special=True).decode("utf-8", "replace")
            stages, changed, final, token, _ = _through(sampler, "constrained", start, buffer, top)
            note = f"the grammar refused {refused!r}: sampled again under it"
        llama_cpp.llama_sampler_accept(sampler.grammar, token)
    else:
        sampler.watch(token)  # (a lazy grammar that this token fires: armed for the next)
    greedy = any(name == "greedy" for name, _ in stages)
    chosen = {token: None}  # (the chosen token first; a dict keeps the order)
    if n_top:
        k = min(n_top, n_vocab)
        moved = final.moved_from(start)  # (a few logits moved: the sampler's most likely are among the model's
        pool = top.of(min(k + (0 if moved is None else len(moved)), n_vocab))  # k more, or those)
        chosen.update(dict.fromkeys(pool[:k].tolist()))  # (the model's most likely, the largest first)
        if final is not start:  # (no stage changed anything: the sampler's most likely are the model's)
            among = None if moved is None else np.array(list({*pool.tolist(), *moved.tolist()}))
            chosen.update(dict.fromkeys(final.most_likely(k, among)))  # (those the chain left, never a masked one)
    tokens = list(chosen)
    p_sampler = final.probs(tokens)
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), logit - log_total, math.exp(logit - log_total), p)
                         for t, logit, p in zip(tokens, logits[tokens].tolist(), p_sampler, strict=True)),
                        key=lambda c: (-c.p_sampler, -c.p_model))
    return Traced(token, "argmax" if greedy else "drawn", p_sampler[0], tuple(candidates), stages, changed, note)


class _Buffer:
    """The candidate array a traced sampler fills each token (`data`, one llama_token_data a vocabulary entry: 12
    bytes), made once for the sampler: its numpy `view`, the same as rows of three 32-bit `words` (id, logit, p), those
    rows as each token starts them (`fresh`: every id in order, p 0), every id in order; and one
    llama_token_data_array over it (`array`, `reference` to it), whose data pointer, size and selected row are read
    and set through `header` — numpy's access to them takes ~0.1 µs, ctypes' ~0.7 for a pointer."""

    def __init__(self, n_vocab: int):
        self.data = (llama_cpp.llama_token_data * n_vocab)()
        self.view = np.ctypeslib.as_array(self.data)
        self.words = self.view.view(np.int32).reshape(n_vocab, 3)
        self.fresh = np.zeros((n_vocab, 3), dtype=np.int32)
        self.fresh[:, 0] = self.in_order = np.arange(n_vocab, dtype=np.int32)
        self.weights = np.empty(n_vocab, dtype=np.float32)  # the model's softmax's weights (whole's)
        self.home = ctypes.addressof(self.data)
        self.array = llama_cpp.llama_token_data_array(self.data, n_vocab, -1, False)
        self.reference = ctypes.byref(self.array)
        raw = memoryview(self.array).cast("B")
        self.header = np.frombuffer(raw, dtype=np.int64, count=3)  # data pointer, size, selected
        self.flags = np.frombuffer(raw, dtype=np.uint8)  # byte 24: sorted
        layout = [getattr(llama_cpp.llama_token_data_array, name).offset for name in ("data", "size", "selected", "sorted")]
        if layout != [0, 8, 16, 24]:
            raise RuntimeError("llama_token_data_array is not laid out as llama.cpp's (data, size, selected, sorted)")

    def start(self, size: int) -> None:
        """The array over the first `size` rows, nothing selected, not sorted (llama_sampler_sample's start)."""
        self.header[0], self.header[1], self.header[2] = self.home, size, -1
        self.flags[24] = 0

    def rows(self) -> tuple[np.ndarray, bool]:
        """The candidates the array holds now, and whether they are the home rows, in place: a stage that kept every
        row where it was given (a whole vocabulary)."""
        size = int(self.header[1])
        if int(self.header[0]) == self.home:
            return self.view[:size], size == len(self.view)
        return np.ctypeslib.as_array(self.array.data, shape=(size,)), False

    def selected(self) -> int:
        """The token the selecting stage chose."""
        return int(self.rows()[0]["id"][int(self.header[2])])


def _candidates(sampler: Sampler, n_vocab: int) -> _Buffer:
    """The sampler's candidate array for a vocabulary of `n_vocab` (made at its first traced token)."""
    found: _Buffer | None = getattr(sampler, "_traced_candidates", None)
    if found is None or len(found.view) != n_vocab:
        found = sampler._traced_candidates = _Buffer(n_vocab)  # type: ignore[attr-defined]
    return found


def _through(sampler: Sampler, which: str, start: Distribution,
             buffer: _Buffer, top: _Top) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """Apply each sampler of the sampler's chain `which` in turn to the candidates (`start` the model's distribution):
    each stage and the candidates it left, the stages that changed the distribution, the final distribution (before
    the selecting stage: the probability of each candidate left, 0 for one masked), the token selected (accepted by
    the chain, as llama_sampler_sample does)."""
    n_vocab = len(start.logits)
    chain = _stages(sampler, which)
    if len(chain) == 1 and chain[0][1] == "greedy":  # (greedy alone: llama.cpp's first largest logit, numpy's too —
        token = int(start.logits.argmax())  # no candidate array to fill: ~0.04 ms a token)
        return (("greedy", n_vocab),), (), start, _accepted(sampler, which, token), ""
    sparse = _sparse(sampler, which, chain, start, buffer, top)
    if sparse is not None:
        return sparse
    buffer.words[:] = buffer.fresh  # (the rows whole, then the logits' column: ~1.6 × faster than three fields)
    buffer.words[:, 1] = start.logits.view(np.int32)
    buffer.start(n_vocab)
    return _onwards(sampler, which, chain, buffer, [], [], start, top)


def _onwards(sampler: Sampler, which: str, chain: tuple[tuple[Any, str], ...], buffer: _Buffer,
             stages: list[tuple[str, int]], changed: list[str], before: Distribution, top: _Top) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """_through's stages from `chain` on, applied to the candidates the buffer's array holds (`before` their
    distribution)."""
    n_vocab = len(buffer.in_order)
    header, reference = buffer.header, buffer.reference
    final = before
    for stage, name in chain:
        if name == "greedy" and final.ids is None:  # (llama.cpp's first largest logit of a whole vocabulary in
            stages.append((name, n_vocab))  # order: numpy's argmax, without another pass in C)
            token = int(final.logits.argmax())
            return tuple(stages), tuple(changed), final, _accepted(sampler, which, token), ""
        llama_cpp.llama_sampler_apply(stage, reference)
        size = int(header[1])
        stages.append((name, size))
        if name in SELECTORS:
            break
        after = stage_distribution(*buffer.rows(), before, buffer.in_order)
        if after is not before and (after.change > CHANGED if after.change is not None else
                                    _left_out(before, after, top) or differs(before, after, n_vocab)):
            changed.append(name)
        before = final = after
    return tuple(stages), tuple(changed), final, _accepted(sampler, which, buffer.selected()), ""


def _left_out(before: Distribution, after: Distribution, top: _Top) -> bool:
    """Whether a cut of the whole vocabulary left out one of the model's most likely tokens whose probability was
    above CHANGED — a change, seen without the vocabulary's weights."""
    if before.ids is not None or after.ids is None or len(after.ids) >= FOUND:
        return False
    kept = set(after.ids.tolist())
    out = [token for token in top.of(FOUND).tolist() if token not in kept]
    return bool(out) and float(before.p_at(out).max()) > CHANGED


def _accepted(sampler: Sampler, which: str, token: int) -> int:
    """`token`, accepted by the chain `which` as llama_sampler_sample accepts it (and kept in the sampler's record of
    the recent tokens its penalties hold)."""
    llama_cpp.llama_sampler_accept(getattr(sampler, which), token)
    if which == "chain" and sampler.recent is not None:
        sampler.recent.append(token)
    return token


SPARSE = 4096  # the most tokens the stages before a top-k or greedy may move, for them to be given those alone


def _touched(sampler: Sampler, name: str) -> tuple[int, ...] | None:
    """The only tokens a stage named `name` may give another logit — it changes each candidate by its id alone,
    whichever others it is given — or None for any other stage."""
    if name == "logit-bias":
        return sampler.biased
    if name == "penalties" and sampler.recent is not None and len(sampler.recent) <= SPARSE:  # (a window of the
        return tuple(sampler.recent)  # whole context, long: the whole vocabulary, not a copy of it each token)
    return None


def _largest_unmoved(before: Distribution, given: np.ndarray, moved: np.ndarray, top: _Top, movable: int) -> float:
    """The largest logit of `before` outside the rows `moved` of `given` (which hold the `movable` tokens the stages
    may move): among the others given and the model's movable + 1 largest — one of those no stage moved."""
    left = set(given.tolist()) | set(top.of(movable + 1).tolist())
    left.difference_update(given[moved].tolist())
    return float(before.logits[list(left)].max())


def _sparse(sampler: Sampler, which: str, chain: tuple[tuple[Any, str], ...], start: Distribution,
            buffer: _Buffer, top: _Top) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str] | None:
    """_through without the whole vocabulary, where the chain is stages that move a few known tokens' logits (a
    bias, penalties) then a top-k or greedy: the moving stages are given those tokens alone, and a top-k those and the
    model's largest — enough to hold the k + 1 largest logits once they moved, and its rows then are the ones the
    whole vocabulary gives, in the same order, where those are distinct — not the whole vocabulary filled (~30 µs),
    compared (~15 µs) and cut (a repeat penalty's pass over it: ~130 µs). None where the chain is not of that shape
    (nothing applied yet, or only the moving stages, which keep no state)."""
    if start.ids is not None:
        return None
    n_vocab = len(start.logits)
    lead = 0
    moving: list[int] = []
    for _, name in chain:
        tokens = _touched(sampler, name)
        if tokens is None:
            break
        moving.extend(tokens)
        lead += 1
    if lead == len(chain) or chain[lead][1] not in ("top-k", "greedy") or len(moving) > SPARSE:
        return None
    k = sampler.top_k if chain[lead][1] == "top-k" else 0
    if chain[lead][1] == "top-k" and not 0 < k < n_vocab - 1:
        return None
    touched: list[int] = sorted({token for token in moving if 0 <= token < n_vocab}) if moving else []
    given = np.array(touched, dtype=np.int32)
    if k:  # (the model's largest, with those not among them)
        pool = top.of(min(k + 1 + len(touched), n_vocab))
        given = np.concatenate((pool, sorted(set(touched) - set(pool.tolist())))).astype(np.int32) if touched \
            else pool.astype(np.int32)
    rows = buffer.view[:len(given)]
    rows["id"], rows["logit"], rows["p"] = given, start.logits[given], 0
    buffer.start(len(given))
    header, home = buffer.header, buffer.home
    stages: list[tuple[str, int]] = []
    changed: list[str] = []
    before = start
    for stage, name in chain[:lead]:
        llama_cpp.llama_sampler_apply(stage, buffer.reference)
        if int(header[1]) != len(given) or int(header[0]) != home or rows["id"].tobytes() != given.tobytes():
            return None  # (not a stage that keeps each row where it was: the whole vocabulary)
        stages.append((name, n_vocab))
        values = rows["logit"]
        moved = np.flatnonzero(values != before.logits[given])
        if len(moved):
            current = before.logits.copy()
            current[given[moved]] = values[moved]
            after = fold(before, current, given[moved],
                            partial(_largest_unmoved, before, given, moved, top, len(touched))) or whole(current)
            if after.change > CHANGED if after.change is not None else differs(before, after, n_vocab):
                changed.append(name)
            before = after
    if not k:  # (greedy: llama.cpp's first largest logit of the whole vocabulary, in order)
        stages.append(("greedy", n_vocab))
        return tuple(stages), tuple(changed), before, _accepted(sampler, which, int(before.logits.argmax())), ""
    ranked = rows["logit"][:k + 1].copy() if not touched else -np.sort(-rows["logit"])[:k + 1]  # (the pool: in
    if len(set(ranked.tolist())) <= k:  # order) (a tie among them: the whole vocabulary, in llama.cpp's order)
        return None
    stage, name = chain[lead]
    llama_cpp.llama_sampler_apply(stage, buffer.reference)
    kept, _ = buffer.rows()
    stages.append((name, len(kept)))
    after = cut(kept["id"].copy(), kept["logit"].copy(), ordered=kept["logit"].tobytes() == ranked[:k].tobytes())
    left_out = math.exp(float(ranked[k]) - before.top) / before.total  # (the largest logit it left out)
    if left_out > CHANGED or differs(before, after, n_vocab):
        changed.append(name)
    return _onwards(sampler, which, chain[lead + 1:], buffer, stages, changed, after, top)


def _stages(sampler: Sampler, which: str) -> tuple[tuple[Any, str], ...]:
    """The samplers of the sampler's chain `which` ("chain", or "constrained": under its grammar), each with its name:
    read from llama.cpp once for the sampler (its chains change only when a lazy grammar is armed: Sampler.watch drops
    this then)."""
    kept: dict[str, tuple[tuple[Any, str], ...]] = sampler.__dict__.setdefault("_traced_stages", {})
    found = kept.get(which)
    if found is None:
        chain = getattr(sampler, which)
        stages = [llama_cpp.llama_sampler_chain_get(chain, i) for i in range(llama_cpp.llama_sampler_chain_n(chain))]
        found = kept[which] = tuple((stage, (llama_cpp.llama_sampler_name(stage) or b"?").decode()) for stage in stages)
    return found
