"""One token sampled with every stage seen (`run --trace`), two ways; either way the token is the one the plain call
would give, and each stage's effect is visible: which candidates it left and whether it changed the distribution.
Only a traced answer comes here; the plain path is Sampler.sample.

- Observed (observed_trace.py): a traced answer's chain has a sampler of ours after each stage
  (stage_observation.py), so llama.cpp's own `llama_sampler_sample` fills, cuts and sorts the candidates in C as for
  an untraced answer, and the trace reads what each stage left as plain lists. For a logit bias, cuts (top-k, top-p,
  min-p), a temperature, then dist or greedy: the default chain's shapes.
- Stage by stage (_through, here): `llama_sampler_sample` done by hand — the logits into a candidate array, each sampler
  applied in turn, a snapshot after each, the token accepted by the chain. For the other chains: penalties (a top-k
  or greedy after stages that move a few known tokens is given those tokens and the model's largest, not the whole
  vocabulary: _sparse — less than the plain chain's penalties cost), a grammar in the chain or its resample,
  typical-p, XTC, DRY, mirostat; each stage's distribution kept as trace_distribution.py keeps it.

What it costs (issue 61: no more than `--logprobs`) is measured by `bench --sampling`: after a model pass, each
numpy call's first use costs ~10 µs of caches refilled, whatever its size, and so does Python code's — fewer calls,
not smaller arrays, is what makes it cheaper."""

from __future__ import annotations

import ctypes
import math
from functools import partial
from typing import Any

import llama_cpp
import numpy as np

from llmcli.llama.logprobs import logits_at
from llmcli.llama.observed_trace import _observable, _observed
from llmcli.llama.sampler_chain import SELECTORS, Sampler
from llmcli.llama.trace_distribution import CHANGED, Distribution, cut, differs, fold, stage_distribution, whole
from llmcli.llama.traced_token import (
    FOUND,
    CandidateArray,
    ModelTop,
    Traced,
    accepted,
    candidate_array,
    chain_stages,
    traced_from,
)
from llmcli.llama.vocab import Vocabulary


def sample_traced(sampler: Sampler, vocab: Vocabulary, index: int, n_top: int) -> Traced:
    """The next token from the logits at batch `index`, as `sampler.sample` would choose it, with its trace: read from
    what the chain's observing samplers saw, where it has them and is of a shape they read (_observed); else
    applied stage by stage here."""
    observation = getattr(sampler, "observation", None)
    if observation is not None and (observation.readable if observation.readable is not None else _observable(sampler)):
        return _observed(sampler, vocab, index, n_top, partial(_through, sampler, "constrained"))
    n_vocab = vocab.n_tokens
    logits = logits_at(sampler.ctx, index, n_vocab)  # (llama.cpp's own: no decode until done)
    if sampler.first_bias:  # (as Sampler.sample applies it: into llama.cpp's logits, then dropped)
        for token_id, bias in sampler.first_bias:
            logits[token_id] += np.float32(bias)
        sampler.first_bias = ()
    buffer = candidate_array(sampler, n_vocab)
    top = ModelTop(logits)  # (the model's largest found first, as many as a top-k after moving stages is given)
    movable = len(sampler.biased) + (len(sampler.recent) if sampler.recent is not None else 0)
    found = top.of(FOUND if movable > SPARSE else max(FOUND, sampler.top_k + 1 + movable))
    start = whole(logits, buffer.weights, float(logits[found[0]]) if len(found) else None)
    log_total = start.top + math.log(start.total)  # a token's log-probability is its logit less this
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
    return traced_from(token, stages, changed, final, start, top, log_total, vocab, n_top, note)


def _through(sampler: Sampler, which: str, start: Distribution,
             buffer: CandidateArray, top: ModelTop) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """Apply each sampler of the sampler's chain `which` in turn to the candidates (`start` the model's distribution):
    each stage and the candidates it left, the stages that changed the distribution, the final distribution (before
    the selecting stage: the probability of each candidate left, 0 for one masked), the token selected (accepted by
    the chain, as llama_sampler_sample does)."""
    n_vocab = len(start.logits)
    chain = chain_stages(sampler, which)
    if len(chain) == 1 and chain[0][1] == "greedy":  # (greedy alone: llama.cpp's first largest logit, numpy's too —
        token = int(start.logits.argmax())  # no candidate array to fill: ~0.04 ms a token)
        return (("greedy", n_vocab),), (), start, accepted(sampler, which, token), ""
    sparse = _sparse(sampler, which, chain, start, buffer, top)
    if sparse is not None:
        return sparse
    buffer.words[:] = buffer.fresh  # (the rows whole, then the logits' column: ~1.6 × faster than three fields)
    buffer.words[:, 1] = start.logits.view(np.int32)
    buffer.start(n_vocab)
    return _onwards(sampler, which, chain, buffer, [], [], start, top)


