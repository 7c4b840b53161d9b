"""Many prompts decoded together: parallel sequences in one llama.cpp context (continuous batching).

Decode reads every weight once per step whether it advances one sequence or eight, so N
slots share one context (one KV cache, one `seq_id` each). Every step builds one batch: the
next token of every decoding slot, then prompt chunks of newly scheduled slots in the room
left (so prefill rides along with the others' decode steps). A finished slot is cleared and
the next prompt takes it. Each prompt has its own sampler chain and seed, so with a seed its
answer does not depend on its slot or its neighbours (up to llama.cpp's batch numerics).

Like engine.py this module drives llama.cpp's C API directly; it never prints.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp

from llmcli.engine import Engine
from llmcli.errors import LlmcliError
from llmcli.interrupt import Cancellation
from llmcli.session import GenerationOptions, Session
from llmcli.streaming import AnswerText


@dataclass(frozen=True)
class BatchItem:
    index: int
    prompt: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # other JSONL fields, carried to the output
    error: str | None = None


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
            items.append(BatchItem(index, None, record if isinstance(record, dict) else {}, "no \"prompt\" string in the object"))
            continue
        items.append(BatchItem(index, prompt, record))
    return items


@dataclass
class _Slot:
    seq: int
    item: BatchItem
    tokens: list[int]
    chain: Any
    seed: int
    scheduled: float
    prefilled: int = 0
    pending: int | None = None  # the sampled token still to be decoded
    n_out: int = 0
    first_token: float | None = None
    parts: list[str] = field(default_factory=list)
    answer: AnswerText = field(default_factory=lambda: AnswerText(()))
    finish: str | None = None

    @property
    def pos(self) -> int:
        """Position of the pending token: right after the prompt and the tokens decoded so far."""
        return self.prefilled + self.n_out - 1


@dataclass
class Summary:
    prompts: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    decode_steps_s: float = 0.0  # time in steps that only decoded (no prompt chunk)
    decode_step_tokens: int = 0  # tokens sampled in those steps
    interrupted: bool = False

    @property
    def decode_tps(self) -> float:
        """Aggregate decode rate: tokens per second over all slots, in steps without prefill."""
        return self.decode_step_tokens / self.decode_steps_s if self.decode_steps_s > 0 else 0.0


class _Batch:
    """A llama_batch with explicit positions and sequence ids, reused every step."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        raw, i = self.raw, self.n
        raw.token[i], raw.pos[i], raw.n_seq_id[i], raw.logits[i] = token, pos, 1, int(logits)
        raw.seq_id[i][0] = seq
        self.n += 1
        raw.n_tokens = self.n
        return i

    def free(self) -> None:
        llama_cpp.llama_batch_free(self.raw)


def run_batch(
    engine: Engine,
    session: Session,
    items: list[BatchItem],
    generation: GenerationOptions,
    n_parallel: int,
    cancel: Cancellation,
    on_result: Callable[[int, dict[str, Any]], None],
    on_progress: Callable[[int, int, float], None] | None = None,
) -> Summary:
    """Answer every item; `on_result(index, record)` as each finishes (any order)."""
    summary = Summary(prompts=len(items))
    started = time.perf_counter()
    queue: deque[BatchItem] = deque()
    for item in items:
        if item.error is not None:
            summary.errors += 1
            on_result(item.index, {**item.extra, "index": item.index, "error": item.error})
        else:
            queue.append(item)
    slots: list[_Slot | None] = [None] * n_parallel
    batch = _Batch(max(engine.config.n_batch, n_parallel))
    ctx, vocab = engine._ctx, engine._vocab
    done = summary.errors
    try:
        while (queue or any(slots)) and not cancel:
            for seq in range(n_parallel):
                while slots[seq] is None and queue:
                    slots[seq] = _schedule(engine, session, queue.popleft(), generation, seq, on_result, summary)
                    done += slots[seq] is None
            batch.n = 0
            sampling_at: list[tuple[_Slot, int]] = []
            for slot in filter(None, slots):
                if slot.pending is not None:
                    sampling_at.append((slot, batch.add(slot.pending, slot.pos, slot.seq, True)))
            prefilling = False
            for slot in filter(None, slots):
                while slot.prefilled < len(slot.tokens) and batch.n < batch.capacity:
                    last = slot.prefilled == len(slot.tokens) - 1
                    index = batch.add(slot.tokens[slot.prefilled], slot.prefilled, slot.seq, last)
                    slot.prefilled += 1
                    prefilling = True
                    if last:
                        sampling_at.append((slot, index))
            if batch.n == 0:
                break
            step_started = time.perf_counter()
            rc = llama_cpp.llama_decode(ctx, batch.raw)
            if rc != 0:
                raise LlmcliError(f"llama.cpp failed while decoding a batch (code {rc})", hint="Try a smaller --parallel.")
            for slot, index in sampling_at:
                _advance(engine, slot, llama_cpp.llama_sampler_sample(slot.chain, ctx, index), vocab, generation)
            if not prefilling:
                summary.decode_steps_s += time.perf_counter() - step_started
                summary.decode_step_tokens += len(sampling_at)
            for seq, slot in enumerate(slots):
                if slot is not None and slot.finish is not None:
                    summary.completion_tokens += slot.n_out
                    on_result(slot.item.index, _record(slot))
                    _release(engine, slot)
                    slots[seq] = None
                    done += 1
            if on_progress is not None:
                elapsed = time.perf_counter() - started
                generated = summary.completion_tokens + sum(s.n_out for s in slots if s)
                on_progress(done, len(items), generated / elapsed if elapsed > 0 else 0.0)
    finally:
        for slot in filter(None, slots):
            slot.finish = "interrupted"
            summary.completion_tokens += slot.n_out
            on_result(slot.item.index, _record(slot))
            _release(engine, slot)
        for item in queue:
            on_result(item.index, {**item.extra, "index": item.index, "error": "interrupted before it started"})
        batch.free()
    summary.interrupted = bool(cancel)
    summary.wall_s = time.perf_counter() - started
    return summary


