"""A traced token read from inside llama.cpp's own sampling (`run --trace`): a traced answer's chain has a sampler of
ours after each stage (stage_observation.py), `llama_sampler_sample` fills, cuts and sorts the candidates in C as for
an untraced answer, and what each stage left is read here as plain lists — a logit bias folded into the model's
softmax sum, each cut compared with the one before, the temperature divided here. For a logit bias, cuts (top-k,
top-p, min-p), a temperature, then dist or greedy: the default chain's shapes (sampler_trace.py traces the others
stage by stage). After a model pass each numpy call's or Python function's first use costs ~10 µs of refilled caches
whatever its size: fewer calls, not smaller arrays, is what makes this cheaper."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.logprobs import logits_at
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.stage_observation import Seen
from llmcli.llama.trace_distribution import CHANGED, Distribution, whole
from llmcli.llama.traced_token import (
    BY_P_SAMPLER_THEN_MODEL,
    CandidateArray,
    ModelTop,
    Traced,
    candidate_array,
    chain_stages,
    traced_from,
)
from llmcli.llama.vocab import Vocabulary

Resample = Callable[[Distribution, CandidateArray, ModelTop], tuple[tuple[tuple[str, int], ...], tuple[str, ...], Distribution,
                                                           int, str]]  # (the constrained chain, stage by stage)


CUTS = ("top-k", "top-p", "min-p")  # stages that keep the most likely candidates


def _observable(sampler: Sampler) -> bool:
    """Whether the chain is of a shape its observing samplers' records are read for: a logit bias then greedy
    (greedy alone is read without a candidate array), or a logit bias or not, then cuts, a temperature and dist.
    Others are traced stage by stage: penalties (a top-k after them is then given the tokens they move and the
    model's largest — the plain chain's penalties over the whole vocabulary cost more than reading them), a grammar
    in the chain, typical-p, XTC, DRY, mirostat. The bias's observer is told which tokens it moves."""
    names = [name for _, name in chain_stages(sampler, "chain")]
    lead = 1 if names[:1] == ["logit-bias"] else 0
    rest = names[lead:]
    cuts = rest[:-2]
    observation = sampler.observation
    assert observation is not None
    seen = [record.name for record in observation.seen]
    found = seen == [name for name in names[:-1] if name != "temp"] and (
        (rest == ["greedy"] and lead > 0)
        or (rest[-2:] == ["temp", "dist"] and 0 < len(cuts) == len(set(cuts)) and all(c in CUTS for c in cuts)))
    if found and lead:
        biased = sorted({t for t in sampler.biased if 0 <= t < observation.n_vocab})
        observation.seen[0].touched = lambda: biased
    observation.readable, observation.selector = found, names[-1]  # (until a lazy grammar armed makes it another)
    return found


class _Whole:
    """The whole vocabulary's distribution as the stages so far left it: the model's logits with a few `moved`
    (token -> logit), their softmax's sum `total` taken against the model's largest logit `peak`. Its weights are
    computed into `weights` as exp(logit) where the largest logit is moderate (one numpy call fewer: a subtraction
    over the vocabulary), else as exp(logit - peak)."""

    __slots__ = ("logits", "peak", "total", "moved", "was", "_weights", "_scale")

    def __init__(self, logits: np.ndarray, peak: float, weights: np.ndarray):
        self.logits, self.peak = logits, peak
        if -60.0 < peak < 60.0 and math.isfinite(peak):
            np.exp(logits, out=weights)
            self._scale = math.exp(-peak)
        else:
            np.exp(np.subtract(logits, np.float32(peak), out=weights), out=weights)
            self._scale = 1.0
        self._weights = weights
        self.total = float(weights.sum()) * self._scale
        self.moved: dict[int, float] = {}
        self.was: dict[int, float] = {}  # (the moved ones' logits as the model gave them)

    def logit(self, token: int) -> float:
        found = self.moved.get(token)
        return float(self.logits[token]) if found is None else found

    def p(self, token: int) -> float:
        return math.exp(self.logit(token) - self.peak) / self.total

    def largest_unmoved(self, also: set[int]) -> float:
        """The largest logit of the tokens neither moved before nor in `also`."""
        rest = self.logits.copy()
        rest[list({*self.moved, *also})] = -np.inf
        return float(rest.max())

    def unmoved_mass(self, also: set[int]) -> float:
        """The sum of exp(logit - peak) over the tokens neither moved nor in `also`, in float64."""
        weights = self._weights.copy()
        weights[list({*self.moved, *also})] = 0
        return float(weights.sum(dtype=np.float64)) * self._scale

    def weights(self) -> np.ndarray:
        """exp(logit - peak) of every token, as float32 (a fresh array)."""
        found: np.ndarray = self._weights * np.float32(self._scale) if self._scale != 1.0 else self._weights.copy()
        if self.moved:
            tokens = list(self.moved)
            found[tokens] = np.exp(np.array([self.moved[t] for t in tokens]) - self.peak)
        return found


