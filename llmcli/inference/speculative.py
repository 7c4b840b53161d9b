"""Step 5, several tokens a pass: speculative decoding that pays on a CPU, and stops when it does not.

A pass of k + 1 tokens reads the weights once, so it costs far less than k + 1 single passes. The
decoder drafts k tokens — from the prompt and the answer so far (the tokens that followed the latest
earlier occurrence of the last n tokens: prompt lookup), or from a small draft model with the same
vocabulary — evaluates the pending token and the draft in one `llama_decode` with logits at every
position, and samples the target's own chain at each position in turn: while the sampled token equals
the drafted one, the next position's logits are already right. The first mismatch is the next token
(as plain decoding would have sampled it: the chain, its RNG, penalties and grammar see exactly the
tokens they would have seen), and the rejected draft leaves the KV cache.

So greedy answers are identical to plain decoding, and a seeded sampled answer is the one plain
decoding gives with that seed (up to llama.cpp's batch numerics). `CostModel` decides whether to draft
and how many tokens, from the measured cost of a k-token pass against a 1-token pass on this machine and
the measured acceptance; `auto` drafts only when the expected gain is positive, and probes again now and
then when it is not.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmcli.inference.kv_cache import KVCache
from llmcli.inference.sampler import Sampler
from llmcli.inference.vocab import Vocabulary


class Engine(Protocol):
    """What decoding needs of an `llmcli.inference.engine.Engine` (which uses this module)."""

    kv: KVCache
    vocab: Vocabulary
    n_ctx: int

    @property
    def llama_context(self) -> Any: ...

    def evaluate(self, tokens: Sequence[int], all_logits: bool = False) -> None: ...

    def prefill(self, prompt: Sequence[int], start: int = 0) -> bool: ...

    def close(self) -> None: ...

MODES = ("auto", "lookup", "draft", "off")
NGRAM_SIZES = (12, 8, 5, 3, 2)  # the suffix looked up, longest first: a long match is seldom the wrong place
PROBE_EVERY = 64  # auto, not drafting: one small draft this often (tokens), to notice when it would pay again
PROBE_K = 2
MIN_GAIN = 1.05  # auto drafts only when the expected speed-up is at least this


class LookupDrafter:
    """Drafts from the tokens so far: what followed the latest earlier occurrence of their last n tokens."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest indexed occurrence
        self._indexed = 0  # n-grams ending at positions <= this are indexed

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def draft(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the size of the n-gram matched (0: none found)."""
        tokens, latest = self.tokens, self._latest
        end = len(tokens)
        for stop in range(self._indexed + 1, end):  # every n-gram that ends before the current end
            for n in NGRAM_SIZES:
                if stop >= n:
                    latest[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end - 1)
        for n in NGRAM_SIZES:
            if end >= n:
                found = latest.get(tuple(tokens[end - n :]))
                if found is not None:
                    return tokens[found : min(found + k, end)], n
        return [], 0


# What a draft from each source is worth before anything is measured: the chance that a drafted token is
# right (given the ones before it were). A long n-gram match is seldom in the wrong place; a draft model's
# guess is as good as its model.
PRIOR_ACCEPTANCE = {12: 0.9, 8: 0.85, 5: 0.65, 3: 0.45, 2: 0.35, 0: 0.7}  # n-gram size (0: a draft model)
PRIOR_WEIGHT = 4.0
CALIBRATION_SIZES = (2, 8)  # with the 1-token passes measured anyway; the rest interpolated
CALIBRATE_FROM = 8  # auto times passes (once a session) when an n-gram match at least this long appears


@dataclass
class CostModel:
    """What a pass costs here and how often drafts are right: the expected speed-up of drafting k tokens.

    Costs are in units of a 1-token pass: a pass of n tokens costs `pass_cost(n)` (measured for each n that
    was used, else 1 + per_token * (n - 1)); a draft model adds draft_cost per drafted token. Acceptance is
    kept per source (the n-gram size of a lookup, 0 for a draft model), as counts that fade so that it
    follows the answer."""

    per_token: float = 0.5  # until measured: ~0.4-0.6 for SmolLM2, ~0.35-0.45 for Gemma-3-270M at 2 threads
    pass_ratio: dict[int, float] = field(default_factory=dict)  # tokens in a pass -> its cost / a 1-token pass
    draft_cost: float = 0.0
    counts: dict[int, list[float]] = field(default_factory=dict)  # source -> [hits, misses]
    one_pass_s: float | None = None  # seconds of a 1-token pass (moving average)

    def acceptance(self, source: int) -> float:
        hits, misses = self._counts(source)
        return hits / (hits + misses)

    def _counts(self, source: int) -> list[float]:
        if source not in self.counts:
            prior = PRIOR_ACCEPTANCE.get(source, 0.5)
            self.counts[source] = [prior * PRIOR_WEIGHT, (1 - prior) * PRIOR_WEIGHT]
        return self.counts[source]

    def gain(self, k: int, source: int) -> float:
        """Expected tokens per pass over the pass's cost, for a k-token draft (1.0: as plain decoding)."""
        a = min(self.acceptance(source), 0.999)
        expected = (1 - a ** (k + 1)) / (1 - a)
        return expected / (self.pass_cost(k + 1) + self.draft_cost * k)

    def pass_cost(self, n_tokens: int) -> float:
        """A pass of n_tokens, in 1-token passes: measured for this size, else interpolated between measured sizes
        (a pass's cost is far from linear: the first extra token costs most), else the per-token estimate."""
        if n_tokens in self.pass_ratio:
            return self.pass_ratio[n_tokens]
        points = sorted({1: 1.0, **self.pass_ratio}.items())
        if len(points) == 1:
            return 1 + self.per_token * (n_tokens - 1)
        below = [p for p in points if p[0] < n_tokens][-1]
        above = next((p for p in points if p[0] > n_tokens), None)
        if above is None:  # beyond the largest measured pass: the slope of the last two
            below, above = points[-2], points[-1]
        slope = (above[1] - below[1]) / (above[0] - below[0])
        return below[1] + slope * (n_tokens - below[0])

    @property
    def calibrated(self) -> bool:
        return len(self.pass_ratio) >= 2

    def calibrate(self, engine: Engine, token: int, largest: int) -> None:
        """Time passes of 2 and 8 tokens (up to `largest` + 1) here, then take them out of the cache again:
        once per session, when a draft is first worth considering (a fraction of a second)."""
        for n in CALIBRATION_SIZES:
            if n > largest + 1:
                break
            start = engine.kv.n_cached
            started = time.perf_counter()
            engine.evaluate([token] * n, all_logits=n > 1)
            self.observe_pass(n, time.perf_counter() - started)
            engine.kv.remove(0, start, -1)

    def best_k(self, available: int, source: int) -> tuple[int, float]:
        best, gain = 0, 1.0
        for k in range(1, available + 1):
            g = self.gain(k, source)
            if g > gain:
                best, gain = k, g
        return best, gain

    def observe_pass(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1:
            self.one_pass_s = seconds if self.one_pass_s is None else 0.9 * self.one_pass_s + 0.1 * seconds
        elif self.one_pass_s:
            ratio = seconds / self.one_pass_s
            known = self.pass_ratio.get(n_tokens)
            self.pass_ratio[n_tokens] = ratio if known is None else 0.7 * known + 0.3 * ratio
            self.per_token = 0.8 * self.per_token + 0.2 * max(0.0, (ratio - 1) / (n_tokens - 1))

    def observe_draft_cost(self, n_tokens: int, seconds: float) -> None:
        if self.one_pass_s and n_tokens:
            self.draft_cost = 0.7 * self.draft_cost + 0.3 * seconds / n_tokens / self.one_pass_s

    def observe_acceptance(self, source: int, drafted: int, accepted: int) -> None:
        counts = self._counts(source)
        counts[0] = 0.95 * counts[0] + accepted
        counts[1] = 0.95 * counts[1] + (1 if accepted < drafted else 0)


@dataclass
class Speculation:
    """How to decode: `mode` (auto, lookup, draft, off), at most `max_draft` tokens a pass, the draft model
    if any; one cost model shared by the answers of a session (a chat learns across turns)."""

    mode: str = "off"
    max_draft: int = 16
    draft_model: DraftModel | None = None
    cost: CostModel = field(default_factory=CostModel)


class DraftModel:
    """A smaller model with the same vocabulary, drafting greedily in its own context."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._chain: Any = None

    def check_vocabulary(self, target: Engine) -> str | None:
        """Why this model cannot draft for `target` (None: it can): the same tokens must mean the same text."""
        mine, theirs = self.engine.vocab, target.vocab
        if mine.n_tokens != theirs.n_tokens:
            return f"its vocabulary has {mine.n_tokens} tokens, the model's {theirs.n_tokens}"
        step = max(1, mine.n_tokens // 4096)
        for token in range(0, mine.n_tokens, step):
            if mine.piece(token) != theirs.piece(token):
                return f"token {token} is {mine.piece(token)!r} in it and {theirs.piece(token)!r} in the model"
        return None

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """k tokens the draft model would write after `tokens` (greedy), its cache kept in step with them."""
        import llama_cpp

        engine = self.engine
        if len(tokens) + k >= engine.n_ctx:
            return []
        if self._chain is None:
            self._chain = llama_cpp.llama_sampler_init_greedy()
        engine.prefill(tokens, engine.kv.keep_prefix(tokens))
        drafted: list[int] = []
        while True:
            token = int(llama_cpp.llama_sampler_sample(self._chain, engine.llama_context, -1))
            if engine.vocab.is_end_of_generation(token):
                return drafted
            drafted.append(token)
            if len(drafted) == k:
                return drafted
            engine.evaluate([token])

    def close(self) -> None:
        import llama_cpp

        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        self.engine.close()


class Decoder:
    """The tokens of one answer after the prompt: the first from the prefill's logits, then one a pass, or
    several when a verified draft is right. Closing it early (the answer ended inside a draft) drops the
    unused part of the draft from the KV cache."""

    def __init__(self, engine: Engine, sampler: Sampler, prompt: Sequence[int], speculation: Speculation,
                 limit: int):
        self.engine, self.sampler, self.speculation = engine, sampler, speculation
        self.limit = limit  # the answer cannot reach past this position (context, or prompt + -n)
        self.mode = speculation.mode if speculation.mode != "draft" or speculation.draft_model else "lookup"
        if self.mode == "auto" and speculation.draft_model is not None:
            self.mode = "auto-draft"
        self.lookup = LookupDrafter(prompt) if self.mode in ("auto", "lookup") else None
        # Prompt and answer so far, for the draft model (a lookup keeps its own copy).
        self.history = list(prompt) if speculation.draft_model is not None else None
        self.drafted = self.accepted = self.passes = 0
        self._since_draft = 0

    def tokens(self) -> Generator[int, None, None]:
        engine, sampler, cost = self.engine, self.sampler, self.speculation.cost
        token = sampler.sample(-1)
        yield token
        if self.mode == "off":  # plain decoding: the per-token loop does nothing else
            while True:
                engine.evaluate([token])
                self.passes += 1
                token = sampler.sample(-1)
                yield token
        while True:
            draft, source = self._draft(token)
            started = time.perf_counter()
            if not draft:
                engine.evaluate([token])
                cost.observe_pass(1, time.perf_counter() - started)
                self.passes += 1
                self._appended(token)
                token = sampler.sample(-1)
                yield token
                continue
            base = engine.kv.n_cached
            batch = [token, *draft]
            engine.evaluate(batch, all_logits=True)
            cost.observe_pass(len(batch), time.perf_counter() - started)
            self.passes += 1
            self.drafted += len(draft)
            accepted = len(draft)
            for i in range(len(batch)):
                self._appended(batch[i])
                sampled = sampler.sample(i)
                try:
                    yield sampled
                except GeneratorExit:  # the answer ended here: what follows batch[i] leaves the cache
                    engine.kv.remove(0, base + i + 1, -1)
                    self.accepted += i
                    raise
                if i < len(draft) and sampled == draft[i]:
                    continue
                engine.kv.remove(0, base + i + 1, -1)  # rejected: draft[i:] leaves the cache
                accepted = i
                break
            self.accepted += accepted
            cost.observe_acceptance(source, len(draft), accepted)
            token = sampled

    def _appended(self, token: int) -> None:
        if self.lookup is not None:
            self.lookup.append(token)
        if self.history is not None:
            self.history.append(token)

    def _draft(self, token: int) -> tuple[list[int], int]:
        """The draft to verify with `token` (pending) and its source, or ([], 0) for a plain pass."""
        speculation, cost = self.speculation, self.speculation.cost
        available = min(speculation.max_draft, self.limit - self.engine.kv.n_cached - 2)
        if available < 1 or cost.one_pass_s is None:  # the first pass is plain: it measures a 1-token pass
            return [], 0
        forced = self.mode in ("lookup", "draft")
        self._since_draft += 1
        if self.lookup is not None:
            self.lookup.append(token)
            try:
                candidate, source = self.lookup.draft(available)
            finally:
                self.lookup.tokens.pop()
            if not candidate:
                return [], 0
            if not cost.calibrated:
                if not forced and source < CALIBRATE_FROM:
                    return [], 0  # a short match in an answer that copies nothing: not worth timing passes for
                cost.calibrate(self.engine, token, available)
            k = self._choose(len(candidate), source, forced)
            return candidate[:k], source
        model = speculation.draft_model
        if not cost.calibrated:
            cost.calibrate(self.engine, token, available)
        k = self._choose(available, 0, forced)
        if model is None or self.history is None or k == 0:
            return [], 0
        started = time.perf_counter()
        draft = model.draft([*self.history, token], k)
        cost.observe_draft_cost(len(draft), time.perf_counter() - started)
        return draft, 0

    def _choose(self, available: int, source: int, forced: bool) -> int:
        """How many tokens to draft: the cost model's best; auto drafts only when that pays, and now and then
        a few tokens anyway, to notice when it would pay again."""
        k, gain = self.speculation.cost.best_k(available, source)
        if forced:
            return max(k, 1)
        if gain >= MIN_GAIN:
            self._since_draft = 0
            return k
        if self._since_draft >= PROBE_EVERY:
            self._since_draft = 0
            return min(PROBE_K, available)
        return 0


def expected_gain(acceptance: float, pass_cost: float, k: int) -> float:
    """The speed-up of k-token drafts at this acceptance, when a (k + 1)-token pass costs `pass_cost` 1-token passes."""
    a = min(acceptance, 0.999)
    return (1 - a ** (k + 1)) / (1 - a) / pass_cost if k else 1.0

