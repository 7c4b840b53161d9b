"""Step 7 at scale: llama-bench's tests, plus what it leaves out.

For each model and thread count, interleaved over `repetitions` after a warm-up:
- `pp{P}` / `tg{N}` (optionally `@ d{D}`): the raw llama.cpp loop (engine.RawLoop), as llama-bench;
- the same through llmcli's own path (template, tokenize, sample, detokenize, stop check);
- `ttft`: request to first token for a templated chat prompt;
- overhead: llmcli's rate divided by the raw loop's, same model, same sampler chain, same process;
- roofline: decode rate as a share of memory bandwidth / bytes read per token.

The core never prints: `run_bench` yields progress and returns records; the CLI renders them.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from llmcli import backend, system
from llmcli.hub import sha256_of
from llmcli.engine import Done, Engine, EngineConfig, RawLoop
from llmcli.gguf_header import GGUFHeader
from llmcli.models import ResolvedModel
from llmcli.sampling import SamplingConfig
from llmcli.session import GenerationOptions, Session

TTFT_PROMPT = "Explain what a KV cache is in two sentences."
FILLER = (
    "The history of computing is a story of ideas meeting machines. Engineers measured, "
    "guessed, and measured again, until the numbers told them what the machine could do. "
)


@dataclass(frozen=True)
class BenchPlan:
    prompt_tokens: int = 512
    gen_tokens: int = 128
    repetitions: int = 5
    threads: tuple[int, ...] = ()  # empty: one per physical core
    depths: tuple[int, ...] = (0,)
    n_batch: int = 512
    parallel: tuple[int, ...] = ()  # sequences decoded together (aggregate decode rate), e.g. (1, 8)


@dataclass
class Row:
    model: str
    size_bytes: int
    params: int
    quant: str
    threads: int
    test: str  # pp512, tg128, pp512 @ d512, ttft, overhead tg128, roofline tg128, ...
    path: str  # raw | llmcli | ratio | roofline
    unit: str  # t/s, s, x, %
    samples: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def sd(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "mean": self.mean, "sd": self.sd, "n": len(self.samples)}


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    what: str


def memory_bandwidth(threads: int, megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second of a large copy (read + write), split over `threads` threads; best of `repeats`."""
    import numpy as np  # a llama-cpp-python dependency

    chunk = megabytes * 1024 * 1024 // 8 // threads
    sources = [np.ones(chunk) for _ in range(threads)]
    targets = [np.empty(chunk) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(t, s)) for t, s in zip(targets, sources)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, 2 * chunk * 8 * threads / (time.perf_counter() - started))
    return best


