"""Bench rows for the KV cache across runs and its type: TTFT of a document's second question, cold (the
document evaluated) against warm (its state restored from the prompt cache); the time to save and to
restore a state and its size per token; prefill and decode rates and the KV memory per `--kv-type`.

Each measurement uses llmcli's own path (`Session.ask` with a `PromptCache` in a temporary folder), so
the cold row pays what `llmcli run` pays and the warm row what a later run pays.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.sampling_config import greedy_without_end
from llmcli.bench.baseline_loop import RawLoop
from llmcli.bench.rows import Row
from llmcli.chat.session import Session
from llmcli.decode.prompt_cache import GIB, PromptCache, PromptCacheConfig
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig
from llmcli.store.gguf_header import GGUFHeader
from llmcli.store.memory import kv_cache_bytes

DOCUMENT_LINE = "Item {n}: the committee reviewed the budget for site {n} and approved {m} new measurements. "
QUESTIONS = ("Which item approved the most measurements?", "Summarize the document in one sentence.")


def document_of_about(session: Session, n_tokens: int) -> str:
    """A document whose prompt (with the first question) has about `n_tokens` tokens."""
    lines: list[str] = []
    while True:
        lines.append(DOCUMENT_LINE.format(n=len(lines) + 1, m=(len(lines) * 7) % 13 + 1))
        text = "".join(lines)
        if len(session.render(f"{text}\n\n{QUESTIONS[0]}", history=[]).tokens) >= n_tokens:
            return text


def prompt_cache_rows(path: Path, threads: int, n_batch: int, lengths: tuple[int, ...], repetitions: int,
                      row: Callable[..., Row]) -> Iterator[str]:
    """Per prompt length: ttft cold / warm, save and restore seconds, state bytes per token."""
    folder = Path(tempfile.mkdtemp(prefix="llmcli-bench-cache-"))
    try:
        with Engine(path, EngineConfig(n_ctx=max(lengths) + 64, n_threads=threads, n_batch=n_batch)) as engine:
            config = PromptCacheConfig(folder, min_tokens=1, budget_bytes=64 * GIB, model_name=path.stem)
            session = Session(engine, prompt_cache=PromptCache(engine, config))
            first = GenerationOptions(greedy_without_end(engine.vocab.end_of_generation_tokens()), 1)
            for length in lengths:
                doc = document_of_about(session, length)
                rows = {name: row(f"{name} p{length}", "prompt cache", unit) for name, unit in (
                    ("ttft cold", "s"), ("ttft warm", "s"), ("state save", "s"), ("state restore", "s"),
                    ("state size", "KiB/token"))}
                for _ in range(repetitions):
                    shutil.rmtree(folder, ignore_errors=True)
                    cold, save_s = _ask(session, doc, QUESTIONS[0], first)
                    rows["ttft cold"].samples.append(cold.stats.ttft_s)
                    rows["state save"].samples.append(save_s)
                    [saved] = folder.glob("*/entries/*.kv")
                    rows["state size"].samples.append(saved.stat().st_size / cold.stats.prompt_tokens / 1024)
                    yield f"ttft cold p{length}"
                    warm, _ = _ask(session, doc, QUESTIONS[1], first)
                    rows["ttft warm"].samples.append(warm.stats.ttft_s)
                    rows["state restore"].samples.append(warm.stats.restore_s)
                    yield f"ttft warm p{length}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ask(session: Session, doc: str, question: str, generation: GenerationOptions) -> tuple[Done, float]:
    """One run's worth: an empty KV cache, the document and the question; (its Done, seconds spent saving after)."""
    session.engine.kv.clear()
    session.history.clear()
    done, finished = None, 0.0
    for event in session.ask(f"{doc}\n\n{question}", generation, stable_text=doc):
        if isinstance(event, Done):
            done, finished = event, time.perf_counter()
    assert done is not None
    return done, time.perf_counter() - finished


def kv_type_rows(path: Path, header: GGUFHeader, threads: int, n_batch: int, kv_types: tuple[str, ...], prompt_tokens: int,
                 gen_tokens: int, repetitions: int, row: Callable[..., Row]) -> Iterator[str]:
    """Per KV type: raw prefill and decode rates after a prompt of `prompt_tokens`, and the KV cache's size."""
    n_ctx = prompt_tokens + gen_tokens + 64
    for kv_type in kv_types:
        config = EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=n_batch, kv_type=kv_type)
        with Engine(path, config) as engine:
            raw = RawLoop(engine)
            sampling = greedy_without_end(engine.vocab.end_of_generation_tokens())
            tokens = engine.vocab.tokenize(DOCUMENT_LINE.format(n=1, m=2) * (prompt_tokens // 10 + 4))[:prompt_tokens]
            prefill = row(f"pp{prompt_tokens} kv {kv_type}", "raw", "t/s")
            decode = row(f"tg{gen_tokens} @ d{prompt_tokens} kv {kv_type}", "raw", "t/s")
            memory = row(f"kv cache {engine.n_ctx} tok kv {kv_type}", "memory", "MiB")
            memory.samples.append(kv_cache_bytes(header, engine.n_ctx, 1, kv_type) / 2**20)
            raw.prefill(tokens[:64])  # warm-up
            for _ in range(repetitions):
                prefill.samples.append(len(tokens) / raw.prefill(tokens))
                decode.samples.append((gen_tokens - 1) / raw.decode(tokens, sampling, gen_tokens))
                yield f"kv {kv_type}"