def _moved_by(state: _Whole, tokens: list[int], logits: list[float]) -> float | None:
    """Fold a stage that gave `tokens` these `logits` into `state`: the largest change of a token's probability, or
    None where folding would lose precision (a logit far above the largest, the mass left mostly on those tokens)."""
    if not tokens:
        return 0.0
    moved, peak = state.moved, state.peak
    model = state.logits[tokens].tolist()  # (one numpy call for them all)
    changes = [(t, moved.get(t, m), after, m) for t, m, after in zip(tokens, model, logits, strict=True)
               if after != moved.get(t, m)]
    if not changes:
        return 0.0
    if any(after - peak > 600 for _, _, after, _ in changes):
        return None
    old_w = [math.exp(before - peak) for _, before, _, _ in changes]
    new_w = [math.exp(after - peak) for _, _, after, _ in changes]
    total = state.total - math.fsum(old_w) + math.fsum(new_w)
    if not total > state.total * 1e-6:
        return None
    if total < state.total * 0.1:  # (most of the mass moved: the float32 sum's error, ~1e-7, would be amplified
        unmoved = state.unmoved_mass({t for t, _, _, _ in changes})  # as much: the rest summed again, in float64)
        total = unmoved + math.fsum(math.exp(logit - peak) for t, logit in moved.items() if t not in
                                    {c[0] for c in changes}) + math.fsum(new_w)
    change = max(abs(n / total - o / state.total) for o, n in zip(old_w, new_w, strict=True))
    now = {t for t, _, _, _ in changes}
    holds_peak = any(m == peak for m in model) or any(m == peak for m in state.was.values())
    largest = state.largest_unmoved(now) if holds_peak else peak  # (the largest logit no stage moved)
    earlier = [logit for t, logit in moved.items() if t not in now]
    others = math.exp(max([largest, *earlier]) - peak) / state.total
    change = max(change, abs(state.total / total - 1.0) * others)
    for t, _, after, m in changes:
        moved[t] = after
        state.was.setdefault(t, m)
    state.total = total
    return change


def _softmax(logits: list[float]) -> list[float]:
    if not logits:
        return []
    top = max(logits)
    if top == -math.inf:
        return [0.0] * len(logits)
    weights = [math.exp(x - top) for x in logits]
    total = math.fsum(weights)
    return [w / total for w in weights]


def _cut_of_cut(ids: list[int], logits: list[float], p: list[float], kept_ids: list[int],
                kept_logits: list[float]) -> tuple[list[float], float]:
    """A stage after a cut (candidates `ids`, their `logits` and probabilities `p`) left `kept_ids` with
    `kept_logits`: their probabilities, and the largest change of a token's. The usual ones cost no exp: the first
    ones kept as they were (top-p, min-p: renormalized), or the same ones, other logits (a temperature)."""
    n = len(kept_ids)
    if n <= len(ids) and kept_ids == ids[:n]:
        if kept_logits == logits[:n]:
            share = math.fsum(p[:n])
            if share > 0:
                return [q / share for q in p[:n]], max(max(p[:n]) * (1 - share) / share, max(p[n:], default=0.0))
        elif n == len(ids):
            kept_p = _softmax(kept_logits)
            return kept_p, max((abs(a - b) for a, b in zip(kept_p, p, strict=True)), default=0.0)
    kept_p = _softmax(kept_logits)
    before = dict(zip(ids, p, strict=True))
    change = max((abs(after - before.pop(t, 0.0)) for t, after in zip(kept_ids, kept_p, strict=True)), default=0.0)
    return kept_p, max(change, max(before.values(), default=0.0))  # (the ones left out)


def _largest_near(logits: np.ndarray, peak: float, count: int) -> list[int]:
    """The `count` largest logits' tokens, the largest first, found among those within a few nats of the largest
    (`peak`): two numpy calls where a distribution is peaked, not largest()'s six."""
    for gap in (8.0, 24.0):
        found = np.flatnonzero(logits >= np.float32(peak - gap))
        if count <= len(found) <= 4096:
            ranked: list[int] = found[np.argsort(-logits[found], kind="stable")[:count]].tolist()
            return ranked
    largest_first: list[int] = ModelTop(logits).of(count).tolist()
    return largest_first


