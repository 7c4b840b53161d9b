"""One token sampled with every stage seen (`run --trace`), two ways; either way the token is the one the plain call
would give, and each stage's effect is visible: which candidates it left and whether it changed the distribution.
Only a traced answer comes here; the plain path is Sampler.sample.

- Observed (_observed): a traced answer's chain has a sampler of ours after each stage (stage_observation.py), so
  llama.cpp's own `llama_sampler_sample` fills, cuts and sorts the candidates in C as for an untraced answer, and the
  trace reads what each stage left as plain lists. For a logit bias, cuts (top-k, top-p, min-p), a temperature,
  then dist or greedy: the default chain's shapes.
- Stage by stage (_through): `llama_sampler_sample` done by hand — the logits into a candidate array, each sampler
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
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.logprobs import largest, logits_at
from llmcli.llama.sampler_chain import SELECTORS, Sampler
from llmcli.llama.stage_observation import Seen
from llmcli.llama.trace_distribution import CHANGED, Distribution, cut, differs, fold, stage_distribution, whole
from llmcli.llama.vocab import Vocabulary


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
BY_P_SAMPLER_THEN_MODEL = itemgetter(4, 3)  # (a Candidate's p_sampler, p_model)


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
    """The next token from the logits at batch `index`, as `sampler.sample` would choose it, with its trace: read from
    what the chain's observing samplers saw, where it has them and is of a shape they read (_observed); else
    applied stage by stage here."""
    observation = getattr(sampler, "observation", None)
    if observation is not None and (observation.readable if observation.readable is not None else _observable(sampler)):
        return _observed(sampler, vocab, index, n_top)
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
    return _traced(token, stages, changed, final, start, top, log_total, vocab, n_top, note)


def _traced(token: int, stages: tuple[tuple[str, int], ...], changed: tuple[str, ...], final: Distribution,
            start: Distribution, top: _Top, log_total: float, vocab: Vocabulary, n_top: int, note: str) -> Traced:
    """The trace of a token chosen stage by stage: its candidates, the model's most likely and the chain's."""
    n_vocab, logits = vocab.n_tokens, start.logits
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
                        key=BY_P_SAMPLER_THEN_MODEL, reverse=True)  # (stable: ties keep their order)
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
        observation = getattr(sampler, "observation", None)
        observing = observation.addresses if observation is not None else set()
        stages = [stage for stage in stages if ctypes.cast(stage, ctypes.c_void_p).value not in observing]
        found = kept[which] = tuple((stage, (llama_cpp.llama_sampler_name(stage) or b"?").decode()) for stage in stages)
    return found


# -- read from inside llama.cpp's own sampling (a traced answer's chain observed: stage_observation.py) -------------

CUTS = ("top-k", "top-p", "min-p")  # stages that keep the most likely candidates


def _observable(sampler: Sampler) -> bool:
    """Whether the chain is of a shape its observing samplers' records are read for: a logit bias then greedy
    (greedy alone is read without a candidate array), or a logit bias or not, then cuts, a temperature and dist.
    Others are traced stage by stage: penalties (a top-k after them is then given the tokens they move and the
    model's largest — the plain chain's penalties over the whole vocabulary cost more than reading them), a grammar
    in the chain, typical-p, XTC, DRY, mirostat. The bias's observer is told which tokens it moves."""
    names = [name for _, name in _stages(sampler, "chain")]
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
    largest_first: list[int] = _Top(logits).of(count).tolist()
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


def _observed(sampler: Sampler, vocab: Vocabulary, index: int, n_top: int) -> Traced:
    """sample_traced from the observing samplers' records: llama.cpp's own `llama_sampler_sample` chooses the token
    (the candidates filled, cut and sorted in C, as an untraced answer's), then each stage's record is read — the
    moving stages folded into the model's softmax, the cuts' and the temperature's candidates compared as plain
    lists (a few dozen: Python's floats cost less here than numpy's calls on small arrays, each ~10 µs the first
    time after a model pass)."""
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
    buffer = _candidates(sampler, n_vocab)
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
            top = _Top(logits)
            start = whole(logits, buffer.weights)
            again, changes, final, token, _ = _through(sampler, "constrained", start, buffer, top)
            llama_cpp.llama_sampler_accept(sampler.grammar, token)
            return _traced(token, again, changes, final, start, top, log_total, vocab, n_top,
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