def environment(models: Sequence[ResolvedModel], threads: Sequence[int]) -> dict[str, object]:
    return {
        "cpu": system.cpu_model(),
        "physical_cores": system.physical_cores(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **backend.build_info(),
        "threads": list(threads),
        "models": [{"name": m.name, "path": str(m.path), "sha256": sha256_of(m.path)} for m in models],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _text_of_about(session: Session, n_tokens: int) -> tuple[str, list[int]]:
    """A user message whose rendered prompt has at most `n_tokens` tokens, as close as words allow."""
    words = (FILLER * (n_tokens // 20 + 2)).split()
    low, high, best = 1, len(words), (words[0], session.render(words[0]).tokens)
    while low <= high:
        mid = (low + high) // 2
        text = " ".join(words[:mid])
        tokens = session.render(text).tokens
        if len(tokens) <= n_tokens:
            low, best = mid + 1, (text, tokens)
        else:
            high = mid - 1
    return best


def run_bench(
    models: Sequence[ResolvedModel],
    headers: Sequence[GGUFHeader],
    plan: BenchPlan,
    rows_out: list[Row],
) -> Iterator[Progress]:
    """Measure every model at every thread count; fills `rows_out`, yields progress as it goes."""
    threads_list = plan.threads or (system.physical_cores(),)
    per_rep = len(plan.depths) * 2 + 5 + len(plan.parallel)
    total = len(models) * len(threads_list) * plan.repetitions * per_rep
    done = 0
    for model, header in zip(models, headers):
        n_ctx = max(plan.depths) + plan.prompt_tokens + plan.gen_tokens + 64
        for threads in threads_list:
            def row(test: str, path: str, unit: str) -> Row:
                made = Row(model.name, header.file_size, header.n_params, header.quant, threads, test, path, unit)
                rows_out.append(made)
                return made

            with Engine(model.path, EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=plan.n_batch)) as engine:
                raw, session = RawLoop(engine), Session(engine)
                # Greedy with end-of-generation banned: every run yields exactly gen_tokens, in both paths.
                sampling = SamplingConfig(temperature=0, logit_bias=tuple((t, -math.inf) for t in engine.end_of_generation_tokens()))
                generation = GenerationOptions(sampling, plan.gen_tokens)
                corpus = engine.tokenize(FILLER * (n_ctx // 20 + 8), add_special=True)[: max(plan.depths) + plan.prompt_tokens]
                pp_text, pp_tokens = _text_of_about(session, plan.prompt_tokens)
                steps: list[tuple[Row, Callable[[], float]]] = []
                for depth in plan.depths:
                    suffix = f" @ d{depth}" if depth else ""
                    pp_raw = row(f"pp{plan.prompt_tokens}{suffix}", "raw", "t/s")
                    tg_raw = row(f"tg{plan.gen_tokens}{suffix}", "raw", "t/s")
                    steps.append((pp_raw, lambda d=depth: plan.prompt_tokens / raw.prefill(corpus[: d + plan.prompt_tokens], d)))
                    steps.append((tg_raw, lambda d=depth: (plan.gen_tokens - 1) / raw.decode(corpus[: max(d, 1)], sampling, plan.gen_tokens)))
                # llmcli's own path, and the raw loop on exactly the same prompt tokens for the overhead ratio
                chat_tokens = session.render(TTFT_PROMPT).tokens
                pp_same = row(f"pp{len(pp_tokens)}", "raw, same prompt", "t/s")
                pp_run = row(f"pp{len(pp_tokens)}", "llmcli", "t/s")
                tg_same = row(f"tg{plan.gen_tokens}", "raw, same prompt", "t/s")
                tg_run = row(f"tg{plan.gen_tokens}", "llmcli", "t/s")
                ttft = row("ttft", "llmcli", "s")

                def ask(text: str) -> Done:
                    engine.reset()
                    session.history.clear()
                    return [e for e in session.ask(text, generation) if isinstance(e, Done)][0]

                steps.append((pp_same, lambda: len(pp_tokens) / raw.prefill(pp_tokens)))
                steps.append((pp_run, lambda: ask(pp_text).stats.prefill_tps))
                steps.append((tg_same, lambda: (plan.gen_tokens - 1) / raw.decode(chat_tokens, sampling, plan.gen_tokens)))
                steps.append((tg_run, lambda: ask(TTFT_PROMPT).stats.decode_tps))
                ttft_generation = GenerationOptions(sampling, 1)
                steps.append((ttft, lambda: _first_token_s(engine, session, ttft_generation)))

                raw.prefill(corpus[:64])  # warm-up: page in the weights, build the graphs
                raw.decode(corpus[:8], sampling, 8)
                for _ in range(plan.repetitions):
                    for target, measure in steps:
                        target.samples.append(measure())
                        done += 1
                        yield Progress(done, total, f"{model.name} t{threads} {target.test} ({target.path})")

            if plan.parallel:
                for step in _parallel_rows(model, plan, threads, row):
                    done += 1
                    yield Progress(done, total, f"{model.name} t{threads} {step}")
            row(f"overhead tg{plan.gen_tokens}", "ratio", "x").samples.append(tg_run.mean / tg_same.mean)
            row(f"overhead pp{len(pp_tokens)}", "ratio", "x").samples.append(pp_run.mean / pp_same.mean)
            # Decode reads every weight once per token: bandwidth / weight bytes is the ceiling.
            bandwidth = memory_bandwidth(threads)
            ceiling = bandwidth / sum(t.n_bytes for t in header.tensors)
            row("memory bandwidth", "roofline", "GB/s").samples.append(bandwidth / 1e9)
            row(f"roofline tg{plan.gen_tokens}", "roofline", "% of ceiling").samples.append(100 * tg_same.mean / ceiling)


def _parallel_rows(model: ResolvedModel, plan: BenchPlan, threads: int, row: Callable[[str, str, str], Row]) -> Iterator[str]:
    """Aggregate decode rate with N sequences in one context (`llmcli run --batch --parallel N`)."""
    from llmcli.interrupt import Cancellation
    from llmcli.parallel import BatchItem, run_batch

    widest = max(plan.parallel)
    n_ctx = plan.gen_tokens + 128
    config = EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=plan.n_batch, n_seq_max=widest)
    with Engine(model.path, config) as engine:
        session = Session(engine)
        sampling = SamplingConfig(temperature=0, logit_bias=tuple((t, -math.inf) for t in engine.end_of_generation_tokens()))
        generation = GenerationOptions(sampling, plan.gen_tokens)
        rows = {n: row(f"tg{plan.gen_tokens} x{n}", "parallel", "t/s") for n in plan.parallel}
        run_batch(engine, session, [BatchItem(0, TTFT_PROMPT)], GenerationOptions(sampling, 8), 1, Cancellation(), lambda i, r: None)
        for _ in range(plan.repetitions):
            for n, target in rows.items():
                items = [BatchItem(i, f"{TTFT_PROMPT} ({i})") for i in range(n)]
                summary = run_batch(engine, session, items, generation, n, Cancellation(), lambda i, r: None)
                target.samples.append(summary.decode_tps)
                yield target.test


def _first_token_s(engine: Engine, session: Session, generation: GenerationOptions) -> float:
    engine.reset()
    session.history.clear()
    for event in session.ask(TTFT_PROMPT, generation):
        if isinstance(event, Done):
            return event.stats.ttft_s
    raise AssertionError("generate always ends with Done")


@dataclass(frozen=True)
class Comparison:
    key: tuple[str, ...]
    unit: str
    before: float
    after: float
    ratio: float
    significant: bool


def compare(before: Sequence[dict], after: Sequence[dict]) -> list[Comparison]:
    """Match rows by (model, threads, test, path); ratio after/before; Welch's t > 2 counts as significant."""
    def key(r: dict) -> tuple[str, ...]:
        return (r["model"], str(r["threads"]), r["test"], r["path"])

    earlier = {key(r): r for r in before}
    result = []
    for row_b in after:
        row_a = earlier.get(key(row_b))
        if row_a is None or not row_a["mean"]:
            continue
        spread = math.sqrt(row_a["sd"] ** 2 / max(row_a["n"], 1) + row_b["sd"] ** 2 / max(row_b["n"], 1))
        diff = row_b["mean"] - row_a["mean"]
        significant = spread > 0 and abs(diff) / spread > 2 and row_a["n"] > 1 and row_b["n"] > 1
        result.append(Comparison(key(row_b), row_b["unit"], row_a["mean"], row_b["mean"], row_b["mean"] / row_a["mean"], significant))
    return result
