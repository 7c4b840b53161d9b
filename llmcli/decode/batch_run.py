"""`run --batch`: many prompts through the one scheduler, a finite queue (continuous batching).

Decode reads every weight once per step whether it advances one sequence or eight, so N
slots share one context (one KV cache, one sequence id each), and the scheduler's steps carry the
next token of every decoding slot, then prompt chunks of newly scheduled slots in the room
left (so prefill rides along with the others' decode steps). A finished slot is cleared and
the next prompt takes it. Each prompt has its own sampler chain and seed, so with a seed its
answer does not depend on its slot or its neighbours (up to llama.cpp's batch numerics).

The KV cache is sized to the work (`plan`): every sequence has cells of its own (so an answer's
numbers do not depend on its neighbours) for the longest prompt plus -n, or plus a default room
for the answer; when an answer outgrows that, every sequence's state is saved, the cache is made
twice as large (up to the context size) and the states restored — answers are never cut short by
the sizing. The prefix every prompt shares (template head, system prompt) is evaluated once, in a
sequence of its own, and copied to each slot when it starts (`llama_memory_seq_cp`).

Speculative decoding, the growth and the finish rule are the scheduler's: in a step that only decodes, a
slot may add a draft from its own prompt and answer (prompt lookup), verified by its own sampler chain.

It never prints.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmcli.answer.batch_jsonl import BatchItem, Record, Summary
from llmcli.answer.events import Done, answer_record
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import text_before_image
from llmcli.answer.preparation import Prepared
from llmcli.answer.shared_prefix import shared_prefix
from llmcli.answer.stats import AnswerClock
from llmcli.decode.scheduler import Scheduler
from llmcli.decode.speculative import Speculation
from llmcli.errors import LlmcliError
from llmcli.interrupt import Cancellation
from llmcli.llama.batch import Batch
from llmcli.llama.engine import Engine

DEFAULT_ANSWER_ROOM = 256  # cells for an answer without -n at first (the cache grows for longer ones)


@dataclass(frozen=True)
class BatchPlan:
    """What the batch needs before its context is made: every prompt prepared (its tokens, its options, its notices),
    the prefix they all share, and the KV cells of each sequence."""

    prepared: dict[int, Prepared]  # item index -> its prompt and options (items whose prompt failed are error items)
    items: list[BatchItem]
    shared: int  # leading tokens every prompt has (evaluated once); at most the shortest prompt - 1
    cells_per_sequence: int
    n_slots: int

    @property
    def n_sequences(self) -> int:
        """The slots, and the shared prefix's own sequence if there is one."""
        return self.n_slots + (1 if self.shared else 0)

    @property
    def cells(self) -> int:
        return self.cells_per_sequence * self.n_sequences


def plan(items: list[BatchItem], prepare: Callable[[BatchItem], Prepared], engine: Engine,
         generation: GenerationOptions, n_parallel: int, answer_room: int = DEFAULT_ANSWER_ROOM) -> BatchPlan:
    """Prepare every prompt (as every path prepares one: llmcli/answer/preparation.py), find their shared prefix and
    size the KV cache: each sequence holds the longest prompt plus -n (else `answer_room`: it grows when an answer
    needs more), at most the context."""
    found: dict[int, Prepared] = {}
    planned = []
    for item in items:
        if item.error is None:
            try:
                found[item.index] = prepare(item)
            except LlmcliError as exc:
                item = BatchItem(item.index, item.prompt, item.extra, exc.message, item.images)
        planned.append(item)
    prompts = [prepared.prompt.tokens for prepared in found.values()]
    shared = 0
    if len(prompts) > 1:  # each prompt keeps at least one token of its own: its logits give the first answer token
        shared = min(min(shared_prefix(prompts[0], p) for p in prompts), min(len(p) for p in prompts) - 1)
        shared = text_before_image(prompts[0], 0, shared)  # the shared prefix is text: each prompt's images its own
    n_slots = max(1, min(n_parallel, len(prompts)))
    longest_rest = max((len(p) - shared for p in prompts), default=1)
    room = generation.max_tokens or answer_room
    return BatchPlan(found, planned, shared, min(shared + longest_rest + room, engine.n_ctx), n_slots)


