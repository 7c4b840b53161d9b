"""Why an answer ended, and each protocol's name for it: one table instead of one per protocol.

llmcli's own reasons are finer than any protocol's (a stop sequence, a full context and a loop caught by the
repetition guard are all told apart); each protocol gets its nearest word, and the stats line and `--json` keep
llmcli's. The `--endpoint` client reads an OpenAI server's word back (`from_openai`). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FinishReason:
    name: str  # llmcli's: the --json record's finish_reason, `timings.finish_reason` on the wire
    described: str  # on the stats line (`stop: …`)
    openai: str  # chat and text completions' finish_reason (abort: cut, vLLM's word)
    ollama: str  # done_reason
    anthropic: str  # stop_reason (pause_turn: cut before its end, a turn to send back and resume)
    responses: str | None  # a Responses answer's incomplete_details.reason (None: the response is completed)


REASONS = {reason.name: reason for reason in (
    FinishReason("stop", "eos", "stop", "stop", "end_turn", None),
    FinishReason("stop_sequence", "stop sequence", "stop", "stop", "stop_sequence", None),
    FinishReason("length", "max tokens", "length", "length", "max_tokens", "max_output_tokens"),
    FinishReason("context_full", "context full", "length", "length", "max_tokens", "max_output_tokens"),
    FinishReason("repetition", "repetition (the answer was going round in a loop)", "stop", "stop", "end_turn", None),
    FinishReason("interrupted", "interrupted", "abort", "abort", "pause_turn", "interrupted"),
    FinishReason("tool_calls", "tool calls", "tool_calls", "stop", "tool_use", None),
)}
FINISH_REASONS = tuple(REASONS)

# What an answer the repetition guard stopped says (run's notice, on every path).
REPETITION_NOTICE = "stopped: the answer was repeating itself (--no-repetition-guard lets it go on)"


def finish_reason(name: str) -> FinishReason:
    """The reason called `name` (an unknown one reads as the model's own end)."""
    return REASONS.get(name, REASONS["stop"])


def described(name: str, stop_sequence: str | None = None) -> str:
    """As the stats line says it."""
    if name == "stop_sequence" and stop_sequence is not None:
        return f"stop sequence {stop_sequence!r}"
    return REASONS[name].described if name in REASONS else name


_FROM_OPENAI = {"stop": "stop", "length": "length", "content_filter": "stop", "tool_calls": "tool_calls",
                "function_call": "tool_calls"}


def from_openai(wire: str) -> str:
    """llmcli's reason for an OpenAI server's `finish_reason` (another server's words included)."""
    return _FROM_OPENAI.get(wire, "stop")
