"""`llmcli eval tools`: a model asked each BFCL-format item through the path `run --functions` and `serve` take (the
`Answerer`, a ToolSpec in its GenerationOptions: the same prompt, grammar and parser), its first round judged by
llmcli/eval/bfcl.py's rules; per category: accuracy, valid calls, no-call answers, seconds an item."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.answerer import Answerer
from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.message import Message
from llmcli.answer.tool_calls import ToolSpec, tool_spec
from llmcli.errors import LlmcliError
from llmcli.eval.bfcl import Call, Item, Verdict, judge
from llmcli.interrupt import Cancellation

CHOICES = ("auto", "required", "one", "none")  # one: the function by name when an item offers one, else required


@dataclass
class ItemResult:
    id: str
    category: str
    correct: bool
    reason: str
    calls: list[dict[str, Any]]
    valid: bool  # every call parsed and matched its function's schema
    text: str  # what the model wrote besides its calls
    seconds: float


@dataclass
class CategoryScore:
    category: str
    items: int = 0
    correct: int = 0
    valid: int = 0  # items whose calls were all valid (of those with calls)
    with_calls: int = 0
    no_call: int = 0
    seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        return {"category": self.category, "items": self.items, "correct": self.correct,
                "accuracy": round(self.correct / self.items, 4) if self.items else 0.0,
                "valid_call_rate": round(self.valid / self.with_calls, 4) if self.with_calls else None,
                "no_call_rate": round(self.no_call / self.items, 4) if self.items else 0.0,
                "seconds_per_item": round(self.seconds / self.items, 3) if self.items else 0.0}


@dataclass
class Report:
    results: list[ItemResult] = field(default_factory=list)
    interrupted: bool = False

    def scores(self) -> list[CategoryScore]:
        found: dict[str, CategoryScore] = {}
        for result in self.results:
            score = found.setdefault(result.category, CategoryScore(result.category))
            score.items += 1
            score.correct += result.correct
            score.seconds += result.seconds
            if result.calls:
                score.with_calls += 1
                score.valid += result.valid
            else:
                score.no_call += 1
        return list(found.values())


def evaluate(answerer: Answerer, generation: GenerationOptions, items: Iterable[Item], choice: str, format_name: str,
             cancel: Cancellation, on_item: Callable[[ItemResult], None] | None = None) -> Report:
    """Every item, one at a time (a fresh conversation each); Ctrl-C ends it with what was measured."""
    report = Report()
    for item in items:
        if cancel:
            report.interrupted = True
            break
        result = ask(answerer, generation, item, choice, format_name)
        if result is None:  # interrupted inside the answer
            report.interrupted = True
            break
        report.results.append(result)
        if on_item is not None:
            on_item(result)
    return report


def offer(answerer: Answerer, item: Item, choice: str, format_name: str) -> ToolSpec:
    """The item's tools as `choice` offers them, and its conversation before the question in the answerer's history;
    LlmcliError for a function llmcli cannot offer (its schema)."""
    tools = item.tools()
    forced: Any = choice
    if choice == "one":
        forced = {"type": "function", "function": {"name": tools[0]["function"]["name"]}} if len(tools) == 1 else "required"
    spec = dataclasses.replace(tool_spec(tools, forced, format_name), parallel=True)
    answerer.history.clear()
    answerer.history.extend(Message(m["role"], m["content"]) for m in item.messages[:-1])
    return spec


def ask(answerer: Answerer, generation: GenerationOptions, item: Item, choice: str, format_name: str) -> ItemResult | None:
    """One item: its conversation, its tools offered as `choice` says; None when Ctrl-C cut the answer."""
    started = time.perf_counter()
    try:
        spec = offer(answerer, item, choice, format_name)
    except LlmcliError as exc:  # the item is counted wrong, and why
        return ItemResult(item.id, item.category, False, f"not offered: {exc.message}", [], False, "",
                          time.perf_counter() - started)
    done = None
    for event in answerer.ask(item.messages[-1]["content"], dataclasses.replace(generation, tools=spec)):
        if isinstance(event, Done):
            done = event
    if done is None or done.finish_reason == "interrupted":
        return None
    calls = [Call(call.name, call.arguments_value() if call.error is None or call.arguments else None)
             for call in done.tool_calls]
    verdict: Verdict = judge(item, calls)
    return ItemResult(item.id, item.category, verdict.correct, verdict.reason,
                      [{"name": c.name, "arguments": c.arguments} for c in calls],
                      all(call.error is None for call in done.tool_calls), done.text, time.perf_counter() - started)
