"""`serve`: the one scheduler fed by a thread-safe queue — requests arrive at any time and share its slots.

`SlotServer.run` is the engine's only thread. It admits waiting requests into free slots and runs the
scheduler's steps (the pending token of every answering slot and the drafts that pay — speculative
decoding — then prompt chunks of newly admitted requests in the room left), handing each step's events to
`deliver` at once. A request whose client went away (`Job.cancelled`) leaves its slot at the next step; when
every slot is busy, requests wait in a bounded queue (`submit` raises `QueueFull` beyond it).

Each slot is one sequence of a non-unified KV cache of a whole context each, so an answer's numbers do not
depend on its neighbours, and it never needs more cells than its slot has (at the context it ends with
context_full, as a single answer does). A server that grows (one that exits when idle: a warm server) starts its
slots small and gives them cells as a request needs them (`Scheduler.reserve` before its prompt goes in, `grow` when
an answer outgrows them: every slot's cells copied as they are), a whole context at most.

A slot keeps its sequence's cache after a request ends: the next request whose prompt shares a prefix with it (a
chat client resending the conversation) evaluates only the rest, and is placed in the free slot that shares the
most. A request that shares more with the prompt of an answer in progress (MIN_COPY tokens or more: requests sent at
once with one system prompt) is given a copy of that answer's cells for them, waiting while they are still being
evaluated: the shared part is evaluated once. A free slot given to another prompt keeps what it held: the cells it
would lose (another conversation: an agent's earlier session, a chat left for another) are saved in memory first
(kept_states.py), and a later prompt that goes on from a kept state is given it back rather than evaluating it
again.

It never prints.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.context_budget import answer_room
from llmcli.answer.events import DecodeEvent, Done, Prefill, TokenLogprob, TokenTrace
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.shared_prefix import shared_prefix
from llmcli.answer.stats import AnswerClock
from llmcli.decode.kept_states import KEPT_MIB, MIB, KeptStates
from llmcli.decode.prompt_cache import PromptCache
from llmcli.decode.scheduler import Scheduler
from llmcli.decode.speculative import Speculation
from llmcli.decode.step_plan import Slot
from llmcli.errors import ContextLost, LlmcliError
from llmcli.llama.engine import Engine

# A slot's cache is reused for a prompt that shares at least this many tokens with it, or all of it (a prompt asked
# again). A shorter prefix (the template's first tokens, which every chat prompt has) saves under a millisecond,
# and its keys and values were computed in another prompt's batch: llama.cpp's numbers depend on the batch in their
# last bits, and greedy answers can part after a few tokens. Below it, a prompt is evaluated whole: the answer
# `llmcli run` gives.
MIN_REUSE = 32

# A request whose prompt shares at least this many tokens with the prompt of an answer in progress (an agent's
# requests sent at once, with one system prompt and one set of tools) is given that answer's cells for them instead
# of evaluating them again; while that answer is still evaluating them, the request waits for them.
MIN_COPY = 64


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


JobEvent = DecodeEvent | Prefill | TokenTrace  # what a job's answer says: its events, a long prompt's progress, a
# traced answer's tokens


@dataclass
class Job:
    """One request: its prompt tokens, how to answer, and where its events go (`emit`, called by `deliver`)."""

    tokens: list[int]
    generation: GenerationOptions
    seed: int
    emit: Callable[[JobEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    clock: AnswerClock = field(default_factory=AnswerClock)  # stamped from its arrival
    failure: Failure | None = None  # set before its Done when it failed
    stable: int | None = None  # where its prompt's standing part ends: its KV state is restored and saved there
    images: tuple[ImageInput, ...] = ()  # the pictures whose placeholder ids its prompt holds (prepared here first)
    resumed: tuple[tuple[int, TokenLogprob | None], ...] | None = None  # (not None: its sampled tokens are recorded)
    key: int = 0  # the client's number for it (a supervised engine's)


Delivery = Callable[[list[tuple["Job", JobEvent]]], None]


@dataclass(frozen=True)
class Failure:
    """Why a job failed: the request itself was `refused` (a grammar llama.cpp would not take), or the engine failed
    (each way in says it in its own terms: serve's 400 or 500)."""

    message: str
    refused: bool
    cause: LlmcliError | None = None  # llmcli's own error behind it (its hint and exit code go out with it)


def deliver_here(events: list[tuple[Job, JobEvent]]) -> None:
    for job, event in events:
        job.emit(event)


class SlotServer:
    """`deliver` receives each step's events at once, on the engine's thread: a server hands them to its event
    loop in one wake-up per step rather than one per token (the default calls each job's `emit` right away)."""

    def __init__(self, engine: Engine, n_slots: int, queue_size: int, deliver: Delivery = deliver_here,
                 speculation: Speculation | None = None, prompt_cache: PromptCache | None = None,
                 kept_mib: int = KEPT_MIB):
        self.engine, self.n_slots, self.queue_size = engine, n_slots, queue_size
        self.deliver = deliver
        self.on_step: Callable[[], None] | None = None  # after each step (a supervised engine says it is alive)
        self.on_admit: Callable[[Job], None] | None = None  # a job took a slot (before its first step)
        self.prompt_cache = prompt_cache  # long prompts' standing parts, kept across slots, unloads and restarts
        # what free slots held when another prompt took them (not for a sliding-window model: its cells past the window
        # are gone, any slot serves it)
        self.kept = KeptStates(kept_mib * MIB) if kept_mib > 0 and engine.n_swa == 0 else None
        self.scheduler = Scheduler(engine, n_slots, speculation or Speculation())
        self._events: list[tuple[Job, JobEvent]] = []
        self.waiting: deque[Job] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.served = 0
        self.steps_by_busy: dict[int, int] = {}  # decode steps by the number of answers they advanced together

    # -- the request side (any thread) --------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._wake:
            self._check_room()
            self.waiting.append(job)
            self._wake.notify()

    def admit(self) -> None:
        """QueueFull now if a request would be refused (before its images are decoded: the queue's limits first)."""
        with self._wake:
            self._check_room()

    def _check_room(self) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        busy = sum(1 for slot in self.scheduler.slots if slot is not None)
        waiting = sum(1 for job in self.waiting if not job.cancelled.is_set())  # (a client that left holds no place,
        if busy + waiting >= self.n_slots + self.queue_size:  # though its job leaves the queue at the next admission)
            raise QueueFull(f"all {self.n_slots} slots are busy and {waiting} requests wait")

    def stop(self) -> None:
        """Finish: requests still waiting are cancelled; the loop ends once the slots are empty."""
        with self._wake:
            self._stopping = True
            for job in self.waiting:
                job.cancelled.set()
            self._wake.notify()

    def cancel_all(self) -> None:
        """Every answer ends (as `interrupted`, with its Done) at the next step: the server is stopping."""
        with self._wake:
            for job in [*self.waiting, *(slot.tag for slot in self.scheduler.slots if slot is not None)]:
                job.cancelled.set()
            self._wake.notify()

    def status(self) -> dict[str, Any]:
        with self._wake:
            busy = sum(1 for slot in self.scheduler.slots if slot is not None)
            found = {"slots": self.n_slots, "busy": busy, "waiting": len(self.waiting), "served": self.served,
                     "steps_by_busy": {str(n): steps for n, steps in sorted(self.steps_by_busy.items())}}
            if self.kept is not None:
                found["kept"] = {"states": len(self.kept), "bytes": self.kept.held_bytes, "given_back": self.kept.given_back}
            return found

    # -- the engine's thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `stop`; between busy periods the thread sleeps and holds no share of the cores."""
        engine, scheduler = self.engine, self.scheduler
        try:
            with ExitStack() as busy_period:
                busy = False
                while True:
                    with self._wake:
                        while not self._stopping and not self.waiting and not scheduler.busy:
                            if busy:
                                busy_period.close()  # idle: other llmcli processes may use every core
                                busy = False
                            if not self._wake.wait(engine.load_read_s):
                                engine.read_load()  # idle: the next busy period's first pass is decided on now
                        if self._stopping and not scheduler.busy:
                            self.deliver([(job, _cancelled(job)) for job in self.waiting])
                            self.waiting.clear()
                            return
                        self._admit()
                        together = sum(1 for slot in scheduler.slots if slot is not None)
                        self.steps_by_busy[together] = self.steps_by_busy.get(together, 0) + 1
                    if not busy:
                        busy_period.enter_context(engine.sharing_cores())
                        busy = True
                    self._drop_cancelled()
                    try:
                        stepped = scheduler.step()
                        if scheduler.traced:  # (traced answers' tokens, before their text)
                            self._events += [(slot.tag, trace) for slot, trace in scheduler.traced]
                            scheduler.traced.clear()
                        self._take(stepped)
                    except ContextLost:  # (an answer outgrew its cells, and no cache is left at all: this engine
                        raise  # ends — a server's supervisor starts another, where these answers go on)
                    except Exception as exc:  # llama.cpp failed a step: those answers fail, the server goes on
                        self._fail_all(str(exc))
                    self._progress()
                    if self._events:
                        events, self._events = self._events, []
                        self.deliver(events)
                    elif self.on_step is not None:
                        self.on_step()
        finally:
            scheduler.close()

    def _admit(self) -> None:
        """Waiting jobs into free slots: each into the free slot whose cache shares most of its prompt, or with the
        cells of an answer in progress whose prompt shares more (MIN_COPY; a job waits while they are evaluated)."""
        scheduler = self.scheduler
        held: list[Job] = []
        while self.waiting:
            free = scheduler.free_sequences()
            if not free:
                break
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                self._events.append((job, _cancelled(job)))
                continue
            try:  # (a cache sized to its work — a server that grows: cells for the prompt and its answer's room first)
                scheduler.reserve(len(job.tokens) + answer_room(job.generation.max_tokens, self.engine.n_ctx))
            except LlmcliError as exc:  # (the memory for them is gone: this request fails, the server goes on)
                job.failure = Failure(exc.message, refused=False, cause=exc)
                self._events.append((job, _cancelled(job)))
                if isinstance(exc, ContextLost):  # (and no cache is left at all: its failure said, this engine ends —
                    self.deliver(self._events)  # a server's supervisor starts another, where the answers go on)
                    self._events = []
                    raise
                continue
            kv = self.engine.kv  # (read after the reservation: a cache that grew is another one)
            if self.engine.n_swa == 0:  # a sliding-window cache holds only its last window: any slot will do
                free.sort(key=lambda seq: -shared_prefix(kv.tokens_of(seq), job.tokens))
                source, shared = self._answering_with(job.tokens)
                if source is not None and shared > shared_prefix(kv.tokens_of(free[0]), job.tokens):
                    if source.prefilled < shared:
                        held.append(job)  # its cells are being evaluated: after a step or a few
                        continue
                    self._keep(free[0], job.tokens)
                    kv.remove(free[0])
                    kv.copy(source.seq, free[0])
                    kv.remove(free[0], shared, -1)
                else:
                    free[0] = self._spared(free, job.tokens)
                    self._given_back(free[0], job.tokens)
            if self.prompt_cache is not None and job.stable is not None:  # (when the slot holds less of it)
                self.prompt_cache.restore(job.tokens, job.stable, free[0], make_room=scheduler.reserve)
            try:
                if job.images:  # (their placeholder ids are their contents': the ones the prompt holds)
                    vision = self.engine.load_vision()
                    for image in job.images:
                        vision.tokenize(image)
                resumed = job.resumed
                tokens = job.tokens if not resumed else [*job.tokens, *(token for token, _ in resumed)]
                scheduler.start(free[0], tokens, job.generation, job.seed, job.clock, tag=job,
                                split_at=job.stable, reuse_at_least=MIN_REUSE, resumed=resumed)
                if self.on_admit is not None:
                    self.on_admit(job)
            except Exception as exc:  # a grammar llama.cpp refuses: the request fails, the server goes on
                job.failure = Failure(str(exc), refused=True)
                self._events.append((job, _cancelled(job)))
        self.waiting.extendleft(reversed(held))

    def _spared(self, free: list[int], prompt: list[int]) -> int:
        """The free sequence a prompt takes, `free` sorted by the prefix each shares with it: the one sharing most —
        unless its cells go on past what they share (another conversation: an agent's earlier session, whose next
        turn would evaluate them all again) and another free sequence would lose fewer: that one is given a copy of
        the shared prefix, and the conversation stays whole where it is."""
        kv = self.engine.kv
        best = free[0]
        shared = shared_prefix(kv.tokens_of(best), prompt)
        lost = kv.n_held(best) - shared
        if shared < MIN_COPY or lost < MIN_REUSE or len(free) < 2:
            return best
        spare = min(free[1:], key=lambda seq: kv.n_held(seq) - shared_prefix(kv.tokens_of(seq), prompt))
        if kv.n_held(spare) - shared_prefix(kv.tokens_of(spare), prompt) >= lost:
            return best
        self._keep(spare, prompt)
        kv.remove(spare)
        kv.copy(best, spare)
        kv.remove(spare, shared, -1)
        return spare

    def _keep(self, seq: int, prompt: list[int]) -> None:
        """Before free sequence `seq` is given to `prompt`: its state kept, when it holds MIN_REUSE tokens or more past
        the part of it the prompt will reuse (and fits the budget at all: its size asked before it is copied)."""
        kv = self.engine.kv
        if self.kept is None:
            return
        shared = shared_prefix(kv.tokens_of(seq), prompt)
        if kv.n_held(seq) - (shared if shared >= MIN_REUSE else 0) >= MIN_REUSE and kv.seq_bytes(seq) <= self.kept.budget:
            self.kept.keep(*kv.save_state(seq))

    def _given_back(self, seq: int, prompt: list[int]) -> None:
        """Free sequence `seq`, given to `prompt`: what it held kept (_keep), then replaced by a kept state sharing
        MIN_REUSE tokens more of the prompt (all but its last token at most: its logits are needed)."""
        kept, kv = self.kept, self.engine.kv
        if kept is None:
            return
        usable = len(prompt) - 1
        held = kv.shared_prefix(prompt[:usable], seq)
        self._keep(seq, prompt)  # (first: keeping it may give up others; it shares only `held` itself)
        found = kept.best(prompt[:usable], (held if held >= MIN_REUSE else 0) + MIN_REUSE)
        if found is None:
            return
        key, state, shared = found
        try:
            self.scheduler.reserve(len(state.tokens))  # (a cache sized to its work: the state's cells, all of them)
        except ContextLost:
            raise  # (no cache left at all: _admit's)
        except LlmcliError:  # (no memory for them now: the prompt is evaluated, as without the state)
            kept.refused(key)
            return
        kv = self.engine.kv
        if not kv.restore_state(state.tokens, state.payload, seq):
            kept.refused(key)  # (the sequence is empty: the prompt is evaluated whole)
            return
        kept.used(key, whole=shared == len(state.tokens))
        if shared < len(state.tokens):
            kv.remove(seq, shared, -1)

    def _answering_with(self, prompt: list[int]) -> tuple[Slot | None, int]:
        """The answer in progress whose prompt shares the most of `prompt` (all but its last token at most: its
        logits are needed), when that is MIN_COPY tokens or more, and how many."""
        best, most = None, 0
        for slot in self.scheduler.slots:
            if slot is not None and not slot.finished:
                shared = min(shared_prefix(slot.prompt, prompt), len(prompt) - 1)
                if shared > most:
                    best, most = slot, shared
        return (best, most) if most >= MIN_COPY else (None, 0)

    def _drop_cancelled(self) -> None:
        for slot in self.scheduler.slots:
            if slot is not None and slot.tag.cancelled.is_set():
                self._take(self.scheduler.finish(slot, "interrupted"))

    def _take(self, events: list[tuple[Any, DecodeEvent]]) -> None:
        for slot, event in events:
            self._events.append((slot.tag, event))
            if isinstance(event, Done):
                self.served += 1
                if self.prompt_cache is not None and slot.split_at is not None and event.finish_reason != "interrupted":
                    self.prompt_cache.save(event.stats.prefill_tokens, slot.split_at, slot.seq)  # (its cells, as left)
                    self.prompt_cache.take_notices()  # (a damaged entry was removed: nothing to tell a client)

    def _progress(self) -> None:
        """A prompt evaluated in chunks: after each chunk, how far it is (as run's Prefill events), for a stream that
        shows it (a warm run's progress line)."""
        for slot in self.scheduler.slots:
            if slot is not None and not slot.finished and slot.cached < slot.prefilled < len(slot.prompt):
                total = len(slot.prompt) - slot.cached
                self._events.append((slot.tag, Prefill(slot.prefilled - slot.cached, total, len(slot.prompt))))

    def _fail_all(self, reason: str) -> None:
        for slot in self.scheduler.slots:
            if slot is not None:
                slot.tag.failure = Failure(f"the engine failed: {reason}", refused=False)
        self._take(self.scheduler.finish_all("interrupted"))
        self.engine.kv.clear()


def _cancelled(job: Job) -> Done:
    """The Done of a request that never started."""
    return Done("interrupted", job.clock.stats(prompt_tokens=len(job.tokens)))
