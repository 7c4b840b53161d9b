"""Continuous batching for a server: requests arrive at any time and share one context's slots.

`SlotServer.run` is the engine's only thread. Each step builds one batch — the pending token of every
answering slot, then prompt chunks of newly admitted requests in the room left — decodes it, samples
each slot with its own chain and hands the text to the request's `emit` callback (called on this
thread). A request whose client went away (`Job.cancelled`) leaves its slot at the next step; when
every slot is busy, requests wait in a bounded queue (`submit` raises `QueueFull` beyond it).

Each slot is one sequence of a non-unified KV cache, so an answer's numbers do not depend on its
neighbours. A slot keeps its sequence's cache after a request ends: the next request whose prompt shares
a prefix with it (a chat client resending the conversation) evaluates only the rest, and is placed in the
slot that shares the most.

Built on the engine's public API; it never prints.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from llmcli.inference.batch import Batch
from llmcli.inference.engine import Engine
from llmcli.inference.events import Done, Token
from llmcli.inference.generation import Answer, GenerationOptions
from llmcli.inference.sampler import Sampler
from llmcli.inference.stats import Stats
from llmcli.store.prompt_store import shared_prefix


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


@dataclass
class Job:
    """One request: its prompt tokens, how to answer, and where its events go (`emit`, called by `deliver`)."""

    tokens: list[int]
    generation: GenerationOptions
    seed: int
    emit: Callable[[Token | Done], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    failure: tuple[int, str] | None = None  # set before its Done when it failed: (HTTP-like status, why)


@dataclass
class _Active:
    job: Job
    sampler: Sampler
    answer: Answer
    cached: int  # prompt tokens found in the slot's cache (not evaluated)
    admitted: float
    prefilled: int = 0  # prompt tokens in the cache now
    pending: int | None = None  # the sampled token still to be decoded
    sampled: int = 0
    first_token: float | None = None
    last_token: float | None = None


Delivery = Callable[[list[tuple["Job", Token | Done]]], None]


def deliver_here(events: list[tuple[Job, Token | Done]]) -> None:
    for job, event in events:
        job.emit(event)


class SlotServer:
    """`deliver` receives each step's events at once, on the engine's thread: a server hands them to its event
    loop in one wake-up per step rather than one per token (the default calls each job's `emit` right away)."""

    def __init__(self, engine: Engine, n_slots: int, queue_size: int, deliver: Delivery = deliver_here):
        self.engine, self.n_slots, self.queue_size = engine, n_slots, queue_size
        self.deliver = deliver
        self._events: list[tuple[Job, Token | Done]] = []
        self.active: list[_Active | None] = [None] * n_slots
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]  # what each slot's sequence holds, in order
        self.waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.served = 0

    # -- the request side (any thread) --------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            busy = sum(1 for slot in self.active if slot is not None)
            if busy + len(self.waiting) >= self.n_slots + self.queue_size:
                raise QueueFull(f"all {self.n_slots} slots are busy and {len(self.waiting)} requests wait")
            self.waiting.append(job)
            self._wake.notify()

    def stop(self) -> None:
        """Finish: requests still waiting are cancelled; the loop ends once the slots are empty."""
        with self._wake:
            self._stopping = True
            for job in self.waiting:
                job.cancelled.set()
            self._wake.notify()

    def status(self) -> dict[str, int]:
        with self._wake:
            busy = sum(1 for slot in self.active if slot is not None)
            return {"slots": self.n_slots, "busy": busy, "waiting": len(self.waiting), "served": self.served}

    # -- the engine's thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop`; between busy periods the thread sleeps and holds no share of the cores."""
        engine = self.engine
        with Batch(max(engine.config.n_batch, self.n_slots)) as batch, ExitStack() as busy_period:
            busy = False
            while True:
                with self._wake:
                    while not self._stopping and not self.waiting and not any(self.active):
                        if busy:
                            busy_period.close()  # idle: other llmcli processes may use every core
                            busy = False
                        self._wake.wait()
                    if self._stopping and not any(self.active):
                        self.deliver([(job, _cancelled(job)) for job in self.waiting])
                        self.waiting.clear()
                        return
                    self._admit()
                if not busy:
                    busy_period.enter_context(engine.sharing_cores())
                    busy = True
                self._drop_cancelled()
                try:
                    self._step(batch)
                except Exception as exc:  # llama.cpp failed a step: those answers fail, the server goes on
                    self._fail_all(str(exc))
                if self._events:
                    events, self._events = self._events, []
                    self.deliver(events)

    def _admit(self) -> None:
        """Waiting jobs into free slots: each into the free slot whose cache shares most of its prompt."""
        while self.waiting:
            free = [seq for seq, slot in enumerate(self.active) if slot is None]
            if not free:
                return
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                self._events.append((job, _cancelled(job)))
                continue
            reuse = self.engine.n_swa == 0  # a sliding-window cache holds only its last window: start over
            scores = {seq: min(shared_prefix(self.cached[seq], job.tokens), len(job.tokens) - 1) if reuse else 0
                      for seq in free}
            seq = max(free, key=lambda s: scores[s])
            keep = scores[seq]
            self.engine.kv.remove(seq, keep, -1)
            del self.cached[seq][keep:]
            try:
                sampler = self.engine.sampler(job.generation.sampling, job.seed)
            except Exception as exc:  # a grammar llama.cpp refuses: the request fails, the server goes on
                job.failure = (400, str(exc))
                self._events.append((job, _cancelled(job)))
                continue
            answer = Answer(job.generation, len(job.tokens), self.engine.n_ctx)
            self.active[seq] = _Active(job, sampler, answer, keep, time.perf_counter(), prefilled=keep)

    def _drop_cancelled(self) -> None:
        for seq, slot in enumerate(self.active):
            if slot is not None and slot.job.cancelled.is_set():
                self._finish(seq, slot, "interrupted")

    def _step(self, batch: Batch) -> None:
        """One decode: every answering slot's pending token, then prompt chunks in the room left."""
        batch.clear()
        sample_at: list[tuple[int, _Active, int]] = []
        evaluated: dict[int, list[int]] = {}
        for seq, slot in enumerate(self.active):
            if slot is not None and slot.pending is not None:
                sample_at.append((seq, slot, batch.add(slot.pending, slot.prefilled + slot.answer.n_out - 1, seq, True)))
                evaluated[seq] = [slot.pending]
        for seq, slot in enumerate(self.active):
            while slot is not None and slot.prefilled < len(slot.job.tokens) and not batch.full:
                last = slot.prefilled == len(slot.job.tokens) - 1
                index = batch.add(slot.job.tokens[slot.prefilled], slot.prefilled, seq, last)
                evaluated.setdefault(seq, []).append(slot.job.tokens[slot.prefilled])
                slot.prefilled += 1
                if last:
                    sample_at.append((seq, slot, index))
        if batch.n == 0:
            return
        if not self.engine.decode(batch, "serving"):
            for seq, slot in enumerate(self.active):  # no room in a slot's cells: that answer ends there
                if slot is not None:
                    self._finish(seq, slot, "context_full")
            return
        for seq, tokens in evaluated.items():
            self.cached[seq].extend(tokens)
        self.engine.adapt_threads(time.perf_counter())
        vocab = self.engine.vocab
        for seq, slot, index in sample_at:
            token = slot.sampler.sample(index)
            now = time.perf_counter()
            slot.first_token = slot.first_token or now
            slot.last_token = now
            slot.sampled += 1
            answer = slot.answer
            text = answer.add(token, vocab.is_end_of_generation(token), vocab.piece(token))
            if answer.thinking:
                self._events.append((slot.job, Token(answer.thinking, reasoning=True)))
            if text:
                self._events.append((slot.job, Token(text)))
            slot.pending = token if answer.finish is None else None
            if answer.finish is not None:
                self._finish(seq, slot, answer.finish)

    def _fail_all(self, reason: str) -> None:
        for seq, slot in enumerate(self.active):
            if slot is not None:
                slot.job.failure = (500, f"the engine failed: {reason}")
                self._finish(seq, slot, "interrupted")
        self.engine.kv.clear()
        self.cached = [[] for _ in range(self.n_slots)]

    def _finish(self, seq: int, slot: _Active, finish: str) -> None:
        answer = slot.answer
        text = answer.close()
        if answer.thinking:
            self._events.append((slot.job, Token(answer.thinking, reasoning=True)))
        if text:
            self._events.append((slot.job, Token(text)))
        now = time.perf_counter()
        first = slot.first_token or now
        stats = Stats(
            load_s=0.0, prompt_s=0.0, prompt_tokens=len(slot.job.tokens), cached_tokens=slot.cached,
            prefill_tokens=slot.prefilled - slot.cached, prefill_s=first - slot.admitted,
            ttft_s=first - slot.job.submitted, completion_tokens=answer.n_out, decode_steps=max(0, slot.sampled - 1),
            decode_s=(slot.last_token or first) - first, total_s=now - slot.job.submitted,
            seed=None if slot.job.generation.sampling.greedy else slot.job.seed, threads=self.engine.n_threads,
        )
        reason = answer.finish or finish
        self._events.append((slot.job, Done(reason, stats, answer.stop_sequence, answer.format_error(reason))))
        slot.sampler.close()
        self.active[seq] = None
        self.served += 1


def _cancelled(job: Job) -> Done:
    waited = time.perf_counter() - job.submitted
    stats = Stats(load_s=0.0, prompt_s=0.0, prompt_tokens=len(job.tokens), cached_tokens=0, prefill_tokens=0,
                  prefill_s=0.0, ttft_s=waited, completion_tokens=0, decode_steps=0, decode_s=0.0, total_s=waited)
    return Done("interrupted", stats)