def _schedule(engine: Engine, session: Session, item: BatchItem, generation: GenerationOptions, seq: int,
              on_result: Callable[[int, dict[str, Any]], None], summary: Summary) -> _Slot | None:
    """Render and check one prompt; a slot for it, or None after writing its error record."""
    try:
        tokens = session.render(item.prompt or "").tokens
        engine.check_budget(len(tokens), generation.max_tokens)
    except LlmcliError as exc:
        summary.errors += 1
        on_result(item.index, {**item.extra, "index": item.index, "error": exc.message})
        return None
    seed = generation.sampling.effective_seed()
    summary.prompt_tokens += len(tokens)
    chain = generation.sampling.to_llama(llama_cpp, engine._vocab, seed)
    return _Slot(seq, item, tokens, chain, seed, time.perf_counter(), answer=AnswerText(generation.stops))


def _advance(engine: Engine, slot: _Slot, token: int, vocab: Any, generation: GenerationOptions) -> None:
    """One sampled token for `slot`: stop on end-of-generation, a stop sequence, -n or a full context."""
    slot.first_token = slot.first_token or time.perf_counter()
    if llama_cpp.llama_vocab_is_eog(vocab, token):
        slot.finish = "stop"
    else:
        slot.n_out += 1
        slot.parts.append(slot.answer.feed(engine.piece(token)))
        if slot.answer.stop is not None:
            slot.finish = "stop_sequence"
    if slot.finish is None and generation.max_tokens is not None and slot.n_out >= generation.max_tokens:
        slot.finish = "length"
    if slot.finish is None and len(slot.tokens) + slot.n_out >= engine.n_ctx:
        slot.finish = "context_full"
    slot.pending = token if slot.finish is None else None


def _record(slot: _Slot) -> dict[str, Any]:
    if slot.answer.stop is None:
        slot.parts.append(slot.answer.finish())
        if slot.answer.stop is not None:
            slot.finish = "stop_sequence"
    now = time.perf_counter()
    decode_s = now - slot.first_token if slot.first_token else 0.0
    return {
        **slot.item.extra,
        "index": slot.item.index,
        "text": "".join(slot.parts),
        "finish_reason": slot.finish,
        "stop_sequence": slot.answer.stop,
        "usage": {"prompt_tokens": len(slot.tokens), "completion_tokens": slot.n_out},
        "timings": {
            "ttft_s": round((slot.first_token or now) - slot.scheduled, 4),
            "total_s": round(now - slot.scheduled, 4),
            "decode_tokens_per_s": round((slot.n_out - 1) / decode_s, 2) if slot.n_out > 1 and decode_s > 0 else 0.0,
            "seed": slot.seed,
        },
    }


def _release(engine: Engine, slot: _Slot) -> None:
    llama_cpp.llama_sampler_free(slot.chain)
    llama_cpp.llama_memory_seq_rm(engine._memory, slot.seq, -1, -1)


def in_order(write: Callable[[dict[str, Any]], None]) -> Callable[[int, dict[str, Any]], None]:
    """Results arrive in any order; `write` sees them in input order, each as soon as it can."""
    waiting: dict[int, dict[str, Any]] = {}
    next_index = [0]

    def accept(index: int, record: dict[str, Any]) -> None:
        waiting[index] = record
        while next_index[0] in waiting:
            write(waiting.pop(next_index[0]))
            next_index[0] += 1

    return accept
