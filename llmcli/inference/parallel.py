"""Many prompts decoded together: parallel sequences in one llama.cpp context (continuous batching).

Decode reads every weight once per step whether it advances one sequence or eight, so N
slots share one context (one KV cache, one sequence id each). Every step builds one batch: the
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

Built on the engine's public API; it never prints.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmcli.errors import LlmcliError
from llmcli.inference.batch import Batch
from llmcli.inference.engine import Engine
from llmcli.inference.events import Done, answer_record
from llmcli.inference.generation import Answer, GenerationOptions
from llmcli.inference.sampler import Sampler
from llmcli.inference.stats import Stats
from llmcli.interrupt import Cancellation
from llmcli.store.prompt_store import shared_prefix

Record = dict[str, Any]


@dataclass(frozen=True)
class BatchItem:
    index: int
    prompt: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # other JSONL fields, carried to the output
    error: str | None = None

    def error_record(self, message: str) -> Record:
        return {**self.extra, "index": self.index, "error": message}


def parse_items(lines: Iterable[str]) -> list[BatchItem]:
    """One prompt per line, or JSONL objects with a `prompt` field; bad lines become error items."""
    items = []
    for index, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if not line.strip():
            items.append(BatchItem(index, None, error="empty line"))
            continue
        if not line.lstrip().startswith("{"):
            items.append(BatchItem(index, line))
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            items.append(BatchItem(index, None, error=f"malformed JSON: {exc}"))
            continue
        prompt = record.pop("prompt", None) if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            extra = record if isinstance(record, dict) else {}
            items.append(BatchItem(index, None, extra, 'no "prompt" string in the object'))
            continue
        items.append(BatchItem(index, prompt, record))
    return items


DEFAULT_ANSWER_ROOM = 256  # cells for an answer without -n at first (the cache grows for longer ones)


@dataclass(frozen=True)
class BatchPlan:
    """What the batch needs before its context is made: every prompt's tokens, the prefix they all share,
    and the KV cells of each sequence."""

    tokens: dict[int, list[int]]  # item index -> prompt tokens (items whose prompt failed are error items)
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


def plan(items: list[BatchItem], render: Callable[[str], list[int]], engine: Engine, generation: GenerationOptions,
         n_parallel: int, answer_room: int = DEFAULT_ANSWER_ROOM) -> BatchPlan:
    """Render every prompt, find their shared prefix and size the KV cache: each sequence holds the longest
    prompt plus -n (else `answer_room`: it grows when an answer needs more), at most the context."""
    tokens: dict[int, list[int]] = {}
    planned = []
    for item in items:
        if item.error is None:
            try:
                prompt = render(item.prompt or "")
                engine.check_budget(len(prompt), generation.max_tokens)
            except LlmcliError as exc:
                item = BatchItem(item.index, item.prompt, item.extra, exc.message)
            else:
                tokens[item.index] = prompt
        planned.append(item)
    prompts = list(tokens.values())
    shared = 0
    if len(prompts) > 1:  # each prompt keeps at least one token of its own: its logits give the first answer token
        shared = min(min(shared_prefix(prompts[0], p) for p in prompts), min(len(p) for p in prompts) - 1)
    n_slots = max(1, min(n_parallel, len(prompts)))
    longest_rest = max((len(p) - shared for p in prompts), default=1)
    room = generation.max_tokens or answer_room
    return BatchPlan(tokens, planned, shared, min(shared + longest_rest + room, engine.n_ctx), n_slots)


@dataclass
class _Slot:
    seq: int
    item: BatchItem
    tokens: list[int]
    sampler: Sampler
    answer: Answer
    scheduled: float
    shared: int = 0  # leading prompt tokens shared from the prefix sequence (not evaluated for this prompt)
    prefilled: int = 0
    pending: int | None = None  # the sampled token still to be decoded
    sampled: int = 0  # tokens sampled, an end-of-generation token included
    first_token: float | None = None

    @property
    def pos(self) -> int:
        """Position of the pending token: right after the prompt and the tokens decoded so far."""
        return self.prefilled + self.answer.n_out - 1

    def record(self, finish: str | None = None, threads: int | None = None) -> Record:
        self.answer.close()
        now = time.perf_counter()
        first = self.first_token or now
        stats = Stats(
            load_s=0.0, prompt_s=0.0, prompt_tokens=len(self.tokens), cached_tokens=self.shared,
            prefill_tokens=self.prefilled - self.shared,
            prefill_s=first - self.scheduled, ttft_s=first - self.scheduled, completion_tokens=self.answer.n_out,
            decode_steps=max(0, self.sampled - 1), decode_s=now - first, total_s=now - self.scheduled,
            seed=self.sampler.seed, threads=threads,
        )
        reason = finish or self.answer.finish or "interrupted"
        done = Done(reason, stats, self.answer.stop_sequence, self.answer.format_error(reason))
        return {**self.item.extra, "index": self.item.index, **answer_record(self.answer.content, done,
                                                                                reasoning=self.answer.reasoning)}


@dataclass
class Summary:
    prompts: int = 0
    errors: int = 0  # lines that could not be answered (empty, malformed, too long)
    not_started: int = 0  # prompts an interrupt left unanswered
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    decode_steps_s: float = 0.0  # time in steps that only decoded (no prompt chunk)
    decode_step_tokens: int = 0  # tokens sampled in those steps
    interrupted: bool = False
    shared_prefix_tokens: int = 0  # the prefix every prompt shares, evaluated once
    prefill_tokens: int = 0  # prompt tokens evaluated (the shared prefix once, then each prompt's rest)
    grown: int = 0  # times the KV cache was made larger for a long answer

    @property
    def decode_tps(self) -> float:
        """Aggregate decode rate: tokens per second over all slots, in steps without prefill."""
        return self.decode_step_tokens / self.decode_steps_s if self.decode_steps_s > 0 else 0.0


class BatchRun:
    """Answers a list of items in `n_parallel` slots; `on_result(index, record)` as each finishes (any order)."""

    def __init__(self, engine: Engine, batch_plan: BatchPlan, generation: GenerationOptions,
                 cancel: Cancellation, on_result: Callable[[int, Record], None]):
        """`engine` has been resized for the plan: `batch_plan.cells` cells, `batch_plan.n_sequences` sequences."""
        self.engine, self.plan, self.generation = engine, batch_plan, generation
        self.cancel, self.on_result = cancel, on_result
        self.slots: list[_Slot | None] = [None] * batch_plan.n_slots
        self.prefix_seq = batch_plan.n_slots  # the sequence holding the shared prefix
        self.queue: deque[BatchItem] = deque()
        self.summary = Summary(shared_prefix_tokens=batch_plan.shared)
        self.cells_per_sequence = batch_plan.cells_per_sequence
        self.done = 0

    def run(self, on_progress: Callable[[int, int, float], None] | None = None) -> Summary:
        started = time.perf_counter()
        items = self.plan.items
        self.summary.prompts = len(items)
        for item in items:
            if item.error is None:
                self.queue.append(item)
            else:
                self._error(item, item.error)
        with Batch(max(self.engine.config.n_batch, len(self.slots))) as batch, self.engine.sharing_cores():
            try:
                self._prefill_shared(batch)
                while (self.queue or any(self.slots)) and not self.cancel:
                    self._fill_slots()
                    if not self._step(batch):
                        break
                    if on_progress is not None:
                        elapsed = time.perf_counter() - started
                        generated = self.summary.completion_tokens + sum(s.answer.n_out for s in self.slots if s)
                        on_progress(self.done, len(items), generated / elapsed if elapsed > 0 else 0.0)
            finally:
                self._abandon()
        self.summary.interrupted = bool(self.cancel)
        self.summary.wall_s = time.perf_counter() - started
        return self.summary

    def _prefill_shared(self, batch: Batch) -> None:
        """Evaluate the prefix all prompts share, once, into the prefix sequence."""
        shared = self.plan.shared
        if not shared:
            return
        prompt = next(iter(self.plan.tokens.values()))
        for start in range(0, shared, batch.capacity):
            batch.clear()
            for pos in range(start, min(shared, start + batch.capacity)):
                batch.add(prompt[pos], pos, self.prefix_seq, False)
            if not self.engine.decode(batch, "evaluating the shared prefix"):
                raise LlmcliError("the KV cache is too small for the prompts' shared prefix", hint="Use a larger --ctx-size.")
        self.summary.prefill_tokens += shared

    def _fill_slots(self) -> None:
        for seq in range(len(self.slots)):
            if self.slots[seq] is None and self.queue:
                self.slots[seq] = self._schedule(self.queue.popleft(), seq)

    def _schedule(self, item: BatchItem, seq: int) -> _Slot:
        """A slot for one prompt, starting after the shared prefix (shared with it, not evaluated again)."""
        tokens = self.plan.tokens[item.index]
        shared = self.plan.shared
        if shared:  # the prefix sequence's cells, copied whole (llama.cpp copies between sequences no other way)
            self.engine.kv.copy(self.prefix_seq, seq)
        self.summary.prompt_tokens += len(tokens)
        seed = item.extra.get("seed")  # a JSONL line may carry its own seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32 - 1:
            seed = self.generation.sampling.effective_seed()
        sampler = self.engine.sampler(self.generation.sampling, seed)
        answer = Answer(self.generation, len(tokens), self.engine.n_ctx)
        return _Slot(seq, item, tokens, sampler, answer, time.perf_counter(), shared=shared, prefilled=shared)

    def _step(self, batch: Batch) -> bool:
        """One decode: every decoding slot's pending token, then prompt chunks; False when there was nothing."""
        batch.clear()
        sample_at = [(slot, batch.add(slot.pending, slot.pos, slot.seq, True))
                     for slot in filter(None, self.slots) if slot.pending is not None]
        prefilling = False
        before = {slot.seq: slot.prefilled for slot in filter(None, self.slots)}
        for slot in filter(None, self.slots):
            while slot.prefilled < len(slot.tokens) and not batch.full:
                last = slot.prefilled == len(slot.tokens) - 1
                index = batch.add(slot.tokens[slot.prefilled], slot.prefilled, slot.seq, last)
                slot.prefilled += 1
                prefilling = True
                if last:
                    sample_at.append((slot, index))
        if batch.n == 0:
            return False
        step_started = time.perf_counter()
        if not self.engine.decode(batch):
            for slot in filter(None, self.slots):  # nothing was evaluated: this step's prompt chunks come again
                slot.prefilled = before[slot.seq]
            self._grow()
            return True
        self.summary.prefill_tokens += sum(slot.prefilled - before[slot.seq] for slot in filter(None, self.slots))
        self.engine.adapt_threads(time.perf_counter())
        for slot, index in sample_at:
            self._advance(slot, slot.sampler.sample(index))
        if not prefilling:
            self.summary.decode_steps_s += time.perf_counter() - step_started
            self.summary.decode_step_tokens += len(sample_at)
        for seq, running in enumerate(self.slots):
            if running is not None and running.answer.finish is not None:
                self._finish(running)
                self.slots[seq] = None
        return True

    def _grow(self) -> None:
        """A sequence outgrew its cells: save every sequence's state, make each one's cells twice as many (at most
        the context), restore them. The states are copied as they are: the answers do not change."""
        engine = self.engine
        if self.cells_per_sequence >= engine.n_ctx:
            raise LlmcliError(f"the KV cache is full ({engine.n_ctx} tokens a sequence)", hint="Use a larger --ctx-size.")
        sequences = [slot.seq for slot in self.slots if slot is not None] + ([self.prefix_seq] if self.plan.shared else [])
        states = {seq: engine.kv.state_of(seq) for seq in sequences}
        self.cells_per_sequence = min(2 * self.cells_per_sequence, engine.n_ctx)
        engine.resize(self.cells_per_sequence * self.plan.n_sequences, self.plan.n_sequences)
        for seq, state in states.items():
            if not engine.kv.load_state(seq, state):
                raise LlmcliError("llama.cpp refused a sequence's own state while growing the KV cache")
        for slot in self.slots:
            if slot is not None:
                slot.sampler.ctx = engine.llama_context  # the old context, whose logits it read, is freed
        self.summary.grown += 1

    def _advance(self, slot: _Slot, token: int) -> None:
        slot.first_token = slot.first_token or time.perf_counter()
        slot.sampled += 1
        vocab = self.engine.vocab
        slot.answer.add(token, vocab.is_end_of_generation(token), vocab.piece(token))
        slot.pending = token if slot.answer.finish is None else None

    def _finish(self, slot: _Slot, finish: str | None = None) -> None:
        self.summary.completion_tokens += slot.answer.n_out
        self.on_result(slot.item.index, slot.record(finish, self.engine.n_threads))
        slot.sampler.close()
        self.engine.kv.remove(slot.seq)
        self.done += 1

    def _error(self, item: BatchItem, message: str) -> None:
        self.summary.errors += 1
        self.on_result(item.index, item.error_record(message))
        self.done += 1

    def _abandon(self) -> None:
        """Interrupted (or failed): a record for every slot in flight and every item not started."""
        for seq, slot in enumerate(self.slots):
            if slot is not None:
                self._finish(slot, "interrupted")
                self.slots[seq] = None
        while self.queue:
            item = self.queue.popleft()
            self.summary.not_started += 1
            self.on_result(item.index, item.error_record("interrupted before it started"))


def in_order(write: Callable[[Record], None]) -> Callable[[int, Record], None]:
    """Results arrive in any order; `write` sees them in input order, each as soon as it can."""
    waiting: dict[int, Record] = {}
    next_index = [0]

    def accept(index: int, record: Record) -> None:
        waiting[index] = record
        while next_index[0] in waiting:
            write(waiting.pop(next_index[0]))
            next_index[0] += 1

    return accept
