"""What a scheduler step is made of: a `Slot` (one answer in one sequence), the `StepPlan` a step decides (each
decoding slot's `Planned` token and draft, the prompt `Chunk`s) before it acts, and the `StepTotals` of every step.
Plain data: llmcli/decode/scheduler.py decides and acts on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.events import DecodeEvent
from llmcli.answer.generation import Answer, GenerationOptions
from llmcli.answer.stats import AnswerClock
from llmcli.decode.speculative import Drafter
from llmcli.llama.sampler_chain import Sampler

Event = tuple["Slot", DecodeEvent]


@dataclass(eq=False)
class Slot:
    """One answer being decoded in sequence `seq`."""

    seq: int
    prompt: list[int]
    options: GenerationOptions
    sampler: Sampler
    answer: Answer
    clock: AnswerClock
    drafter: Drafter | None
    cached: int  # leading prompt tokens the sequence held already (not evaluated for this answer)
    prefilled: int  # prompt tokens in the sequence's cells now
    split_at: int | None = None  # a prompt chunk ends here (where a saved state ends or will end)
    tag: Any = None  # the client's own handle on this answer (a batch item, a server's job)
    pending: int | None = None  # the token sampled last, still to be decoded
    sampled: int = 0  # tokens sampled, an end-of-generation token included
    draft_source: int = 0  # where this step's draft came from (an n-gram size; 0: the draft model)
    drafted: int = 0
    accepted: int = 0
    finished: bool = False
    forced: list[int] = field(default_factory=list)  # tokens the loop writes next, unsampled (a think block's close)
    thinking_closed: bool = False  # its think block was closed at --think-budget
    prefill_threads: int | None = None  # llama.cpp threads its first prompt chunk was evaluated on
    prefill_passes: int = 0  # the passes its prompt's chunks were evaluated in
    record: list[tuple[int, Any]] | None = None  # each sampled token and its logprob (an answer a restart resumes)
    replayed: int = 0  # the prompt ends with this many tokens of the answer, sampled before a restart (resumed)
    scores: list[Any] | None = None  # each prompt token's logprob after the first, as its chunks are evaluated (echo)

    @property
    def pos(self) -> int:
        """Position of the pending token: right after the prompt and the answer's tokens decoded so far."""
        return self.prefilled + self.answer.n_out - self.replayed - 1


@dataclass(frozen=True)
class Planned:
    """A decoding slot's part of a pass: its pending token, then the draft to verify (and where the draft came
    from: an n-gram size, or 0 for the draft model)."""

    slot: Slot
    draft: list[int]
    draft_source: int = 0


@dataclass(frozen=True)
class Chunk:
    """A prefilling slot's part of a pass: its prompt's tokens [begin, end)."""

    slot: Slot
    begin: int
    end: int


@dataclass(frozen=True)
class StepPlan:
    """What one pass holds (the scheduler's decision, nothing done yet). `single`: one answer's plain step — one
    token of sequence 0, no batch to build."""

    decoding: list[Planned]
    chunks: list[Chunk]
    single: bool = False
    image: Chunk | None = None  # a pass of one image's embeddings (the prompt's placeholder run [begin, end)), alone

    @property
    def n_tokens(self) -> int:
        image = self.image.end - self.image.begin if self.image is not None else 0
        return sum(1 + len(p.draft) for p in self.decoding) + sum(c.end - c.begin for c in self.chunks) + image

    @property
    def prompt_chunks(self) -> list[Chunk]:
        """The prompt parts this pass evaluates: text chunks, or an image."""
        return [self.image] if self.image is not None else self.chunks


@dataclass
class StepTotals:
    """What the steps did, over every answer (--batch's summary line, bench)."""

    prefill_tokens: int = 0  # prompt tokens evaluated
    decode_steps_s: float = 0.0  # time in steps that only decoded (no prompt chunk)
    decode_step_tokens: int = 0  # tokens sampled in those steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    grown: int = 0  # times the KV cache was made larger for a long answer