def _onwards(sampler: Sampler, which: str, chain: tuple[tuple[Any, str], ...], buffer: CandidateArray,
             stages: list[tuple[str, int]], changed: list[str], before: Distribution, top: ModelTop) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str]:
    """_through's stages from `chain` on, applied to the candidates the buffer's array holds (`before` their
    distribution)."""
    n_vocab = len(buffer.in_order)
    header, reference, ids = buffer.header, buffer.reference, buffer.view["id"]
    final = before
    for stage, name in chain:
        if name == "greedy" and final.ids is None:  # (llama.cpp's first largest logit of a whole vocabulary in
            stages.append((name, n_vocab))  # order: numpy's argmax, without another pass in C)
            token = int(final.logits.argmax())
            return tuple(stages), tuple(changed), final, accepted(sampler, which, token), ""
        sorted_ids = before.ids if before.p is not None and before._ordered and int(header[0]) == buffer.home \
            and buffer.flags[24] else None  # (candidates in order, llama.cpp's array marked sorted)
        llama_cpp.llama_sampler_apply(stage, reference)
        size = int(header[1])
        stages.append((name, size))
        if name in SELECTORS:
            break
        after = None
        if sorted_ids is not None and int(header[0]) == buffer.home and 0 < size <= len(sorted_ids) \
                and ids[size - 1] == sorted_ids[size - 1]:
            if name in PREFIX_CUTS:  # (a cut of those: the first)
                after = before.first(size)
            elif name == "temp" and size == len(sorted_ids):  # (the same rows, their logits divided: still in order)
                after = cut(sorted_ids, buffer.view["logit"][:size].copy(), ordered=True)
                after.change = float(np.abs(after.p - before.p).max()) if after.p is not None else None
        if after is None:
            after = stage_distribution(*buffer.rows(), before, buffer.in_order)
        if after is not before and (after.change > CHANGED if after.change is not None else
                                    _left_out(before, after, top) or differs(before, after, n_vocab)):
            changed.append(name)
        before = final = after
    return tuple(stages), tuple(changed), final, accepted(sampler, which, buffer.selected()), ""


def _left_out(before: Distribution, after: Distribution, top: ModelTop) -> bool:
    """Whether a cut of the whole vocabulary left out one of the model's most likely tokens whose probability was
    above CHANGED — a change, seen without the vocabulary's weights."""
    if before.ids is not None or after.ids is None or len(after.ids) >= FOUND:
        return False
    kept = set(after.ids.tolist())
    out = [token for token in top.of(FOUND).tolist() if token not in kept]
    return bool(out) and float(before.p_at(out).max()) > CHANGED


PREFIX_CUTS = ("top-p", "min-p")  # cuts that keep the first of candidates in order (llama.cpp's, sorted: their rows
# not moved, their logits not changed)
SPARSE = 4096  # the most tokens the stages before a top-k or greedy may move, for them to be given those alone


def _touched(sampler: Sampler, name: str) -> tuple[int, ...] | None:
    """The only tokens a stage named `name` may give another logit — it changes each candidate by its id alone,
    whichever others it is given — or None for any other stage."""
    if name == "logit-bias":
        return sampler.biased
    if name == "penalties" and sampler.recent is not None and len(sampler.recent) <= SPARSE:  # (a window of the
        return tuple(sampler.recent)  # whole context, long: the whole vocabulary, not a copy of it each token)
    return None


def _largest_unmoved(was: np.ndarray, moved: np.ndarray) -> float:
    """The largest logit before a stage outside the rows `moved` it changed, of the given tokens' logits before it
    (`was`: a copy, changed here) — they hold the model's largest, as many as the stages may move and one more, so
    one of them no stage moved: the largest such logit of the whole vocabulary is theirs."""
    was[moved] = -np.inf
    return float(was.max())


def _sparse(sampler: Sampler, which: str, chain: tuple[tuple[Any, str], ...], start: Distribution,
            buffer: CandidateArray, top: ModelTop) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], Distribution, int, str] | None:
    """_through without the whole vocabulary, where the chain is stages that move a few known tokens' logits (a
    bias, penalties) then a top-k or greedy: the stages are given those tokens and the model's largest, k + 1 more
    than those (greedy: k = 0) — enough to hold the k + 1 largest logits once they moved, and the largest one they
    left unmoved, so a top-k's rows are the ones the whole vocabulary gives, in the same order, where those are
    distinct — not the whole vocabulary filled (~30 µs), compared (~15 µs) and cut (a repeat penalty's pass over it:
    ~130 µs). None where the chain is not of that shape (nothing applied yet, or only the moving stages, which keep
    no state)."""
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
    touched = set(moving)
    if touched and not (min(touched) >= 0 and max(touched) < n_vocab):
        touched = {token for token in touched if 0 <= token < n_vocab}
    pool = top.of(min(k + 1 + len(touched), n_vocab))  # (the model's largest, with the touched ones not among them:
    listed = pool.tolist()  # the largest unmoved logit is always one of those given)
    extra = touched.difference(listed)
    given = np.array([*listed, *extra] if extra else listed, dtype=np.int32)
    last = start.logits[given]  # (the given tokens' logits before each moving stage)
    rows = buffer.view[:len(given)]
    rows["id"], rows["logit"], rows["p"] = given, last, 0
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
        moved = np.flatnonzero(values != last)
        if len(moved):
            was, last = last, values.copy()
            after = fold(before, given[moved], last[moved], partial(_largest_unmoved, was, moved),
                         moved_from=was[moved])
            if after is None:
                current = before.logits.copy()
                current[given[moved]] = last[moved]
                after = whole(current)
            if after.change > CHANGED if after.change is not None else differs(before, after, n_vocab):
                changed.append(name)
            before = after
    if not k:  # (greedy: llama.cpp's first largest logit of the whole vocabulary, in order)
        stages.append(("greedy", n_vocab))
        return tuple(stages), tuple(changed), before, accepted(sampler, which, int(before.logits.argmax())), ""
    ranked = last[:k + 1] if not touched else np.sort(last)[:-k - 2:-1]  # (the pool, in order: its logits now)
    if len(set(ranked.tolist())) <= k:  # (a tie among them: the whole vocabulary, in llama.cpp's order)
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