class BatchRun:
    """Answers a list of items in `n_slots` slots; `on_result(index, record)` as each finishes (any order)."""

    def __init__(self, engine: Engine, batch_plan: BatchPlan, generation: GenerationOptions,
                 cancel: Cancellation, on_result: Callable[[int, Record], None], speculation: Speculation | None = None,
                 prepare: Callable[[BatchItem], Prepared] | None = None):
        """`engine` has been resized for the plan: `batch_plan.cells` cells, `batch_plan.n_sequences` sequences.
        `prepare`: an item's prompt prepared again as its slot starts (one with images: the plan kept only its tokens,
        and the projector keeps only the latest images prepared, so thousands of pictures are never held at once)."""
        self.engine, self.plan, self.generation, self.prepare = engine, batch_plan, generation, prepare
        self.cancel, self.on_result = cancel, on_result
        self.scheduler = Scheduler(engine, batch_plan.n_slots, speculation or Speculation(), batch_plan.cells_per_sequence,
                                   prefix_seq=batch_plan.n_slots if batch_plan.shared else None, keep_cells=False)
        self.queue: deque[BatchItem] = deque()
        self.summary = Summary(shared_prefix_tokens=batch_plan.shared)
        self.done = 0
        self.notices: dict[int, tuple[str, ...]] = {}  # an item's notices for its record (-n capped, input truncated)

    def run(self, on_progress: Callable[[int, int, float], None] | None = None) -> Summary:
        started = time.perf_counter()
        items, scheduler = self.plan.items, self.scheduler
        self.summary.prompts = len(items)
        for item in items:
            if item.error is None:
                self.queue.append(item)
            else:
                self._error(item, item.error)
        with self.engine.sharing_cores():
            try:
                if self.plan.shared:
                    _prefill_prefix(scheduler, next(iter(self.plan.prepared.values())).prompt.tokens[: self.plan.shared])
                while (self.queue or scheduler.busy) and not self.cancel:
                    self._fill_slots()
                    self._results(scheduler.step())
                    if on_progress is not None:
                        elapsed = time.perf_counter() - started
                        generated = self.summary.completion_tokens + sum(s.answer.n_out for s in scheduler.slots if s)
                        on_progress(self.done, len(items), generated / elapsed if elapsed > 0 else 0.0)
            finally:
                self._abandon()
                scheduler.close()
        totals = scheduler.totals
        self.summary.prefill_tokens = totals.prefill_tokens
        self.summary.decode_steps_s, self.summary.decode_step_tokens = totals.decode_steps_s, totals.decode_step_tokens
        self.summary.draft_tokens, self.summary.accepted_tokens = totals.draft_tokens, totals.accepted_tokens
        self.summary.grown = totals.grown
        self.summary.interrupted = bool(self.cancel)
        self.summary.wall_s = time.perf_counter() - started
        return self.summary

    def _fill_slots(self) -> None:
        for seq in self.scheduler.free_sequences():
            if not self.queue:
                return
            item = self.queue.popleft()
            prepared = self.plan.prepared[item.index]
            if item.images and self.prepare is not None:
                try:
                    prepared = self.prepare(item)
                except LlmcliError as exc:  # (its image changed or went away since the plan)
                    self._error(item, exc.message)
                    continue
            tokens, generation = prepared.prompt.tokens, prepared.generation
            self.summary.prompt_tokens += len(tokens)
            seed = item.extra.get("seed")  # a JSONL line may carry its own seed
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32 - 1:
                seed = generation.sampling.effective_seed()
            if prepared.notices:  # (-n past this prompt's context, its input truncated: said in its record)
                self.notices[item.index] = prepared.notices
            self.scheduler.start(seq, tokens, generation, seed, AnswerClock(), tag=item, shared=self.plan.shared)

    def _results(self, events: list[tuple[Any, Any]]) -> None:
        for slot, event in events:
            if isinstance(event, Done):
                item: BatchItem = slot.tag
                self.summary.completion_tokens += event.stats.completion_tokens
                notices = self.notices.pop(item.index, ())
                self.on_result(item.index, {**item.extra, "index": item.index, **answer_record(event, notices)})
                self.done += 1

    def _error(self, item: BatchItem, message: str) -> None:
        self.summary.errors += 1
        self.on_result(item.index, item.error_record(message))
        self.done += 1

    def _abandon(self) -> None:
        """Interrupted (or failed): a record for every slot in flight and every item not started."""
        self._results(self.scheduler.finish_all("interrupted"))
        while self.queue:
            item = self.queue.popleft()
            self.summary.not_started += 1
            self.on_result(item.index, item.error_record("interrupted before it started"))


def _prefill_prefix(scheduler: Scheduler, tokens: list[int]) -> None:
    """Evaluate `tokens` into the scheduler's prefix sequence, once (the prompts that start with them copy it)."""
    assert scheduler.prefix_seq is not None
    with Batch(max(scheduler.engine.config.n_batch, scheduler.n_slots)) as batch:
        for start in range(0, len(tokens), batch.capacity):
            batch.clear()
            for pos in range(start, min(len(tokens), start + batch.capacity)):
                batch.add(tokens[pos], pos, scheduler.prefix_seq, False)
            outcome = scheduler.engine.decode(batch, "evaluating the shared prefix", abortable=True)
            if outcome == "full":
                raise LlmcliError("the KV cache is too small for the prompts' shared prefix", hint="Use a larger --ctx-size.")
            if outcome == "aborted":
                return
    scheduler.totals.prefill_tokens += len(tokens)
