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
and how many tokens, from the measured seconds of a pass of each size on this machine and the measured
acceptance per draft source; `auto` (the default) drafts only when the expected gain is positive, starts
each source with short drafts, stops a source whose drafts have lost LOSS_BUDGET of the answer's time,
and probes again now and then after a long match.
"""

from __future__ import annotations

import math
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
NGRAM_SIZES = (12, 8, 5, 3, 2)  # how long a match is counted as (longest first): a long one is seldom the wrong place
MATCHES_COMPARED = 32  # a lookup compares the suffix with at most this many of the latest occurrences of its last pair
PROBE_EVERY = 64  # auto, not drafting: one small draft this often (tokens), to notice when it would pay again
PROBE_K = 1
PROBE_FROM = 8  # probes draft only after a match of at least this many tokens (or from a draft model)
MIN_GAIN = 1.02  # auto drafts only when the expected speed-up is at least this
LOSS_BUDGET = 0.01  # auto stops drafting (probes aside) once drafts have lost this share of the answer's decode time


class LookupDrafter:
    """Drafts from the tokens so far: what followed the earlier occurrence of their longest suffix (up to 12
    tokens; among equally long ones the latest). Each token indexes one pair of tokens; a lookup compares
    backwards from the latest occurrences of the last pair, so the work per token stays a few microseconds."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self._after: dict[tuple[int, int], list[int]] = {}  # a pair of tokens -> the positions right after it
        self._indexed = 2  # pairs that end before this position are indexed

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def draft(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens, and the n-gram size the match counts as (0: none found)."""
        tokens, after = self.tokens, self._after
        end = len(tokens)
        for stop in range(self._indexed, end):  # every pair followed by a token
            after.setdefault((tokens[stop - 2], tokens[stop - 1]), []).append(stop)
        self._indexed = max(self._indexed, end)
        if end < 2 or not (found := after.get((tokens[end - 2], tokens[end - 1]))):
            return [], 0
        longest = NGRAM_SIZES[0]
        best, matched = 0, 0
        for stop in reversed(found[-MATCHES_COMPARED:]):
            n = 2
            while n < longest and stop - 1 - n >= 0 and tokens[stop - 1 - n] == tokens[end - 1 - n]:
                n += 1
            if n > matched:
                best, matched = stop, n
                if n == longest:
                    break
        return tokens[best : min(best + k, end)], next(size for size in NGRAM_SIZES if matched >= size)


# What a draft from each source is worth before anything is measured: the chance that a drafted token is
# right (given the ones before it were). A long n-gram match is seldom in the wrong place; a draft model's
# guess is as good as its model.
PRIOR_ACCEPTANCE = {12: 0.9, 8: 0.85, 5: 0.65, 3: 0.45, 2: 0.35, 0: 0.7}  # n-gram size (0: a draft model)
PRIOR_WEIGHT = 4.0


@dataclass
class CostModel:
    """What a pass costs here and how often drafts are right: the expected speed-up of drafting k tokens.

    A pass of n tokens (logits for each) takes `seconds(n)`: measured for each n that was used (moving
    averages), interpolated between measured sizes, else the `prior_cost` curve scaled to the nearest
    measured size below.
    A draft model adds `draft_s` per drafted token. Acceptance is kept per source (the n-gram size of a
    lookup, 0 for a draft model), as counts that fade so that it follows the answer. One sequence decoding
    alone is the case n = 1; `--batch` steps of several sequences ask what a draft adds to a step of n."""

    first_extra: float = 0.7  # the prior: a pass of n costs 1 + first_extra * (n - 1) ** 0.85 1-token passes
    pass_s: dict[int, float] = field(default_factory=dict)  # tokens in a pass -> its seconds, measured here
    draft_s: float = 0.0  # seconds a draft model takes per drafted token
    counts: dict[int, list[float]] = field(default_factory=dict)  # source -> [hits, misses]
    verified: dict[int, int] = field(default_factory=dict)  # source -> drafts verified (auto's slow start)

    @property
    def one_pass_s(self) -> float | None:
        """Seconds of a 1-token pass, once measured."""
        return self.pass_s.get(1)

    def acceptance(self, source: int) -> float:
        hits, misses = self._counts(source)
        return hits / (hits + misses)

    def _counts(self, source: int) -> list[float]:
        if source not in self.counts:
            prior = PRIOR_ACCEPTANCE.get(source, 0.5)
            self.counts[source] = [prior * PRIOR_WEIGHT, (1 - prior) * PRIOR_WEIGHT]
        return self.counts[source]

    def extra_tokens(self, k: int, source: int) -> float:
        """Tokens a k-token draft is expected to add to its pass: a + a^2 + ... + a^k (a drafted token counts
        only when the ones before it were right)."""
        a = min(self.acceptance(source), 0.999)
        return (a - a ** (k + 1)) / (1 - a)

    def gain(self, k: int, source: int) -> float:
        """Expected tokens per second drafting k tokens, over plain decoding's (1.0: as plain decoding)."""
        one = self.seconds(1)
        return (1 + self.extra_tokens(k, source)) * one / (self.seconds(k + 1) + self.draft_s * k)

    def step_gain(self, n_tokens: int, n_out: float, k: int, source: int) -> float:
        """The same for a pass of several sequences (`--batch`): n_tokens in the pass giving n_out tokens, and
        k more drafted for one sequence."""
        with_draft = (n_out + self.extra_tokens(k, source)) / self.seconds(n_tokens + k)
        return with_draft / (n_out / self.seconds(n_tokens))

    def prior_cost(self, n_tokens: int) -> float:
        """A pass of n tokens in 1-token passes before anything is measured. Measured at 2 threads (bench
        --speculate): SmolLM2 1.7 / 2.6 / 4.4 / 8.0 for 2 / 4 / 8 / 16 tokens, Gemma-3-270M 1.7 / 2.4 / 3.6 / 6.2
        (this curve: 1.7 / 2.8 / 4.7 / 8.0): the first extra token costs most."""
        return 1.0 + self.first_extra * math.pow(n_tokens - 1, 0.85)

    def seconds(self, n_tokens: int) -> float:
        """A pass of n_tokens: measured for this size, else interpolated between the measured sizes around it,
        else the prior curve through the largest measured size below (units of a 1-token pass when nothing is
        measured yet)."""
        if n_tokens in self.pass_s:
            return self.pass_s[n_tokens]
        below = [p for p in sorted(self.pass_s.items()) if p[0] < n_tokens]
        above = [p for p in sorted(self.pass_s.items()) if p[0] > n_tokens]
        if below and above:
            (low, t_low), (high, t_high) = below[-1], above[0]
            return t_low + (t_high - t_low) / (high - low) * (n_tokens - low)
        if not below:  # nothing measured, or only larger passes
            size, seconds = above[0] if above else (1, 1.0)
            return float(seconds * self.prior_cost(n_tokens) / self.prior_cost(size))
        # Beyond the largest measured pass: the prior curve, scaled by the measured pass that came out cheapest
        # against it (some sizes cost more than their neighbours; the larger passes get tried, then measured).
        scale = min(t / self.prior_cost(n) for n, t in below if n > 1) if len(below) > 1 else below[-1][1]
        return float(scale * self.prior_cost(n_tokens))

    def pass_cost(self, n_tokens: int) -> float:
        """A pass of n_tokens, in 1-token passes."""
        return self.seconds(n_tokens) / self.seconds(1)

    def best_k(self, available: int, source: int) -> tuple[int, float]:
        best, gain = 0, 1.0
        for k in range(1, available + 1):
            g = self.gain(k, source)
            if g > gain:
                best, gain = k, g
        return best, gain

    def best_step_k(self, n_tokens: int, n_out: float, available: int, source: int) -> tuple[int, float]:
        best, gain = 0, 1.0
        for k in range(1, available + 1):
            g = self.step_gain(n_tokens, n_out, k, source)
            if g > gain:
                best, gain = k, g
        return best, gain

    def observe_pass(self, n_tokens: int, seconds: float) -> None:
        known = self.pass_s.get(n_tokens)
        weight = 0.1 if n_tokens == 1 else 0.3  # 1-token passes come often: a slower average
        self.pass_s[n_tokens] = seconds if known is None else (1 - weight) * known + weight * seconds

    def observe_draft_cost(self, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            self.draft_s = 0.7 * self.draft_s + 0.3 * seconds / n_tokens

    def observe_acceptance(self, source: int, drafted: int, accepted: int) -> None:
        self.verified[source] = self.verified.get(source, 0) + 1
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
        # Prompt and answer so far, the pending token included: what a draft continues.
        self.lookup = LookupDrafter(prompt) if self.mode in ("auto", "lookup") else None
        self.history = list(prompt) if speculation.draft_model is not None else None
        self.drafted = self.accepted = self.passes = 0
        self._since_draft = 0
        self._plain = 0  # plain passes so far
        self._spent_s = 0.0  # in draft passes so far
        # What each source's drafts saved (lost, when negative) against 1-token passes for the same tokens.
        self._saved_s: dict[int, float] = {}
        self._probing = False

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
        self._appended(token)
        while True:
            draft, source = self._draft()
            started = time.perf_counter()
            if not draft:
                engine.evaluate([token])
                if not self.passes & 7:  # one plain pass in 8 keeps the 1-token time current
                    cost.observe_pass(1, time.perf_counter() - started)
                self._plain += 1
                self.passes += 1
                token = sampler.sample(-1)
                self._appended(token)
                yield token
                continue
            base = engine.kv.n_cached
            batch = [token, *draft]
            engine.evaluate(batch, all_logits=True)
            elapsed = time.perf_counter() - started
            cost.observe_pass(len(batch), elapsed)
            self.passes += 1
            self.drafted += len(draft)
            accepted = len(draft)
            for i in range(len(batch)):
                sampled = sampler.sample(i)
                self._appended(sampled)
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
            self._account(source, elapsed, accepted + 1, accepted == len(draft))
            token = sampled

    def _account(self, source: int, elapsed: float, tokens: int, all_right: bool) -> None:
        """What a draft pass saved or lost against plain decoding of the same tokens; a probe that was right all
        the way lets auto draft again."""
        one = self.speculation.cost.one_pass_s or elapsed
        self._spent_s += elapsed
        saved = self._saved_s.get(source, 0.0) + tokens * one - elapsed
        self._saved_s[source] = max(saved, 0.0) if self._probing and all_right else saved
        self._probing = False

    def _appended(self, token: int) -> None:
        if self.lookup is not None:
            self.lookup.append(token)
        if self.history is not None:
            self.history.append(token)

    def _draft(self) -> tuple[list[int], int]:
        """The draft to verify with the pending token and its source, or ([], 0) for a plain pass."""
        speculation, cost = self.speculation, self.speculation.cost
        available = min(speculation.max_draft, self.limit - self.engine.kv.n_cached - 2)
        if available < 1 or cost.one_pass_s is None:  # the first pass is plain: it measures a 1-token pass
            return [], 0
        self._since_draft += 1
        if self.lookup is not None:
            candidate, source = self.lookup.draft(available)
            k = self._choose(len(candidate), source) if candidate else 0
            return candidate[:k], source
        model = speculation.draft_model
        k = self._choose(available, 0)
        if model is None or self.history is None or k == 0:
            return [], 0
        started = time.perf_counter()
        draft = model.draft(self.history, k)
        cost.observe_draft_cost(len(draft), time.perf_counter() - started)
        return draft, 0

    def _choose(self, available: int, source: int) -> int:
        """How many tokens to draft: the cost model's best. Auto drafts only when that pays and the drafts of this
        source (an n-gram size, or the draft model) have not lost more than LOSS_BUDGET of the answer's time so
        far; now and then one token anyway after a long match (a probe), to notice when it would pay again."""
        cost = self.speculation.cost
        if self.mode in ("lookup", "draft"):
            return max(cost.best_k(available, source)[0], 1)
        # A slow start: a source's first drafts are short (1, 2, 4, ... tokens), so a wrong prior costs little.
        k, gain = cost.best_k(min(available, 2 ** cost.verified.get(source, 0)), source)
        spent = self._spent_s + self._plain * (cost.one_pass_s or 0.0)
        if gain >= MIN_GAIN and self._saved_s.get(source, 0.0) >= -LOSS_BUDGET * spent:
            self._since_draft = 0
            return k
        if self._since_draft >= PROBE_EVERY and (source >= PROBE_FROM or source == 0):
            self._since_draft = 0
            self._probing = True
            return min(PROBE_K, available)
        return 0
