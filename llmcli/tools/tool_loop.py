"""The tool loop of `run` and `chat`: the model calls, llmcli runs the functions, the results go back as `tool`
messages through the template, and the model goes on — until it answers without a call, or `--chain-limit` rounds
of calls were run. The same loop for a local model and a server (--endpoint): it only asks the Answerer.

A forced `--tool-choice` (required, or a tool's name) applies to the first call; the rounds after it are `auto`,
as the OpenAI Agents SDK resets it (otherwise a forced tool would be called until the limit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from llmcli.answer.answerer import Answerer
from llmcli.answer.events import AnswerEvent, Done, Notice
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.answer.stats import Stats
from llmcli.answer.tool_calls import Tool, ToolCall, ToolChoice, ToolResult, ToolSpec
from llmcli.interrupt import Cancellation

DEFAULT_CHAIN_LIMIT = 5


class ToolSource(Protocol):
    """Where tools come from: --functions, MCP servers."""

    @property
    def tools(self) -> tuple[Tool, ...]: ...

    def run(self, call: ToolCall) -> ToolResult: ...


@dataclass(frozen=True)
class ToolSources:
    """Several sources as one: each call goes to the source that offers its tool."""

    sources: tuple[ToolSource, ...]

    @property
    def tools(self) -> tuple[Tool, ...]:
        return tuple(tool for source in self.sources for tool in source.tools)

    def run(self, call: ToolCall) -> ToolResult:
        for source in self.sources:
            if any(tool.name == call.name for tool in source.tools):
                return source.run(call)
        return ToolResult(call.id, call.name, f"Error: no tool is called {call.name!r}", error=True)


@dataclass
class ToolRunner:
    """What a run or a chat may call, and how calls are run: approved first (`approve`), shown (`on_result`)."""

    functions: ToolSource
    choice: ToolChoice
    format: str
    chain_limit: int = DEFAULT_CHAIN_LIMIT
    approve: Callable[[ToolCall], bool] | None = None  # --tools-approve: False refuses the call
    on_call: Callable[[ToolCall], None] | None = None  # --tools-debug: a call about to run
    on_result: Callable[[ToolCall, ToolResult], None] | None = None  # --tools-debug: what it gave
    on_prompt: Callable[[str], None] | None = None  # --tools-debug: the prompt the results went into
    render_prompt: Callable[[ToolSpec | None], str] | None = None  # how it is rendered (None: a server's own)

    def notices(self) -> list[str]:
        """What the sources have to say once they are up (an MCP server that did not start)."""
        found: list[str] = []
        for source in getattr(self.functions, "sources", (self.functions,)):
            waiting = getattr(source, "wait", None)
            if waiting is not None:
                found += waiting()
        return found

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop what the sources started (MCP servers)."""
        for source in getattr(self.functions, "sources", (self.functions,)):
            closing = getattr(source, "close", None)
            if closing is not None:
                closing()

    def spec(self, first: bool) -> ToolSpec:
        choice = self.choice if first or self.choice.mode == "none" else ToolChoice("auto")
        return ToolSpec(self.functions.tools, choice, self.format)

    def run(self, call: ToolCall, cancel: Cancellation) -> ToolResult:
        with cancel.raising():  # Python code, or a question waiting for its answer: Ctrl-C stops it at once
            if call.error is None and self.approve is not None and not self.approve(call):
                result = ToolResult(call.id, call.name, "Error: the user did not allow this call", error=True)
            else:
                if self.on_call is not None:
                    self.on_call(call)
                result = self.functions.run(call)
        if self.on_result is not None:
            self.on_result(call, result)
        return result


def answer_with_tools(answerer: Answerer, user_text: str, generation: GenerationOptions, runner: ToolRunner,
                      cancel: Cancellation, stable_text: str | None = None,
                      images: tuple[ImageInput, ...] = ()) -> Iterator[AnswerEvent]:
    """The events of every round (text, calls, notices) and one Done at the end: the last round's, carrying every
    call made and every result, with the rounds' stats added up (`Stats.then`). -n bounds the whole answer: each
    round has what the ones before it left."""
    calls: list[ToolCall] = []
    results: list[ToolResult] = []
    stats: Stats | None = None  # every round's, added up: the tokens and time of the whole answer
    text: str | None = user_text
    done: Done | None = None
    for round_number in range(runner.chain_limit + 1):
        left = None if generation.max_tokens is None else generation.max_tokens - (stats.completion_tokens if stats else 0)
        if left is not None and left <= 0 and done is not None:
            yield Notice(f"-n {generation.max_tokens} bounds the whole answer, every round of it: reached before the "
                         "model read the tools' results")
            yield dataclasses.replace(done, finish_reason="length", tool_calls=tuple(calls), tool_results=tuple(results))
            return
        options = dataclasses.replace(generation, tools=runner.spec(first=round_number == 0),
                                      max_tokens=generation.max_tokens if left is None else left)
        done = None
        first = round_number == 0
        for event in answerer.ask(text, options, stable_text if first else None, images if first else ()):
            if isinstance(event, Done):
                done = event
            else:
                yield event
        if done is None:
            return
        stats = done.stats if stats is None else stats.then(done.stats)
        done = dataclasses.replace(done, stats=stats)
        calls += done.tool_calls
        if done.finish_reason != "tool_calls":
            if cut_off(done):
                yield Notice("the tool call was cut off before it ended (by -n or the context): it was not run")
            yield dataclasses.replace(done, tool_calls=tuple(calls), tool_results=tuple(results))
            return
        if round_number == runner.chain_limit:
            yield Notice(f"--chain-limit {runner.chain_limit} reached: the last calls were not run")
            yield dataclasses.replace(done, tool_calls=tuple(calls), tool_results=tuple(results))
            return
        try:
            for call in done.tool_calls:
                result = runner.run(call, cancel)
                results.append(result)
                answerer.history.append(Message("tool", result.content, tool_call_id=call.id, name=call.name))
        except KeyboardInterrupt:
            yield dataclasses.replace(done, finish_reason="interrupted", tool_calls=tuple(calls),
                                      tool_results=tuple(results))
            return
        text = None
        if runner.on_prompt is not None and runner.render_prompt is not None:  # (--endpoint: the server's own)
            runner.on_prompt(runner.render_prompt(runner.spec(first=False)))


def cut_off(done: Done) -> bool:
    """Whether the answer ended (-n, the context) in the middle of a tool call: a call that must not run."""
    return done.finish_reason in ("length", "context_full") and any(call.error for call in done.tool_calls)