def _cut_from_whole(state: _Whole, ids: list[int], logits: list[float], p: list[float]) -> float:
    """How much a first cut (the candidates `ids`, their logits, their probabilities `p` now) changed the whole
    distribution: where the mass it left out is clearly more than a float32 sum's error, the largest kept rose by at
    least that mass over their number (a change); else the largest left out, and the kept renormalized, from the
    weights."""
    top = max(logits, default=-math.inf)  # (a cut keeps the logits it was given: their share of the whole is the
    kept = math.exp(top - state.peak) / state.total / max(p, default=1.0)  # largest's over its share of them)
    left_out = 1.0 - kept
    if left_out > 1e-5 and len(ids) < 10_000:
        return left_out / len(ids)
    before = [math.exp(logit - state.peak) / state.total for logit in logits]
    weights = state.weights()
    weights[ids] = 0
    largest_left = float(weights.max()) / state.total
    dropped = float(weights.sum(dtype=np.float64)) / state.total  # (0: it left out none that had a chance)
    return max(largest_left, max(before, default=0.0) * dropped / (1 - dropped) if dropped < 1 else 1.0)


def _unmoved_first(record: Seen, logits: np.ndarray) -> tuple[list[float], list[int]]:
    """What a narrowed bias record says of the model's largest: the logits and ids of its candidates the bias did
    not move (theirs are the model's; any other it did not move is below them) and of the biased tokens, as the
    model gave them."""
    ids, values = record.rows()
    biased = record.moved_ids
    model = logits[biased].tolist() if biased else []
    moved = {t for t, m, now in zip(biased, model, record.moved or (), strict=True) if now != m}
    kept = [(value, t) for t, value in zip(ids, values, strict=True) if t not in moved]
    found = kept + [(m, t) for t, m in zip(biased, model, strict=True) if t in moved]
    return [value for value, _ in found], [t for _, t in found]


