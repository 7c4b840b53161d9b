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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmcli.llama.kv_cache import KVCache
from llmcli.llama.vocab import Vocabulary


class Engine(Protocol):
    """What a draft model needs of an `llmcli.llama.engine.Engine`."""

    kv: KVCache
    vocab: Vocabulary
    n_ctx: int

    def evaluate(self, tokens: Sequence[int], all_logits: bool = False) -> None: ...

    def prefill(self, prompt: Sequence[int], start: int = 0) -> bool: ...

    def greedy_token(self) -> int: ...

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
        draft = tokens[best : min(best + k, end)]
        if draft and min(draft) < 0:  # an image's placeholders are not tokens to draft
            draft = draft[: next(i for i, token in enumerate(draft) if token < 0)]
        return draft, next(size for size in NGRAM_SIZES if matched >= size) if draft else 0


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
        """The same for a step of several sequences (`--batch`, serve): n_tokens in the pass giving n_out tokens,
        and k more drafted for one sequence (a draft model's own time included)."""
        drafting = self.draft_s * k if source == 0 else 0.0
        with_draft = (n_out + self.extra_tokens(k, source)) / (self.seconds(n_tokens + k) + drafting)
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
    """What drafting needs beyond an answer's options (its `speculate` mode and `max_draft`): the draft model if
    any, and one cost model shared by every answer of a scheduler (a chat learns across turns)."""

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
        engine = self.engine
        if len(tokens) + k >= engine.n_ctx:
            return []
        engine.prefill(tokens, engine.kv.keep_prefix(tokens))
        drafted: list[int] = []
        while True:
            token = engine.greedy_token()
            if engine.vocab.is_end_of_generation(token):
                return drafted
            drafted.append(token)
            if len(drafted) == k:
                return drafted
            engine.evaluate([token])

    def close(self) -> None:
        self.engine.close()


class Drafter:
    """One answer's drafting: where its drafts come from (prompt lookup over the prompt and the answer so far,
    or the draft model over the same tokens), its mode, and what its drafts have saved or lost so far."""

    def __init__(self, mode: str, prompt: Sequence[int], model: DraftModel | None):
        self.forced = mode in ("lookup", "draft")  # auto drafts only when it pays
        self.model = model if mode in ("auto", "draft") else None
        self.lookup = LookupDrafter(prompt) if self.model is None else None
        self.history = list(prompt) if self.model is not None else None
        self.since_draft = 0  # steps since this answer last drafted
        self.spent_s = 0.0  # its share of the decode steps so far
        self.saved_s: dict[int, float] = {}  # source -> what its drafts saved (lost, when negative) against plain steps
        self.probing = False

    @staticmethod
    def for_mode(mode: str, prompt: Sequence[int], model: DraftModel | None) -> Drafter | None:
        """The drafter of an answer decoded with `mode` (None: off)."""
        if mode not in MODES or mode == "off":
            return None
        if model is not None and min(prompt, default=0) < 0:  # a draft model does not see the prompt's images
            mode = "lookup" if mode == "draft" else "auto"
            model = None
        return Drafter(mode, prompt, model)

    def appended(self, token: int) -> None:
        if self.lookup is not None:
            self.lookup.append(token)
        elif self.history is not None:
            self.history.append(token)

    def account(self, source: int, share_s: float, plain_s: float, tokens: int, drafted: bool, all_right: bool) -> None:
        """A step's outcome for this answer: its share of the step's time, and what `tokens` would have cost in
        plain steps; a probe that was right all the way lets auto draft again."""
        self.spent_s += share_s
        if not drafted:
            return
        saved = self.saved_s.get(source, 0.0) + tokens * plain_s - share_s
        self.saved_s[source] = max(saved, 0.0) if self.probing and all_right else saved
        self.probing = False


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that could draft this step: its drafter and the room its draft has."""

    seq: int
    drafter: Drafter
    room: int


def choose_drafts(candidates: Sequence[Candidate], n_decoding: int, capacity: int,
                  speculation: Speculation) -> dict[int, tuple[list[int], int]]:
    """The drafts of one step (sequence -> draft, source), strongest matches first, each as long as the cost model
    expects the step to give more tokens a second with it; `lookup` and `draft` always draft. Auto starts a source
    slowly (its first drafts are 1, 2, 4, ... tokens), stops a source whose drafts have lost LOSS_BUDGET of the
    answer's time, and probes with one token now and then after a long match. One sequence decoding alone is the
    case n_decoding = 1; the step never holds more than `capacity` tokens."""
    cost = speculation.cost
    found = []
    for candidate in candidates:
        drafter = candidate.drafter
        drafter.since_draft += 1
        if drafter.lookup is not None:
            tokens, source = drafter.lookup.draft(candidate.room)
            if tokens:
                found.append((source, candidate, tokens))
        elif drafter.model is not None:
            found.append((0, candidate, []))
    if not found or (n_decoding not in cost.pass_s and not any(c.drafter.forced for _, c, _ in found)):
        return {}  # a plain step of this size first: it is timed
    drafts: dict[int, tuple[list[int], int]] = {}
    n_tokens, n_out = n_decoding, float(n_decoding)
    for source, candidate, tokens in sorted(found, key=lambda f: -f[0]):
        drafter = candidate.drafter
        available = min(len(tokens) if tokens else candidate.room, capacity - n_tokens)
        if available < 1:
            continue
        if drafter.forced:
            k = max(cost.best_step_k(n_tokens, n_out, available, source)[0], 1)
        else:
            k, gain = cost.best_step_k(n_tokens, n_out, min(available, 2 ** cost.verified.get(source, 0)), source)
            if not (gain >= MIN_GAIN and drafter.saved_s.get(source, 0.0) >= -LOSS_BUDGET * drafter.spent_s):
                if drafter.since_draft < PROBE_EVERY or not (source >= PROBE_FROM or source == 0):
                    continue
                k, drafter.probing = min(PROBE_K, available), True
        drafter.since_draft = 0
        if drafter.model is not None and drafter.history is not None:
            started = time.perf_counter()
            tokens = drafter.model.draft(drafter.history, k)
            cost.observe_draft_cost(len(tokens), time.perf_counter() - started)
        draft = tokens[:k]
        if draft:
            drafts[candidate.seq] = (draft, source)
            n_tokens += len(draft)
            n_out += cost.extra_tokens(len(draft), source)
    return drafts
