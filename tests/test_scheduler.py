"""The scheduler's decisions (plan → pass → apply), in milliseconds: a fake engine that records what it is asked,
real slots, real answers, real drafters. What a plan holds — chunks, the room drafts have, the fast path — what a
full cache does (grow, or end the answers), and how a shared prefix is copied into a slot. The real engine runs the
same code in every CLI test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from llmcli.answer.generation import Answer, GenerationOptions
from llmcli.answer.stats import AnswerClock
from llmcli.decode.scheduler import Scheduler
from llmcli.decode.speculative import Drafter
from llmcli.decode.step_plan import Slot


@dataclass
class FakeKv:
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    checkpoints: dict[int, Any] = field(default_factory=dict)
    n_ctx: int = 1024  # cells each sequence has

    def keep_prefix(self, prompt: list[int], seq: int, at_least: int) -> int:
        self.calls.append(("keep_prefix", seq))
        return 0

    def remove(self, seq: int, start: int = 0, end: int = -1) -> bool:
        self.calls.append(("remove", seq, start, end))
        return True

    def copy(self, source: int, target: int) -> None:
        self.calls.append(("copy", source, target))

    def tokens_of(self, seq: int) -> list[int]:
        return [seq]

    def state_of(self, seq: int) -> bytes:
        return b"state"

    def load_state(self, seq: int, state: bytes) -> bool:
        self.calls.append(("load_state", seq))
        return True

    def appended(self, tokens: list[int], seq: int = 0) -> None:
        self.calls.append(("appended", seq, list(tokens)))


@dataclass
class FakeSampler:
    seed: int = 0
    ctx: Any = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeConfig:
    n_batch: int = 64


@dataclass
class FakeEngine:
    n_ctx: int = 1024
    config: FakeConfig = field(default_factory=FakeConfig)
    kv: FakeKv = field(default_factory=FakeKv)
    n_threads: int = 1
    grown: list[int] = field(default_factory=list)
    llama_context: Any = None

    def sampler(self, sampling: Any, seed: int, observed: bool = False) -> FakeSampler:
        return FakeSampler(seed)

    def grow_to(self, n_cells: int) -> None:  # (the real one copies every sequence's state into a new context)
        self.grown.append(n_cells)
        self.kv.n_ctx = min(-(-n_cells // 256) * 256, self.n_ctx)
        self.llama_context = f"context of {self.kv.n_ctx} cells"


def scheduler(n_slots: int = 2, cells: int = 0, n_batch: int = 64, **kwargs: Any) -> Scheduler:
    return Scheduler(FakeEngine(config=FakeConfig(n_batch)), n_slots, cells=cells, **kwargs)  # type: ignore[arg-type]


def slot(sched: Scheduler, seq: int, prompt_len: int, *, prefilled: int = 0, pending: int | None = None,
         speculate: str = "off", split_at: int | None = None, prompt: list[int] | None = None) -> Slot:
    options = GenerationOptions(speculate=speculate)
    tokens = prompt or list(range(100, 100 + prompt_len))
    made = Slot(seq, tokens, options, FakeSampler(), Answer(options, len(tokens), sched.engine.n_ctx), AnswerClock(),
                Drafter.for_mode(speculate, tokens, None), 0, prefilled, split_at, pending=pending)  # type: ignore[arg-type]
    if pending is not None:
        made.answer.n_out = 1  # the pending token is the answer's first
        if made.drafter is not None:
            made.drafter.appended(pending)
    sched.slots[seq] = made
    return made


def test_prompts_are_cut_into_chunks_that_fill_the_pass_the_fewest_left_first_and_the_plan_changes_nothing():
    """The prompt with the fewest tokens left goes first (a nearly cached request answers beside a long prefill:
    test_serve.py), the others fill the room left."""
    sched = scheduler(n_batch=64)
    first, second = slot(sched, 0, 100), slot(sched, 1, 30)
    plan = sched.plan()
    assert [(c.slot.seq, c.begin, c.end) for c in plan.chunks] == [(1, 0, 30), (0, 0, 34)] and not plan.decoding
    assert first.prefilled == second.prefilled == 0 and plan.n_tokens == 64  # a plan decides; it moves nothing
    first.prefilled = 90  # (now the first has fewer left: 10 against 30)
    plan = sched.plan()
    assert [(c.slot.seq, c.begin, c.end) for c in plan.chunks] == [(0, 90, 100), (1, 0, 30)]
    assert second.prefilled == 0


def test_a_chunk_ends_where_a_saved_state_will_end():
    sched = scheduler(n_slots=1, n_batch=64)
    slot(sched, 0, 50, split_at=20)
    assert [(c.begin, c.end) for c in sched.plan().chunks] == [(0, 20)]
    sched.slots[0].prefilled = 20  # type: ignore[union-attr]
    assert [(c.begin, c.end) for c in sched.plan().chunks] == [(20, 50)]


def test_decoding_slots_come_first_and_draft_only_when_no_prompt_is_being_evaluated():
    sched = scheduler(n_batch=64)
    repeated = [5, 6, 7, 8] * 10  # a lookup drafter finds what followed
    slot(sched, 0, 40, prefilled=40, pending=5, speculate="lookup", prompt=repeated)
    slot(sched, 1, 100)
    plan = sched.plan()
    assert [p.slot.seq for p in plan.decoding] == [0] and plan.decoding[0].draft == []
    assert [(c.slot.seq, c.begin, c.end) for c in plan.chunks] == [(1, 0, 63)]  # the room the pending token left
    sched.slots[1] = None
    plan = sched.plan()
    assert plan.decoding[0].draft[:3] == [6, 7, 8] and not plan.single  # lookup mode always drafts


def test_a_draft_never_reaches_past_the_cells_or_the_answer_s_limit():
    sched = scheduler(n_slots=1, cells=44, n_batch=64)
    repeated = [5, 6, 7, 8] * 10
    near_end = slot(sched, 0, 40, prefilled=40, pending=5, speculate="lookup", prompt=repeated)
    plan = sched.plan()
    assert len(plan.decoding[0].draft) <= 44 - near_end.pos - 2
    near_end.prefilled = 42  # the pending token sits at the cells' last but one: no room for a draft
    assert sched.plan().single


def test_one_answer_alone_takes_the_fast_path():
    sched = scheduler(n_slots=1)
    slot(sched, 0, 10, prefilled=10, pending=3)
    plan = sched.plan()
    assert plan.single and plan.n_tokens == 1 and [p.slot.seq for p in plan.decoding] == [0]
    other = scheduler(n_slots=2)
    slot(other, 1, 10, prefilled=10, pending=3)
    assert not other.plan().single  # not sequence 0: a batch with its positions


def test_a_full_cache_grows_when_the_cells_were_sized_to_the_work_and_ends_the_answers_when_it_is_the_context():
    sched = scheduler(n_slots=2, cells=256)
    first, second = slot(sched, 0, 10, prefilled=10, pending=3), slot(sched, 1, 10, prefilled=10, pending=4)
    assert sched._not_decoded("full", []) == []
    engine = sched.engine
    assert sched.cells == 512 and engine.grown == [512] and sched.totals.grown == 1  # type: ignore[attr-defined]
    assert first.sampler.ctx == second.sampler.ctx == "context of 512 cells"  # the old context is freed
    sched.reserve(600)  # a prompt and its room: grown once to fit, not pass by pass
    assert sched.cells == 1024 and engine.grown == [512, 1024]  # type: ignore[attr-defined]
    sched.reserve(1000)
    assert engine.grown == [512, 1024]  # type: ignore[attr-defined]
    sched.reserve(5000)  # more than the context: the answer ends at it (context_full), the cache stays the context's
    assert engine.grown == [512, 1024]  # type: ignore[attr-defined]
    sched.cells = engine.n_ctx
    events = sched._not_decoded("full", [])
    assert [event.finish_reason for _, event in events if hasattr(event, "finish_reason")] == ["context_full"] * 2
    assert sched.slots == [None, None]


@pytest.mark.parametrize("shared", [0, 12])
def test_a_shared_prefix_is_copied_into_a_slot_before_its_own_tokens(shared):
    sched = scheduler(n_slots=2, prefix_seq=2, keep_cells=False)
    started = sched.start(1, list(range(30)), GenerationOptions(), seed=0, shared=shared)
    kv = sched.engine.kv.calls  # type: ignore[attr-defined]
    if shared:
        assert kv[:2] == [("remove", 1, 0, -1), ("copy", 2, 1)] and started.cached == started.prefilled == 12
        assert [(c.begin, c.end) for c in sched.plan().chunks] == [(12, 30)]
    else:
        assert kv == [("keep_prefix", 1)] and started.cached == 0
