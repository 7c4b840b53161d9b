"""What answering yields — `Token`s as the answer grows, one `Done` that carries the whole answer — and the one
record of a finished answer (run --json, chat, --batch, the log).

Local and remote answers yield the same events; renderers and tests use them without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from llmcli.answer.stats import Stats
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.answer.tool_calls import ToolCall, ToolResult

MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprob lists (OpenAI's limit on top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """How likely the model found one token of the answer: the natural log of its probability under the model's own
    distribution (before sampling), and the `top` most likely tokens at that position (id, bytes, logprob)."""

    token: int
    piece: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", "replace")

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's shape, which llama-server and Ollama share: token, logprob, bytes, top_logprobs."""
        return {"token": self.text, "logprob": self.logprob, "bytes": list(self.piece),
                "top_logprobs": [{"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}
                                 for _, piece, logprob in self.top]}


@dataclass(frozen=True)
class Token:
    """A piece of the answer, safe to print: complete characters, no part of a stop sequence; or, `reasoning`,
    a piece of the model's reasoning (its think block), not part of the answer. `logprobs`: of the tokens whose text
    this piece completes, when they were asked for."""

    text: str
    reasoning: bool = False
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    """The answer is over: why, its timings, and the answer itself (its text, and its reasoning apart)."""

    finish_reason: str  # why it ended: a name of llmcli/answer/finish.py's REASONS
    stats: Stats
    stop_sequence: str | None = None
    format_error: str | None = None  # why the answer is not the JSON --format json / --json-schema asked for
    text: str = ""  # the whole answer: every Token's text (no stop sequence, no reasoning, no tool call)
    reasoning: str | None = None  # the model's think block, or None when it wrote none
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer made (finish_reason "tool_calls")
    tool_results: tuple[ToolResult, ...] = ()  # what running them gave (run and chat's tool loop)
    logprobs: tuple[TokenLogprob, ...] = ()  # of the answer's tokens (every Token's), when they were asked for
    dropped: int = 0  # the conversation's oldest exchanges a server dropped to fit its context (chat through one)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the prompt's tokens after the first, when asked for (echo)


@dataclass(frozen=True)
class Prefill:
    """The prompt is being evaluated: `evaluated` of the `total` tokens it needs (the cached ones not counted).
    Yielded once before the first chunk and after each one (run and chat show it on a terminal)."""

    evaluated: int
    total: int
    prompt: int = 0  # the whole prompt's tokens (the cached ones too)


@dataclass(frozen=True)
class Notice:
    """Something the user should know about this answer (printed on stderr, not part of it). `advisory`: about its
    speed, not its content (-q leaves it out)."""

    text: str
    advisory: bool = False


class Candidate(NamedTuple):
    """One token a step considered: the model's log-probability and probability for it (before any sampler), and
    its probability once the sampler chain had done its work (0: removed or masked). A named tuple: a trace makes
    ten a token (a frozen dataclass's costs ~1.5 µs more each)."""

    token: int
    piece: bytes
    logprob: float
    p_model: float
    p_sampler: float


@dataclass(frozen=True)
class PrefillTrace:
    """How the prompt became a KV cache before the first token: tokens evaluated now (in `batches` passes), tokens
    reused, seconds, and the cache's size after it (its cells of this sequence, in bytes)."""

    evaluated: int
    cached: int
    seconds: float
    kv_bytes: int
    batches: int = 0  # the passes (llama_decode calls) the evaluated tokens took


@dataclass(frozen=True)
class TokenTrace:
    """One sampled token, traced (`run --trace`): its index in the answer, its id and bytes, how it was chosen
    (`argmax`, or `drawn` with probability `p`), the candidates (the model's most likely and the sampler's), each
    sampler stage with the candidates it left (`stages`: name, kept; `changed`: the ones that changed the
    distribution), and the seconds since the previous token (the first: since the answer began; it carries the
    prefill). Yielded before the text the token completes."""

    index: int
    token: int
    piece: bytes
    special: bool
    how: str
    p: float
    candidates: tuple[Candidate, ...]
    stages: tuple[tuple[str, int], ...]
    changed: tuple[str, ...]
    seconds: float
    note: str = ""  # what else happened (the grammar refused the first choice: sampled again under it)
    prefill: PrefillTrace | None = None


# What decoding one answer yields (a slot's events): text, the calls' events, then its Done.
DecodeEvent = Token | Done | CallStarted | CallArguments

# Everything answering yields, in order: Prefill while the prompt is evaluated, Notices, Tokens and the calls' events
# (a traced answer's TokenTrace before the text of its token: run and chat only), then one Done.
AnswerEvent = Token | Done | Notice | Prefill | CallStarted | CallArguments | TokenTrace


def answer_record(done: Done, notices: Sequence[str] = ()) -> dict[str, Any]:
    """The machine-readable record of one answer: text (the answer only), reasoning (the think block, or None),
    why it ended, token counts and timings."""
    stats = done.stats
    return {
        "text": done.text,
        "reasoning": done.reasoning,
        "finish_reason": done.finish_reason,
        "stop_sequence": done.stop_sequence,
        "format_error": done.format_error,
        "notices": list(notices),
        "usage": {
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "completion_tokens": stats.completion_tokens,
            "reasoning_tokens": stats.reasoning_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        },
        "timings": stats.to_dict(),
        **({"tool_calls": [_call_record(call, done.tool_results) for call in done.tool_calls]} if done.tool_calls else {}),
        **({"logprobs": [logprob.to_dict() for logprob in done.logprobs]} if done.logprobs else {}),
    }


def _call_record(call: ToolCall, results: Sequence[ToolResult]) -> dict[str, Any]:
    result = next((r for r in results if r.call_id == call.id), None)
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "error": call.error,
            **({"result": result.content, "result_is_error": result.error} if result is not None else {})}