def _observed(sampler: Sampler, vocab: Vocabulary, index: int, n_top: int, resample: Resample) -> Traced:
    """sample_traced from the observing samplers' records: llama.cpp's own `llama_sampler_sample` chooses the token
    (the candidates filled, cut and sorted in C, as an untraced answer's), then each stage's record is read — the
    moving stages folded into the model's softmax, the cuts' and the temperature's candidates compared as plain
    lists (a few dozen: Python's floats cost less here than numpy's calls on small arrays, each ~10 µs the first
    time after a model pass). `resample`: the constrained chain stage by stage, where a lazy grammar refuses the
    token."""
    n_vocab = vocab.n_tokens
    if sampler.first_bias:  # (as Sampler.sample applies it: into llama.cpp's logits, then dropped)
        logits = logits_at(sampler.ctx, index, n_vocab)
        for token_id, bias in sampler.first_bias:
            logits[token_id] += np.float32(bias)
        sampler.first_bias = ()
    observation = sampler.observation
    assert observation is not None
    first = observation.seen[0]
    if observation.selector == "greedy" and not first.narrow:  # (greedy after a bias: its observer keeps the largest,
        first.narrow = n_top + len(sampler.biased) + 1  # the trace's candidates, for greedy to choose among: one unbiased)
    token = int(llama_cpp.llama_sampler_sample(sampler.chain, sampler.ctx, index))  # (accepted by the chain)
    if sampler.recent is not None:
        sampler.recent.append(token)
    logits = logits_at(sampler.ctx, index, n_vocab)
    buffer = candidate_array(sampler, n_vocab)
    first_rows = first.rows() if first.moved is None or first.narrow else None  # (a first cut's, or the largest
    narrowed = _unmoved_first(first, logits) if first.narrow else None  # kept: the model's largest logit is known)
    peak = max(narrowed[0]) if narrowed else max(first_rows[1]) if first_rows and first_rows[1] else None
    state = _Whole(logits, float(logits.max()) if peak is None else peak, buffer.weights)
    log_total = state.peak + math.log(state.total)
    stages: list[tuple[str, int]] = []
    changed: list[str] = []
    ids: list[int] | None = None  # (the candidates the last cut left, in its order: their logits, probabilities)
    kept_logits: list[float] = []
    p: list[float] = []
    k = min(n_top, n_vocab)
    model_top: list[int] | None = None  # (the model's most likely, where a cut's candidates hold them)
    model_logits: dict[int, float] = {}
    model_peak, exact = state.peak, True  # (`exact`: state's logits are still the model's, a few moved)
    for record in observation.seen:
        if record.size < 0:
            raise RuntimeError(f"the trace could not see what {record.name} left")
        if record.moved is not None:
            stages.append((record.name, n_vocab))
            change = _moved_by(state, record.moved_ids, record.moved)
            if change is None:  # (imprecise: the whole vocabulary's softmax, those logits in it, and a new state)
                current = logits.copy()
                current[list(state.moved)] = list(state.moved.values())
                current[record.moved_ids] = record.moved
                after = _Whole(current, float(current.max()), np.empty_like(buffer.weights))
                change = float(np.abs(state.weights() / state.total - after.weights() / after.total).max())
                state, exact = after, False
            if change > CHANGED:
                changed.append(record.name)
            continue
        stages.append((record.name, record.size))
        if ids is not None and record.size == len(ids) and record.name in CUTS:  # (a cut that cut nothing: the
            continue  # same candidates, maybe reordered, the same logits)
        before_logits = kept_logits
        kept_ids, kept_logits = first_rows if record is first and first_rows else record.rows()
        if ids is None:  # (the first cut, of the whole vocabulary)
            kept_p = _softmax(kept_logits)
            change = _cut_from_whole(state, kept_ids, kept_logits, kept_p)
            if exact:  # (the model's most likely: the cut's, with the moved ones as the model had them)
                pool = [(logit, t) for t, logit in zip(kept_ids, kept_logits, strict=True) if t not in state.moved]
                if len(pool) >= k:
                    pool += zip(logits[list(state.moved)].tolist(), state.moved, strict=True) if state.moved else []
                    model_top = [t for _, t in sorted(pool, key=lambda pair: -pair[0])[:k]]
                    model_logits = {t: logit for logit, t in pool}  # (the model's own logits of these)
        else:
            kept_p, change = _cut_of_cut(ids, before_logits, p, kept_ids, kept_logits)
        if change > CHANGED:
            changed.append(record.name)
        ids, p = kept_ids, kept_p
    if ids is not None and observation.selector == "dist":  # (the temperature before it: its division, here)
        kept_logits = [logit / sampler.temp for logit in kept_logits]
        after_p = _softmax(kept_logits)
        stages.append(("temp", len(ids)))
        if max((abs(a - b) for a, b in zip(after_p, p, strict=True)), default=0.0) > CHANGED:
            changed.append("temp")
        p = after_p
    selector = observation.selector
    stages.append((selector, n_vocab if ids is None else len(ids)))
    note = ""
    if sampler.grammar is not None and sampler.armed:  # (the lazy check: the grammar alone on the chosen token;
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)  # rejected, sampled again stage by stage)
        array = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
        if one.logit == -math.inf:
            refused = vocab.piece(token, special=True).decode("utf-8", "replace")
            top = ModelTop(logits)
            start = whole(logits, buffer.weights)
            again, changes, final, token, _ = resample(start, buffer, top)
            llama_cpp.llama_sampler_accept(sampler.grammar, token)
            return traced_from(token, again, changes, final, start, top, log_total, vocab, n_top,
                           f"the grammar refused {refused!r}: sampled again under it")
        llama_cpp.llama_sampler_accept(sampler.constrained, token)
        llama_cpp.llama_sampler_accept(sampler.grammar, token)
    else:
        sampler.watch(token)
    if ids is not None:
        final_p = dict(zip(ids, p, strict=True))
        ranked = sorted(zip(p, ids, strict=True), key=lambda pair: -pair[0])
        sampler_top = [t for q, t in ranked if q > 0][:k]
    else:
        final_p, sampler_top = {}, []
    if narrowed is not None and first_rows is not None:  # (greedy after a bias: the largest now are the narrowed,
        model_logits = dict(zip(narrowed[1], narrowed[0], strict=True))  # the model's among them and the biased)
        model_top = sorted(model_logits, key=model_logits.__getitem__, reverse=True)[:k]
        sampler_top = first_rows[0][:k]
        final_p = {t: state.p(t) for t in {token, *sampler_top, *model_top}}
    elif model_top is None or (ids is None and k):
        nearest = _largest_near(logits, model_peak, min(k + len(state.moved), n_vocab)) if k else []
        model_top = nearest[:k]
        if ids is None:  # (greedy after moving stages: the sampler's most likely are among these and the moved)
            among = {*nearest, *state.moved}
            sampler_top = sorted(among, key=lambda t: -state.logit(t))[:k]
            final_p = {t: state.p(t) for t in {token, *among}}
    chosen = list(dict.fromkeys([token, *model_top[:k], *sampler_top]))
    if ids is None:
        final_p.update((t, state.p(t)) for t in chosen if t not in final_p)
    known = [model_logits.get(t) for t in chosen]
    logits_chosen = known if None not in known else logits[chosen].tolist()
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), logit - log_total, math.exp(logit - log_total),
                                   final_p.get(t, 0.0)) for t, logit in zip(chosen, logits_chosen, strict=True)),
                        key=BY_P_SAMPLER_THEN_MODEL, reverse=True)  # (stable: ties keep their order)
    return Traced(token, "argmax" if selector == "greedy" else "drawn", final_p.get(token, 0.0), tuple(candidates),
                  tuple(stages), tuple(changed), note)
