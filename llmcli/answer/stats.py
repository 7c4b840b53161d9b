"""The timing record of one answer (`Stats`), the one place it is built (`AnswerClock`), the rates derived from
it, and its one-line summary."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from llmcli.answer.finish import described


@dataclass(frozen=True)
class Stats:
    load_s: float  # model load (0 when the model was already loaded)
    prompt_s: float  # template rendering + tokenization
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # of those, reused from the KV cache (not evaluated again)
    prefill_tokens: int  # of those, evaluated now (fewer than the rest when interrupted)
    prefill_s: float  # evaluating the new prompt tokens
    ttft_s: float  # request -> first token of the answer (prompt + prefill + first sample)
    completion_tokens: int  # tokens of the answer (the end-of-generation token not counted)
    decode_steps: int  # tokens sampled after the first, each needing one decode
    decode_s: float  # first token sampled -> last token sampled
    total_s: float  # request -> done
    seed: int | None = None
    threads: int | None = None  # llama.cpp threads at the end (shared with other llmcli processes unless --threads)
    prefill_threads: int | None = None  # ... when the prompt's evaluation began (None: nothing was evaluated)
    restored_tokens: int = 0  # of the cached ones, loaded from the prompt cache on disk for this answer
    restore_s: float = 0.0  # finding, checking and loading that saved state (part of the TTFT)
    draft_tokens: int = 0  # speculative decoding: tokens drafted and verified
    accepted_tokens: int = 0  # of those, the ones the model agreed with (each saved a pass)
    reasoning_tokens: int = 0  # of the completion, the tokens of the think block (--think-budget bounds them)
    warm: bool = False  # answered by a warm server that had the model loaded already (no load was waited for)
    images: int = 0  # images in the prompt
    images_encoded: int = 0  # of those, encoded for this answer (the others' embeddings or KV cells were reused)
    image_s: float = 0.0  # encoding them (part of the prefill)
    kv_cells: int | None = None  # the KV cache's cells for this answer's sequence at its end (run and chat size it to
    # the work: it grows with the conversation; a server's slots hold their whole context); None: not a local answer

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def then(self, later: Stats) -> Stats:
        """This pass and a later one of the same answer (the rounds of a tool loop) as one: the later pass's prompt
        (the whole conversation by then), the first's load and time to first token, everything else added up."""
        return Stats(
            load_s=self.load_s + later.load_s, prompt_s=self.prompt_s + later.prompt_s,
            prompt_tokens=later.prompt_tokens, cached_tokens=later.cached_tokens,
            prefill_tokens=self.prefill_tokens + later.prefill_tokens, prefill_s=self.prefill_s + later.prefill_s,
            ttft_s=self.ttft_s, completion_tokens=self.completion_tokens + later.completion_tokens,
            decode_steps=self.decode_steps + later.decode_steps, decode_s=self.decode_s + later.decode_s,
            total_s=self.total_s + later.total_s, seed=later.seed, threads=later.threads,
            prefill_threads=self.prefill_threads if self.prefill_threads is not None else later.prefill_threads,
            restored_tokens=self.restored_tokens + later.restored_tokens, restore_s=self.restore_s + later.restore_s,
            draft_tokens=self.draft_tokens + later.draft_tokens, accepted_tokens=self.accepted_tokens + later.accepted_tokens,
            reasoning_tokens=self.reasoning_tokens + later.reasoning_tokens, warm=self.warm,
            images=later.images, images_encoded=self.images_encoded + later.images_encoded,
            image_s=self.image_s + later.image_s, kv_cells=later.kv_cells,
        )

    def to_dict(self) -> dict[str, float | int | None]:
        record: dict[str, float | int | None] = asdict(self)
        record["prefill_tokens_per_s"] = round(self.prefill_tps, 2)
        record["decode_tokens_per_s"] = round(self.decode_tps, 2)
        record["acceptance"] = round(self.acceptance, 4)
        return record


