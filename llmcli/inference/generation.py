"""What one answer may be (GenerationOptions) and the one rule for when it ends (Answer).

Both decode loops, `Engine.generate` (one sequence) and `parallel.run_batch` (many), feed every
sampled token to an `Answer`, which assembles the text and decides the finish reason.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from llmcli.inference.grammar import Constraint
from llmcli.inference.sampling import SamplingConfig
from llmcli.inference.streaming import AnswerText


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    constraint: Constraint = field(default_factory=Constraint)  # what the finished answer must be


class Answer:
    """Sampled tokens in, printable text out; `finish` is set once the answer is over:

    `stop` (end of generation), `stop_sequence`, `length` (-n reached) or `context_full`
    (the token just sampled has no cell left in the context to be decoded in).
    """

    def __init__(self, options: GenerationOptions, n_prompt: int, n_ctx: int):
        self.text = AnswerText(options.stops)
        self.limit = options.max_tokens if options.max_tokens is not None else sys.maxsize
        self.room = n_ctx - n_prompt  # tokens of answer that fit after the prompt
        self.n_out = 0  # tokens of the answer (an end-of-generation token is not counted)
        self.finish: str | None = None
        self.constraint = options.constraint
        self.parts: list[str] = []  # the text returned so far

    def add(self, end_of_generation: bool, piece: bytes) -> str:
        """One sampled token (its bytes); returns the text now safe to print."""
        if end_of_generation:
            self.finish = "stop"
            return ""
        self.n_out += 1
        text = self.text.feed(piece)
        self.parts.append(text)
        if self.text.stop is not None:
            self.finish = "stop_sequence"
        elif self.n_out >= self.limit:
            self.finish = "length"
        elif self.n_out > self.room:
            self.finish = "context_full"
        return text

    def close(self) -> str:
        """No more tokens: release what was held back (a stop sequence completing now ends it there)."""
        text = self.text.finish()
        self.parts.append(text)
        if self.text.stop is not None:
            self.finish = "stop_sequence"
        return text

    def format_error(self, finish_reason: str) -> str | None:
        """Why the whole answer is not what --format json or --json-schema asked for, or None."""
        return self.constraint.problem("".join(self.parts), finish_reason)

    @property
    def stop_sequence(self) -> str | None:
        return self.text.stop
