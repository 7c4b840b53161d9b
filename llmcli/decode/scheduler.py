"""Step 5, the one answer loop: slots, and one `step()` that decodes them all.

A slot is one answer in one sequence of the KV cache: its prompt, its sampler chain, its `Answer` (the finish rule
and the text), its drafter and its clock. Each `step()` is plan → pass → apply (vLLM's SchedulerOutput shape):
`plan()` decides, changing nothing, what one pass holds — the pending token of every decoding slot and, when no slot
is still prefilling, the drafts the cost model buys (speculative decoding), then prompt chunks of the slots still
prefilling in the room left, the shortest prompt left first (a `StepPlan`); the pass evaluates it in one
`llama_decode` (the engine records what it stored); `apply` moves the slots on — their prompts, the samples of each
slot's own chain (a draft is verified position by position: kept while the sampled token is the drafted one, the
rest leaves the slot's cells) — and returns what each answer gained as events. A slot whose answer is over gets its
`Done` (its stats built in one place, `AnswerClock`) and frees its sequence.

Its three clients differ only in where the prompts come from: llmcli/decode/one_answer.py (run, chat: one slot,
sequence 0),
llmcli/decode/batch_run.py (--batch: a finite queue, a shared prefix evaluated once and copied into each slot,
cells grown when an answer outgrows them) and llmcli/decode/serving.py (serve: a thread-safe queue, each slot
keeping its cells for the next request that shares their prefix). A prompt chunk can be stopped by Ctrl-C inside
its pass; a full KV cache grows (when the cells are sized to the work) or ends the answers with context_full.

Built on the engine's public API; it never prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.events import TokenLogprob, TokenTrace
from llmcli.answer.generation import Answer, GenerationOptions
from llmcli.answer.images import has_images, image_start, text_before_image
from llmcli.answer.reasoning import CLOSE as THINK_CLOSE
from llmcli.answer.stats import AnswerClock
from llmcli.decode.observed import score_chunk, token_trace
from llmcli.decode.speculative import Candidate, Drafter, Speculation, choose_drafts
from llmcli.decode.step_plan import Chunk, Event, Planned, Slot, StepPlan, StepTotals
from llmcli.errors import LlmcliError
from llmcli.llama.batch import Batch
from llmcli.llama.engine import Engine
from llmcli.llama.logprobs import token_logprob
from llmcli.llama.sampler_trace import sample_traced
from llmcli.llama.schema_grammar import with_tool_grammar


@dataclass
class Scheduler:
    """The slots of one engine and the loop that decodes them. `cells` is what each sequence may use (less than
    the context when --batch sizes the cache to its work: it grows on demand); `prefix_seq` a sequence that holds
    a prefix shared by the prompts (kept across a growth); `keep_cells`: a finished slot's cells stay for the
    next answer in that sequence to reuse (run, chat, serve), else they are cleared (--batch)."""

    engine: Engine
    n_slots: int = 1
    speculation: Speculation = field(default_factory=Speculation)
    cells: int = 0  # 0: the context
    prefix_seq: int | None = None
    keep_cells: bool = True
    slots: list[Slot | None] = field(init=False)
    totals: StepTotals = field(init=False, default_factory=StepTotals)

    def __post_init__(self) -> None:
        self.slots = [None] * self.n_slots
        self.cells = self.cells or self.engine.kv.n_ctx
        self._batch = Batch(max(self.engine.config.n_batch, self.n_slots))
        self._closing: list[int] | None = None
        self._scored: list[tuple[Chunk, int]] = []  # the pass's chunks whose tokens are scored, and their first row
        self.traced: list[tuple[Slot, TokenTrace]] = []  # traced answers' tokens since the client last took them
        self.sampling: Slot | None = None  # the slot whose token llama.cpp is sampling now

    def close(self) -> None:
        self._batch.close()

    @property
    def busy(self) -> bool:
        return any(slot is not None for slot in self.slots)

    def free_sequences(self) -> list[int]:
        return [seq for seq, slot in enumerate(self.slots) if slot is None]

    # -- slots ---------------------------------------------------------------------------------

    def start(self, seq: int, prompt: list[int], options: GenerationOptions, seed: int, clock: AnswerClock | None = None,
              *, tag: Any = None, split_at: int | None = None, shared: int = 0, reuse_at_least: int = 1,
              resumed: Sequence[tuple[int, TokenLogprob | None]] | None = None) -> Slot:
        """A slot for `prompt` in sequence `seq` (free): the longest prefix of it the sequence holds is kept (when
        it has `reuse_at_least` tokens), the rest evaluated by the next steps. `shared`: the prefix sequence's
        tokens to copy in first (--batch). Raises what the sampler chain raises (a grammar llama.cpp refuses);
        nothing is started then. `resumed` (not None: sampled tokens are recorded, `Slot.record`): tokens (and logprobs)
        sampled before the engine died, at the prompt's end: fed to the answer and the sampler chain, never shown again."""
        engine = self.engine
        calls = options.tools is not None and options.tools.active  # (the call's opening is read in the vocabulary)
        sampler = engine.sampler(with_tool_grammar(options.sampling, options.tools, options.thinking_open,
                                                   options.call_preference, engine.vocab if calls else None), seed,
                                 observed=options.trace is not None)
        kv = engine.kv
        if shared and self.prefix_seq is not None:
            kv.remove(seq)
            kv.copy(self.prefix_seq, seq)
            cached = shared
        elif options.prompt_logprobs is not None:  # (every prompt position's logits are needed: none reused)
            kv.remove(seq)
            cached = 0
        else:
            cached = kv.keep_prefix(prompt, seq, reuse_at_least)
        clock = clock or AnswerClock()
        if has_images(prompt):  # an image is evaluated whole: a kept prefix or a split never ends inside one
            if (start := image_start(prompt, cached)) < cached:
                kv.remove(seq, start, -1)
                cached = start
            if split_at is not None:
                split_at = image_start(prompt, split_at)
            vision = engine.load_vision()
            clock.images = sum(1 for token in prompt if token < 0 and vision.run(token))
        kv.checkpoints.pop(seq, None)
        clock.prefill_started = time.perf_counter()
        drafter = Drafter.for_mode(options.speculate, prompt, self.speculation.draft_model)
        answer = Answer(options, len(prompt) - len(resumed or ()), engine.n_ctx)
        split = split_at if split_at is not None and cached < split_at < len(prompt) else None
        slot = Slot(seq, prompt, options, sampler, answer, clock, drafter, cached, cached, split, tag)
        if options.prompt_logprobs is not None:
            slot.scores = []
        if resumed is not None:
            slot.record, slot.replayed = list(resumed), len(resumed)
            for token, logprob in resumed:
                sampler.accept(token)
                answer.add(token, False, engine.vocab.answer_piece(token, options.special), logprob)
            slot.thinking_closed = answer.thinking_spent
        self.slots[seq] = slot
        return slot

    def finish(self, slot: Slot, reason: str) -> list[Event]:
        """End `slot`'s answer now (its own finish reason, when it has one, else `reason`): what the answer still
        held back, then its Done; its sequence is free again."""
        if slot.finished:
            return []
        slot.finished = True
        events: list[Event] = [(slot, token) for token in slot.answer.close()]
        if events and slot.clock.first_text is None:
            slot.clock.first_text = time.perf_counter()
        stats = slot.clock.stats(
            prompt_tokens=len(slot.prompt) - slot.replayed, cached_tokens=slot.cached,
            prefill_tokens=slot.prefilled - slot.cached,
            completion_tokens=slot.answer.n_out, decode_steps=max(0, slot.sampled - 1),
            seed=None if slot.options.sampling.greedy else slot.sampler.seed, threads=self.engine.n_threads,
            prefill_threads=slot.prefill_threads,
            draft_tokens=slot.drafted, accepted_tokens=slot.accepted, reasoning_tokens=slot.answer.thought_tokens,
            kv_cells=self.engine.kv.n_ctx)
        done = slot.answer.done(reason, stats)
        if slot.scores is not None:  # (of the request's prompt: not of answer tokens a restart put after it)
            done = dataclasses.replace(done, prompt_logprobs=tuple(slot.scores[:len(slot.prompt) - slot.replayed - 1]))
        events.append((slot, done))
        slot.sampler.close()
        if not self.keep_cells:
            self.engine.kv.remove(slot.seq)
        self.slots[slot.seq] = None
        return events

    def finish_all(self, reason: str) -> list[Event]:
        return [event for slot in self.slots if slot is not None for event in self.finish(slot, reason)]

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One pass over every slot: their pending tokens (and drafts), then prompt chunks; the events it made."""
        plan = self.plan()
        if plan.n_tokens == 0:
            return []
        started = time.perf_counter()
        outcome, to_sample = self._pass(plan)
        if outcome != "ok":
            return self._not_decoded(outcome, plan.prompt_chunks)
        return self._apply(plan, to_sample, started)

    def plan(self) -> StepPlan:
        """What the next pass holds: every decoding slot's pending token and the drafts the cost model buys (when no
        slot is prefilling), then prompt chunks in the room left, each ending where a saved state ends or will end.
        Changes nothing."""
        active = [slot for slot in self.slots if slot is not None]
        decoding = [slot for slot in active if slot.pending is not None]
        prefilling = [slot for slot in active if slot.prefilled < len(slot.prompt)]
        drafts = self._drafts(decoding) if decoding and not prefilling else {}
        if not drafts and not prefilling and len(active) == 1 and len(decoding) == 1 and decoding[0].seq == 0:
            return StepPlan([Planned(decoding[0], _NO_DRAFT)], [], single=True)
        planned = [Planned(slot, *drafts.get(slot.seq, (_NO_DRAFT, 0))) for slot in decoding]
        capacity = self._batch.capacity
        used = sum(1 + len(p.draft) for p in planned)
        chunks = []
        for slot in prefilling:
            if slot.prompt[slot.prefilled] < 0:  # an image begins here: its own pass (embeddings, not tokens)
                run = self.engine.vision.run(slot.prompt[slot.prefilled]) if self.engine.vision is not None else []
                return StepPlan([], [], image=Chunk(slot, slot.prefilled, slot.prefilled + max(1, len(run))))
        # The shortest prompt left first: a request that had nearly all of its prompt cached starts answering at the
        # next pass, instead of waiting behind a long prefill that takes every pass's room (an agent's second
        # session beside a new one: its first token took as long as the other's 17,830-token prompt).
        for slot in sorted(prefilling, key=lambda slot: len(slot.prompt) - slot.prefilled):
            if used >= capacity:
                break
            begin, end = slot.prefilled, len(slot.prompt)
            if slot.split_at is not None and begin < slot.split_at:
                end = slot.split_at
            if slot.scores is not None:  # (each token's logits kept: a chunk's rows bounded to SCORED_FLOATS)
                end = min(end, begin + max(8, SCORED_FLOATS // self.engine.vocab.n_tokens))
            end = text_before_image(slot.prompt, begin, min(end, begin + capacity - used))
            chunks.append(Chunk(slot, begin, end))
            used += end - begin
        return StepPlan(planned, chunks)

    def _pass(self, plan: StepPlan) -> tuple[str, list[tuple[Slot, int, list[int]]]]:
        """Evaluate the plan in one llama_decode: its outcome, and what to sample after it (slot, the batch index of
        its first logits, its draft)."""
        if plan.single:
            slot = plan.decoding[0].slot
            return self.engine.decode_one(slot.pending or 0), [(slot, -1, _NO_DRAFT)]
        if plan.image is not None:
            return self._image_pass(plan.image), []
        batch = self._batch
        batch.clear()
        to_sample: list[tuple[Slot, int, list[int]]] = []
        for planned in plan.decoding:
            slot = planned.slot
            pos, seq = slot.pos, slot.seq
            to_sample.append((slot, batch.add(slot.pending or 0, pos, seq, True), planned.draft))
            for i, token in enumerate(planned.draft):
                batch.add(token, pos + 1 + i, seq, True)
        self._scored.clear()
        for chunk in plan.chunks:
            prompt, seq, last = chunk.slot.prompt, chunk.slot.seq, len(chunk.slot.prompt) - 1
            scored = chunk.slot.scores is not None
            if scored:
                self._scored.append((chunk, batch.n))
            for pos in range(chunk.begin, chunk.end):
                batch.add(prompt[pos], pos, seq, scored or pos == last)
            if chunk.end == len(prompt):
                to_sample.append((chunk.slot, batch.n - 1, _NO_DRAFT))
        what = "evaluating the prompt" if plan.chunks else "decoding"
        return self.engine.decode(batch, what, abortable=bool(plan.chunks)), to_sample

    def _image_pass(self, chunk: Chunk) -> str:
        """Evaluate one image of a slot's prompt (encoded first, unless its embeddings are cached)."""
        slot, engine = chunk.slot, self.engine
        if chunk.end > self.cells:
            return "full"
        if engine.vision is None:
            raise LlmcliError("this prompt holds an image, but no vision projector is loaded")
        before = (engine.vision.encode_s, engine.vision.encoded)
        outcome = engine.decode_image(slot.prompt[chunk.begin], chunk.begin, slot.seq)
        slot.clock.image_s += engine.vision.encode_s - before[0]
        slot.clock.images_encoded += engine.vision.encoded - before[1]
        return outcome

    def _apply(self, plan: StepPlan, to_sample: list[tuple[Slot, int, list[int]]], started: float) -> list[Event]:
        """The pass was evaluated: the chunks' slots move on, each slot samples, finished answers end."""
        now = time.perf_counter()
        elapsed = now - started
        engine, kv = self.engine, self.engine.kv
        for chunk in plan.prompt_chunks:
            slot = chunk.slot
            slot.prefilled = chunk.end
            slot.prefill_passes += 1
            if slot.prefill_threads is None:
                slot.prefill_threads = engine.n_threads  # (the pass's: adapt_threads comes after it)
            self.totals.prefill_tokens += chunk.end - chunk.begin
            if slot.prefilled == len(slot.prompt):
                slot.clock.prefill_done = now
            elif slot.prefilled == slot.split_at and not kv.checkpoint_here(slot.seq):
                slot.prefilled = slot.cached = 0  # llama.cpp refused its own state: evaluate the prompt again
        for chunk, row in self._scored:
            score_chunk(engine, chunk, row)
        n_passed = plan.n_tokens
        if not plan.prompt_chunks:
            self.speculation.cost.observe_pass(n_passed, elapsed)
        engine.adapt_threads(now)
        for planned in plan.decoding:
            planned.slot.draft_source = planned.draft_source
        events: list[Event] = []
        sampled = sum(self._sample(slot, first, draft, events, elapsed, n_passed, len(plan.decoding))
                      for slot, first, draft in to_sample)
        if not plan.prompt_chunks:
            self.totals.decode_steps_s += time.perf_counter() - started
            self.totals.decode_step_tokens += sampled
        for slot in [p.slot for p in plan.decoding] + [c.slot for c in plan.prompt_chunks]:
            if slot.answer.finish is not None:
                events += self.finish(slot, slot.answer.finish)
        return events

    def _drafts(self, decoding: list[Slot]) -> dict[int, tuple[list[int], int]]:
        candidates = []
        for slot in decoding:
            if slot.drafter is None:
                continue
            room = min(slot.options.max_draft, self.cells - slot.pos - 2, self.engine.n_ctx - slot.pos - 2)
            if slot.options.max_tokens:
                room = min(room, slot.options.max_tokens - slot.answer.n_out - 1)
            if room > 0:
                candidates.append(Candidate(slot.seq, slot.drafter, room))
        if not candidates:
            return {}
        return choose_drafts(candidates, len(decoding), self._batch.capacity, self.speculation)

    def _sample(self, slot: Slot, first: int, draft: list[int], events: list[Event], elapsed: float, n_batch: int,
                n_decoding: int) -> int:
        """Sample the slot's logits at `first`, then at each drafted position while the draft was right; the rest of
        the draft leaves the slot's cells. The number of tokens sampled."""
        sampler, answer, vocab, drafter = slot.sampler, slot.answer, self.engine.vocab, slot.drafter
        if answer.limit == 0:  # (a prompt scored, no answer asked for: echo with max_tokens 0)
            answer.finish = "length"
            return 0
        was_pending, before = slot.pending is not None, slot.pos
        i = 0
        while True:
            traced = None
            if slot.forced:
                token = slot.forced.pop(0)
                sampler.accept(token)
            else:
                self.sampling = slot  # (what a stalled step was doing: a server's watchdog asks)
                traced = None if slot.options.trace is None else sample_traced(sampler, vocab, first + i,
                                                                                slot.options.trace)
                token = sampler.sample(first + i) if traced is None else traced.token
                self.sampling = None
            now = time.perf_counter()  # (the token's time: its trace's and the clock's — the trace's first is the TTFT)
            if traced is not None:  # (its event, for the client to take before the text)
                self.traced.append((slot, token_trace(self.engine, slot, token, traced, now)))
            slot.sampled += 1
            n_top = slot.options.logprobs
            logprob = None if n_top is None else token_logprob(sampler.ctx, vocab, first + i, token, n_top)
            if slot.record is not None:
                slot.record.append((token, logprob))
            gained = answer.add(token, vocab.is_end_of_generation(token), vocab.answer_piece(token, slot.options.special),
                                logprob)
            slot.clock.token(now, bool(gained))
            events.extend((slot, event) for event in gained)
            if drafter is not None:
                drafter.appended(token)
            if answer.thinking_spent and not slot.thinking_closed and sampler.free:
                slot.forced, slot.thinking_closed = list(self._close_thinking()), True
            if answer.finish is not None or i == len(draft) or token != draft[i]:
                break
            i += 1
        slot.pending = token if answer.finish is None else None
        if draft:
            accepted = min(i, len(draft))
            slot.drafted += len(draft)
            slot.accepted += accepted
            self.totals.draft_tokens += len(draft)
            self.totals.accepted_tokens += accepted
            self.speculation.cost.observe_acceptance(slot.draft_source, len(draft), accepted)
            if accepted < len(draft):  # draft[i:] leaves the cells (positions after the last token kept)
                self.engine.kv.remove(slot.seq, before + 1 + i, -1)
        if drafter is not None and was_pending:
            cost = self.speculation.cost
            plain_s = cost.seconds(n_decoding) / n_decoding  # a token's share of a plain step of this size
            share_s = elapsed * (1 + len(draft)) / n_batch
            drafter.account(slot.draft_source, share_s, plain_s, i + 1, bool(draft), i == len(draft))
        return i + 1

    def _close_thinking(self) -> list[int]:
        """The tokens that close a think block and begin the answer (--think-budget), as this vocabulary writes them."""
        if self._closing is None:
            self._closing = self.engine.vocab.tokenize(f"\n{THINK_CLOSE}\n\n", add_special=False)
        return self._closing

    def _not_decoded(self, outcome: str, chunks: list[Chunk]) -> list[Event]:
        """The pass was not evaluated (`full`: nothing of it; `aborted`: what llama.cpp stored stays, as the engine
        recorded it)."""
        if outcome == "aborted":
            for chunk in chunks:
                chunk.slot.prefilled = max(chunk.slot.cached, self.engine.kv.n_held(chunk.slot.seq))
            return self.finish_all("interrupted")
        if self.cells < self.engine.n_ctx:
            self.grow()
            return []
        return self.finish_all("context_full")

    def grow(self, at_least: int = 0) -> None:
        """A sequence outgrew its cells: make each one's cells twice as many (`at_least` this many; at most the
        context), every sequence's state copied as it is (`Engine.grow_to`): the answers do not change."""
        engine = self.engine
        if self.cells >= engine.n_ctx:
            raise LlmcliError(f"the KV cache is full ({engine.n_ctx} tokens a sequence)", hint="Use a larger --ctx-size.")
        engine.grow_to(max(2 * self.cells, at_least))
        self.cells = engine.kv.n_ctx
        for slot in self.slots:
            if slot is not None:
                slot.sampler.ctx = engine.llama_context  # the old context, whose logits it read, is freed
        self.totals.grown += 1

    def reserve(self, n_tokens: int) -> None:
        """Before a prompt: cells for `n_tokens` in each sequence (a cache sized to its work grows once to fit a
        long prompt and its answer's room, not pass by pass)."""
        if n_tokens > self.cells and self.cells < self.engine.n_ctx:
            self.grow(n_tokens)


_NO_DRAFT: list[int] = []
SCORED_FLOATS = 1 << 24  # a scored prompt's logits kept at once (64 MiB: 341 rows of SmolLM2's, 64 of Gemma 3's)