@dataclass
class AnswerClock:
    """The moments of one answer, stamped as they happen (perf_counter seconds), and its `Stats` from them: the
    scheduler's slots, a request that never started and a remote answer all build their stats here."""

    submitted: float = field(default_factory=time.perf_counter)  # the request: TTFT counts template and tokenizing
    load_s: float = 0.0  # the model load this answer waited for (reported once, with a session's first answer)
    prompt_s: float = 0.0  # template rendering + tokenization
    prefill_started: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None  # the first token sampled
    first_text: float | None = None  # the first text shown (a character held back for UTF-8 or a stop comes later)
    last_token: float | None = None
    images: int = 0  # images in the prompt
    images_encoded: int = 0  # ... encoded for this answer
    image_s: float = 0.0  # ... and the seconds that took

    def token(self, now: float, shown: bool) -> None:
        """A token was sampled at `now`; `shown`: it completed text of the answer (or its reasoning)."""
        if self.first_token is None:
            self.first_token = now
        if shown and self.first_text is None:
            self.first_text = now
        self.last_token = now

    def stats(self, *, prompt_tokens: int, cached_tokens: int = 0, prefill_tokens: int = 0, completion_tokens: int = 0,
              decode_steps: int = 0, seed: int | None = None, threads: int | None = None,
              prefill_threads: int | None = None, draft_tokens: int = 0, accepted_tokens: int = 0,
              reasoning_tokens: int = 0, kv_cells: int | None = None) -> Stats:
        now = time.perf_counter()
        first = self.first_token or now
        prefill_end = self.prefill_done or first
        return Stats(
            load_s=self.load_s, prompt_s=self.prompt_s, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            prefill_tokens=prefill_tokens,
            prefill_s=prefill_end - self.prefill_started if self.prefill_started is not None else 0.0,
            ttft_s=(self.first_text or first) - self.submitted, completion_tokens=completion_tokens,
            decode_steps=decode_steps, decode_s=(self.last_token or first) - first if decode_steps else 0.0,
            total_s=now - self.submitted, seed=seed, threads=threads, prefill_threads=prefill_threads,
            draft_tokens=draft_tokens,
            accepted_tokens=accepted_tokens, reasoning_tokens=reasoning_tokens, images=self.images,
            images_encoded=self.images_encoded, image_s=self.image_s, kv_cells=kv_cells,
        )


def summary_line(stats: Stats, finish_reason: str, stop_sequence: str | None = None) -> str:
    """`load 0.21 s · prompt 38 tok @ 610 tok/s · TTFT 0.07 s · 96 tok @ 142 tok/s · stop: eos` (`warm · prompt …`: a
    warm server had the model loaded)."""
    parts = ["warm"] if stats.warm else []
    if stats.load_s > 0:
        parts.append(f"load {stats.load_s:.2f} s")
    if stats.prompt_tokens:  # (0: a server that was cut off before it said)
        notes = [f"{stats.cached_tokens} cached"] if stats.cached_tokens else []
        if stats.cached_tokens + stats.prefill_tokens < stats.prompt_tokens:  # stopped while it was evaluated
            notes.append(f"{stats.prefill_tokens} of {stats.prompt_tokens - stats.cached_tokens} evaluated")
        prompt = f"prompt {stats.prompt_tokens} tok" + (f" ({', '.join(notes)})" if notes else "")
        if stats.prefill_tokens:
            prompt += f" @ {stats.prefill_tps:.0f} tok/s"
        parts.append(prompt)
    if stats.images:
        encoded = f"{stats.images_encoded} encoded in {stats.image_s:.2f} s" if stats.images_encoded else "cached"
        parts.append(f"{stats.images} image{'' if stats.images == 1 else 's'} ({encoded})")
    if stats.completion_tokens:  # a time to the first token needs one
        parts.append(f"TTFT {stats.ttft_s:.2f} s")
    answer = f"{stats.completion_tokens} tok"
    if stats.decode_steps:
        answer += f" @ {stats.decode_tps:.1f} tok/s"
    if stats.draft_tokens:
        answer += f" ({stats.accepted_tokens}/{stats.draft_tokens} drafted accepted, {100 * stats.acceptance:.0f}%)"
    parts.append(answer)
    parts.append(f"stop: {described(finish_reason, stop_sequence)}")
    return " · ".join(parts)
