"""run's and chat's client of the scheduler: one prompt in sequence 0 (reusing what it holds of it), alone, its
events as they come — the prefill's progress, a traced answer's tokens before their text, the answer's events.
Ctrl-C (the engine's cancellation) ends it between steps, or inside a prompt chunk, as `interrupted`."""

from __future__ import annotations

from collections.abc import Iterator

from llmcli.answer.events import DecodeEvent, Prefill, TokenTrace
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.stats import AnswerClock
from llmcli.decode.scheduler import Scheduler


def answer(scheduler: Scheduler, prompt: list[int], options: GenerationOptions, seed: int, clock: AnswerClock,
           split_at: int | None = None) -> Iterator[DecodeEvent | Prefill | TokenTrace]:
    """Answer `prompt` alone in sequence 0; the consumer stopping early ends the answer there."""
    engine = scheduler.engine
    engine.check_budget(len(prompt), options.max_tokens)
    with engine.sharing_cores():
        slot = scheduler.start(0, prompt, options, seed, clock, split_at=split_at)
        try:
            total = len(prompt) - slot.cached
            if total > 0:
                yield Prefill(0, total, len(prompt))
            while not slot.finished:
                events = scheduler.step() if not engine.cancel else scheduler.finish(slot, "interrupted")
                if scheduler.traced:  # (a traced answer: each token's trace before the text it completes)
                    yield from (trace for _, trace in scheduler.traced)
                    scheduler.traced.clear()
                for _, event in events:
                    yield event
                if slot.cached < slot.prefilled < len(prompt):  # a chunk is done, more are to come
                    yield Prefill(slot.prefilled - slot.cached, total, len(prompt))
        finally:
            if not slot.finished:  # the consumer stopped early: the answer ends here
                scheduler.finish(slot, "interrupted")
