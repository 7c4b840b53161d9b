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

Speculative decoding works per sequence: in a step that only decodes, a slot may add a draft from its
own prompt and answer (prompt lookup) after its pending token, verified by its own sampler chain as a
single answer's are (`speculative.Decoder`). A step of n sequences already reads the weights once for n
tokens, so `auto` asks the cost model what k more tokens would add to that step (`CostModel.step_gain`),
measured from the steps themselves and a small probe now and then.

Built on the engine's public API; it never prints.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from llmcli.errors import LlmcliError
from llmcli.inference.batch import Batch
from llmcli.inference.batch_input import BatchItem, Record
from llmcli.inference.engine import Engine
from llmcli.inference.events import Done, answer_record
from llmcli.inference.generation import Answer, GenerationOptions
from llmcli.inference.sampler import Sampler
from llmcli.inference.speculative import MIN_GAIN, PROBE_EVERY, PROBE_FROM, PROBE_K, LookupDrafter
from llmcli.inference.stats import Stats
from llmcli.interrupt import Cancellation
from llmcli.store.prompt_store import shared_prefix

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
    lookup: LookupDrafter | None = None  # the prompt and the answer so far, for drafts (speculative decoding)
    drafted: int = 0
    accepted: int = 0

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
            seed=self.sampler.seed, threads=threads, draft_tokens=self.drafted, accepted_tokens=self.accepted,
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
    draft_tokens: int = 0  # speculative decoding: tokens drafted and verified, over all answers
    accepted_tokens: int = 0

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
        self.speculation = generation.speculation
        self.drafting = generation.speculation.mode in ("auto", "lookup")  # a draft model drafts for one answer only
        self._since_draft = 0

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
        lookup = LookupDrafter(tokens) if self.drafting else None
        return _Slot(seq, item, tokens, sampler, answer, time.perf_counter(), shared=shared, prefilled=shared,
                     lookup=lookup)

    def _step(self, batch: Batch) -> bool:
        """One decode: every decoding slot's pending token, then prompt chunks; False when there was nothing."""
        batch.clear()
        decoding = [slot for slot in filter(None, self.slots) if slot.pending is not None]
        waiting = any(slot.prefilled < len(slot.tokens) for slot in filter(None, self.slots))
        drafts = self._drafts(decoding, batch.capacity) if self.drafting and decoding and not waiting else {}
        sample_at: list[tuple[_Slot, list[int], list[int], int]] = []  # slot, batch indices, its draft, the source
        for slot in decoding:
            draft, source = drafts.get(slot.seq, ([], 0))
            pos, pending = slot.pos, slot.pending or 0
            indices = [batch.add(token, pos + i, slot.seq, True) for i, token in enumerate([pending, *draft])]
            sample_at.append((slot, indices, draft, source))
        prefilling = False
        before = {slot.seq: slot.prefilled for slot in filter(None, self.slots)}
        for slot in filter(None, self.slots):
            while slot.prefilled < len(slot.tokens) and not batch.full:
                last = slot.prefilled == len(slot.tokens) - 1
                index = batch.add(slot.tokens[slot.prefilled], slot.prefilled, slot.seq, last)
                slot.prefilled += 1
                prefilling = True
                if last:
                    sample_at.append((slot, [index], [], 0))
        if batch.n == 0:
            return False
        step_started = time.perf_counter()
        if not self.engine.decode(batch):
            for slot in filter(None, self.slots):  # nothing was evaluated: this step's prompt chunks come again
                slot.prefilled = before[slot.seq]
            self._grow()
            return True
        self.summary.prefill_tokens += sum(slot.prefilled - before[slot.seq] for slot in filter(None, self.slots))
        if not prefilling:
            self.speculation.cost.observe_pass(batch.n, time.perf_counter() - step_started)
        self.engine.adapt_threads(time.perf_counter())
        sampled = sum(self._verify(slot, indices, draft, source) for slot, indices, draft, source in sample_at)
        if not prefilling:
            self.summary.decode_steps_s += time.perf_counter() - step_started
            self.summary.decode_step_tokens += sampled
        for seq, running in enumerate(self.slots):
            if running is not None and running.answer.finish is not None:
                self._finish(running)
                self.slots[seq] = None
        return True

    def _drafts(self, decoding: list[_Slot], capacity: int) -> dict[int, tuple[list[int], int]]:
        """Each decoding slot's draft for this step (sequence -> draft, source), strongest matches first, as long as
        the cost model expects the step to give more tokens a second with it; `lookup` always drafts."""
        speculation, cost = self.speculation, self.speculation.cost
        forced = speculation.mode == "lookup"
        candidates = []
        for slot in decoding:
            room = min(speculation.max_draft, self.cells_per_sequence - slot.pos - 2, self.engine.n_ctx - slot.pos - 2)
            if self.generation.max_tokens:
                room = min(room, self.generation.max_tokens - slot.answer.n_out - 1)
            if slot.lookup is not None and room > 0:
                draft, source = slot.lookup.draft(room)
                if draft:
                    candidates.append((source, slot.seq, draft))
        n_tokens, n_out = len(decoding), float(len(decoding))
        self._since_draft += 1
        if not candidates or (n_tokens not in cost.pass_s and not forced):  # a plain step first: it is timed
            return {}
        drafts: dict[int, tuple[list[int], int]] = {}
        for source, seq, draft in sorted(candidates, reverse=True):
            draft = draft[: capacity - n_tokens]  # the step's batch holds at most `capacity` tokens
            if not draft:
                break
            k, gain = cost.best_step_k(n_tokens, n_out, len(draft), source)
            if forced:
                k = max(k, 1)
            elif gain < MIN_GAIN:
                if self._since_draft < PROBE_EVERY or source < PROBE_FROM:
                    continue
                k = min(PROBE_K, len(draft))  # now and then a small draft anyway: it times a larger step
            self._since_draft = 0
            drafts[seq] = (draft[:k], source)
            n_tokens += k
            n_out += cost.extra_tokens(k, source)
        return drafts

    def _verify(self, slot: _Slot, indices: list[int], draft: list[int], source: int) -> int:
        """Sample the slot's pending token's logits, then each drafted position's while the draft was right; the
        rest of the draft leaves the slot's cells. The number of tokens sampled."""
        pos = slot.pos
        for i, index in enumerate(indices):
            token = slot.sampler.sample(index)
            self._advance(slot, token)
            if slot.answer.finish is not None or i == len(draft) or token != draft[i]:
                break
        if draft:
            accepted = min(i, len(draft))
            slot.drafted += len(draft)
            slot.accepted += accepted
            self.summary.draft_tokens += len(draft)
            self.summary.accepted_tokens += accepted
            self.speculation.cost.observe_acceptance(source, len(draft), accepted)
            if slot.answer.finish is None:
                self.engine.kv.remove(slot.seq, pos + 1 + i, -1)  # the pending token is now at pos + 1 + i
        return i + 1

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
        if slot.lookup is not None:
            slot.lookup.append(token)

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
