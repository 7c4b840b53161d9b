"""What one answer may be (GenerationOptions) and the one rule for when it ends (Answer).

Both decode loops, `Engine.generate` (one sequence) and `parallel.run_batch` (many), feed every
sampled token to an `Answer`, which assembles the text and decides the finish reason.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from llmcli.inference.grammar import Constraint
from llmcli.inference.reasoning import ReasoningSplitter
from llmcli.inference.sampling import SamplingConfig
from llmcli.inference.speculative import Speculation
from llmcli.inference.streaming import AnswerText
from llmcli.settings import default


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    constraint: Constraint = field(default_factory=Constraint)  # what the finished answer must be
    repetition_guard: bool = default("repetition_guard")  # stop an answer caught in a loop
    speculation: Speculation = field(default_factory=Speculation)  # several tokens a pass when a draft is right
    reasoning: bool = True  # tell a leading <think> block apart from the answer (False: all of it is the answer)
    thinking_open: bool = False  # the prompt opened a think block: the output starts inside it


# The repetition guard: an answer is caught in a loop when its last LOOP_SPAN tokens (or LOOP_REPEATS
# periods, if longer) repeat one run of at most LOOP_PERIOD tokens exactly. Looked for every LOOP_EVERY tokens.
LOOP_SPAN, LOOP_REPEATS, LOOP_PERIOD, LOOP_EVERY = 64, 3, 128, 8


class Answer:
    """Sampled tokens in, printable text out; `finish` is set once the answer is over:

    `stop` (end of generation), `stop_sequence`, `length` (-n reached), `context_full`
    (the token just sampled has no cell left in the context to be decoded in) or `repetition`
    (the answer is caught in a loop, when the guard is on).
    """

    def __init__(self, options: GenerationOptions, n_prompt: int, n_ctx: int):
        splitter = ReasoningSplitter(options.thinking_open) if options.reasoning else None
        self.stream = AnswerText(options.stops, splitter)  # token bytes -> printable text
        self.limit = options.max_tokens if options.max_tokens is not None else sys.maxsize
        self.room = n_ctx - n_prompt  # tokens of answer that fit after the prompt
        self.n_out = 0  # tokens of the answer (an end-of-generation token is not counted)
        self.finish: str | None = None
        self.constraint = options.constraint
        self.parts: list[str] = []  # the text returned so far (`content`)
        self.thought: list[str] = []  # the reasoning so far
        self.thinking = ""  # the reasoning the last `add` or `close` completed (its text is not returned)
        self.tokens: list[int] | None = [] if options.repetition_guard else None

    def add(self, token: int, end_of_generation: bool, piece: bytes) -> str:
        """One sampled token (its id, and its bytes); returns the text now safe to print."""
        if end_of_generation:
            self.finish = "stop"
            return ""
        self.n_out += 1
        stream = self.stream
        text = stream.feed(piece)
        self.thinking = stream.reasoning
        if self.thinking:
            self.thought.append(self.thinking)
            stream.reasoning = ""  # taken: a later piece of pure answer must not bring it again
        self.parts.append(text)
        tokens = self.tokens
        if tokens is not None:
            tokens.append(token)
        if self.stream.stop is not None:
            self.finish = "stop_sequence"
        elif self.n_out >= self.limit:
            self.finish = "length"
        elif self.n_out > self.room:
            self.finish = "context_full"
        elif tokens is not None and self.n_out % LOOP_EVERY == 0 and looping(tokens):
            self.finish = "repetition"
        return text

    def close(self) -> str:
        """No more tokens: release what was held back (a stop sequence completing now ends it there)."""
        text = self.stream.finish()
        self.thinking = self.stream.reasoning
        if self.thinking:
            self.thought.append(self.thinking)
        self.parts.append(text)
        if self.stream.stop is not None:
            self.finish = "stop_sequence"
        return text

    @property
    def content(self) -> str:
        """The text of the answer returned so far."""
        return "".join(self.parts)

    @property
    def reasoning(self) -> str | None:
        """The model's reasoning (its think block), or None when it wrote none."""
        return "".join(self.thought).strip() or None

    def format_error(self, finish_reason: str) -> str | None:
        """Why the whole answer is not what --format json or --json-schema asked for, or None."""
        return self.constraint.problem(self.content, finish_reason)

    @property
    def stop_sequence(self) -> str | None:
        return self.stream.stop


def looping(tokens: list[int]) -> bool:
    """Whether the end of `tokens` repeats one run of tokens over and over (see LOOP_SPAN)."""
    last = tokens[-1]
    for period in range(1, min(LOOP_PERIOD, len(tokens) // LOOP_REPEATS) + 1):
        span = max(LOOP_SPAN, LOOP_REPEATS * period)
        if span > len(tokens):
            break
        # periodic: each token of the span equals the one `period` later (the last token first: cheap)
        if tokens[-1 - period] == last and tokens[-span:-period] == tokens[-span + period:]:
            return True
    return False
