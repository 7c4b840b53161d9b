"""`eval tools --calibrate`: the two numbers of `--tool-choice auto`, chosen for one model on items it answers.

Under `auto`, an answer's first token gets `preference = --call-preference + --call-gain × relevance(question)` more
logit for a call's opening (llmcli/answer/generation.py). Greedy, the model opens a call exactly when that preference
passes a threshold of its own for the item — its logit gap between its best first token and the opening — so each item
of the choosing slice is measured once: its threshold (found by bisection, asking through the answering path with the
preference given outright and short answers: the prompt stays cached, each probe costs a few tokens), and for an item
a tool fits, whether a forced call (`required`) answers it. Every (base, gain) of a grid is then scored without asking
again: an item that calls is right when its forced call is; one no tool fits is right when it does not call. The pair
kept is the most accurate on the items a tool fits among those that leave ≥ NO_CALL_GOAL of the others uncalled — if
it gets MIN_GAIN more items right than the numbers in use (else those stay: one item is a small slice's noise).

The report slice (items the choice never saw: half of each category, dealt by a stable hash of the ids) is then asked for real —
forced, `auto` with the defaults, `auto` calibrated — so the table shows what the choice does, not what it predicted."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmcli.answer.answerer import Answerer
from llmcli.answer.events import Done, Token
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.tool_call_parser import CallStarted
from llmcli.answer.tool_calls import relevance
from llmcli.errors import LlmcliError
from llmcli.eval.bfcl import Item
from llmcli.eval.tool_eval import ItemResult, Report, ask, evaluate, offer
from llmcli.interrupt import Cancellation

NO_CALL_GOAL = 0.8  # of the items no tool fits, the share `auto` must leave uncalled
MAX_PREFERENCE = 20.0  # the most a probe leads toward a call (the grid's base + gain at most)
BISECTIONS = 6  # a threshold known within MAX_PREFERENCE / 2**6 (0.31: the grid's steps are 0.5 and more)
PROBE_TOKENS = 16  # an answer's first text or call shows within it (the probe stops there)
BASES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)  # 0: off (the model's own choice)
GAINS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
ROOM_CAP = 3.0  # an item's room counts up to this much lead (past it, the decision is settled)
MIN_GAIN = 2  # items of the choosing slice a pair must get right beyond the current numbers to replace them (one item
# is the noise of a small slice: gemma3-270m's pair, chosen on 3 answers, did worse on the unseen half than the defaults)


@dataclass(frozen=True)
class Probe:
    """One item of the choosing slice: how much lead it takes to call (-inf: it calls unled; inf: not even at
    MAX_PREFERENCE), how much of its question is about the tools, and whether its forced call is right."""

    item: str
    irrelevant: bool
    relevance: float
    threshold: float
    forced_correct: bool


@dataclass(frozen=True)
class Choice:
    base: float
    gain: float
    accuracy: float  # of the items a tool fits (predicted on the choosing slice)
    no_call: float  # of the items no tool fits
    room: float = 0.0  # how far, on average, each item's lead is from its threshold on the right side (capped)
    right: int = 0  # items of the choosing slice it gets right (predicted)
    kept: bool = False  # the current numbers, kept: no pair of the grid gets MIN_GAIN more items right


def halves(items: Sequence[Item]) -> tuple[list[Item], list[Item]]:
    """The choosing slice and the report slice: each category's items ordered by a stable hash of their id, then
    dealt alternately (each slice holds half of every category, whatever the order of the file)."""
    chosen: list[Item] = []
    reported: list[Item] = []
    for category in dict.fromkeys(item.category for item in items):
        ordered = sorted((i for i in items if i.category == category), key=lambda i: hashlib.sha256(i.id.encode()).digest())
        chosen += ordered[::2]
        reported += ordered[1::2]
    return chosen, reported


def probe(answerer: Answerer, generation: GenerationOptions, item: Item, format_name: str) -> Probe | None:
    """Measure one item (None: Ctrl-C)."""
    try:
        spec = offer(answerer, item, "auto", format_name)
    except LlmcliError:  # (a function llmcli cannot offer: never called, whatever the lead)
        spec = None

    def calls(preference: float) -> bool | None:
        """Whether the answer opens a call at this lead: its first event says (a call begun, or text); the answer is
        left there."""
        if spec is None:
            return False
        offer(answerer, item, "auto", format_name)
        led = dataclasses.replace(generation, call_preference=preference, call_gain=0.0, max_tokens=PROBE_TOKENS,
                                  tools=spec)
        answer = answerer.ask(item.messages[-1]["content"], led)
        try:
            for event in answer:
                if isinstance(event, CallStarted):
                    return True
                if isinstance(event, Token) and event.text.strip() and not event.reasoning:
                    return False
                if isinstance(event, Done):
                    return None if event.finish_reason == "interrupted" else bool(event.tool_calls)
        finally:
            close = getattr(answer, "close", None)
            if close is not None:
                close()
        return None

    low, high = 0.0, MAX_PREFERENCE
    unled, most = calls(0.0), calls(MAX_PREFERENCE)
    if unled is None or most is None:
        return None
    threshold = -math.inf if unled else math.inf if not most else 0.0
    if math.isfinite(threshold):
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            found = calls(middle)
            if found is None:
                return None
            low, high = (low, middle) if found else (middle, high)
        threshold = (low + high) / 2
    forced_correct = False
    if not item.irrelevant and spec is not None:
        forced = ask(answerer, generation, item, "required", format_name)
        if forced is None:
            return None
        forced_correct = forced.correct
    offered = spec.offered if spec is not None else ()
    return Probe(item.id, item.irrelevant, relevance(item.messages[-1]["content"], offered), threshold, forced_correct)


def predicted(probes: Sequence[Probe], base: float, gain: float) -> Choice:
    """What `auto` with this base and gain would do on the measured items."""
    fits = [p for p in probes if not p.irrelevant]
    others = [p for p in probes if p.irrelevant]

    def lead(p: Probe) -> float:
        return base + gain * p.relevance if base > 0 else 0.0

    def calls(p: Probe) -> bool:
        return p.threshold == -math.inf or (base > 0 and lead(p) > p.threshold)

    def room(p: Probe) -> float:  # (positive: on the side of a call where a tool fits, of none elsewhere)
        wanted = -1.0 if p.irrelevant else 1.0
        gap = lead(p) - p.threshold if math.isfinite(p.threshold) else (-1.0 if p.threshold > 0 else 1.0) * ROOM_CAP
        return max(-ROOM_CAP, min(ROOM_CAP, wanted * gap))

    answered = sum(calls(p) and p.forced_correct for p in fits)
    uncalled = sum(not calls(p) for p in others)
    return Choice(base, gain, answered / len(fits) if fits else 0.0, uncalled / len(others) if others else 1.0,
                  sum(room(p) for p in probes) / len(probes) if probes else 0.0, answered + uncalled)


def choose(probes: Sequence[Probe], current: tuple[float, float] | None = None, min_gain: int = MIN_GAIN) -> Choice:
    """The grid's pair: most accurate among those reaching NO_CALL_GOAL (else among those that leave most uncalled),
    then the one that leaves more uncalled, then the one with most room (a pair whose leads sit far from the
    thresholds on the right side holds on items it has not seen; the smallest lead that barely works does not).
    `current` (the numbers in use) stays unless that pair gets `min_gain` more items right, or reaches the no-call goal
    where the current numbers do not."""
    scored = [predicted(probes, base, gain) for base in BASES for gain in (GAINS if base else (0.0,))]
    reaching = [c for c in scored if c.no_call >= NO_CALL_GOAL] or [
        c for c in scored if c.no_call == max(s.no_call for s in scored)]
    best = max(reaching, key=lambda c: (c.accuracy, c.no_call, c.room))
    if current is None:
        return best
    now = predicted(probes, *current)
    if best.no_call >= NO_CALL_GOAL > now.no_call or best.right - now.right >= min_gain:
        return best
    return dataclasses.replace(now, kept=True)


@dataclass
class Calibration:
    probes: list[Probe]
    choice: Choice | None  # None: interrupted before every item was measured
    reported: dict[str, Report]  # "forced", "auto (default)", "auto (calibrated)": the report slice asked for real
    interrupted: bool = False


def calibrate(answerer: Answerer, generation: GenerationOptions, items: Sequence[Item], format_name: str,
              cancel: Cancellation, on_step: Callable[[str, int, int], None] | None = None,
              min_gain: int = MIN_GAIN) -> Calibration:
    """Measure the choosing slice, choose (the numbers of `generation` kept unless a pair gets `min_gain` more items
    right), then ask the report slice three ways; Ctrl-C ends it with what was done."""
    chosen_on, reported_on = halves(items)
    probes: list[Probe] = []
    for index, item in enumerate(chosen_on):
        found = None if cancel else probe(answerer, generation, item, format_name)
        if found is None:
            return Calibration(probes, None, {}, interrupted=True)
        probes.append(found)
        if on_step is not None:
            on_step("choosing", index + 1, len(chosen_on))
    choice = choose(probes, (generation.call_preference, generation.call_gain), min_gain)
    calibrated = dataclasses.replace(generation, call_preference=choice.base, call_gain=choice.gain)
    runs = {"forced": (generation, "required"), "auto (default)": (generation, "auto"),
            **({} if choice.kept else {"auto (calibrated)": (calibrated, "auto")})}  # (kept: the same numbers)
    reported: dict[str, Report] = {}
    asked = {name: [i for i in reported_on if tool_choice == "auto" or not i.irrelevant]  # (forced: where a tool fits)
             for name, (_, tool_choice) in runs.items()}
    done = [0]
    for name, (options, tool_choice) in runs.items():
        def step(result: ItemResult, name: str = name) -> None:
            done[0] += 1
            if on_step is not None:
                on_step(f"reporting: {name}", done[0], sum(len(found) for found in asked.values()))

        report = evaluate(answerer, options, asked[name], tool_choice, format_name, cancel, step)
        reported[name] = report
        if report.interrupted:
            return Calibration(probes, choice, reported, interrupted=True)
    return Calibration(probes, choice, reported)
