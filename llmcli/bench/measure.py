"""Step 7 at scale: llama-bench's tests, plus what it leaves out.

For each model and thread count, interleaved over `repetitions` after a warm-up:
- `pp{P}` / `tg{N}` (optionally `@ d{D}`): the raw llama.cpp loop (inference.raw.RawLoop), as llama-bench;
- the same through llmcli's own path (template, tokenize, sample, detokenize, stop check);
- `ttft`: request to first token for a templated chat prompt;
- overhead: llmcli's rate divided by the raw loop's, same model, same sampler chain, same process;
- roofline: decode rate as a share of memory bandwidth / bytes read per token.

The core never prints: `Benchmark.run` yields progress and collects `rows`; the CLI renders them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from llmcli.answer.batch_jsonl import BatchItem
from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.sampling_config import greedy_without_end
from llmcli.bench.baseline_loop import RawLoop
from llmcli.bench.contention import busy_cores, busy_decode_rate, pair_decode_rate
from llmcli.bench.environment import memory_bandwidth
from llmcli.bench.images import image_rows
from llmcli.bench.plan import BenchPlan
from llmcli.bench.prompt_cache import kv_type_rows, prompt_cache_rows
from llmcli.bench.rows import Row
from llmcli.bench.sampling import CHAINS, MODES, sampling_rows
from llmcli.bench.speculation import pass_cost_rows, speculation_rows
from llmcli.chat.session import Session
from llmcli.decode.batch_run import BatchRun
from llmcli.decode.batch_run import plan as batch_planned
from llmcli.interrupt import Cancellation
from llmcli.llama import cpu_topology
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig
from llmcli.store.gguf_header import GGUFHeader
from llmcli.store.models import ResolvedModel

TTFT_PROMPT = "Explain what a KV cache is in two sentences."
FILLER = (
    "The history of computing is a story of ideas meeting machines. Engineers measured, "
    "guessed, and measured again, until the numbers told them what the machine could do. "
)


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    what: str


class _Subject:
    """One loaded model at one thread count: each method measures one test once."""

    def __init__(self, engine: Engine, plan: BenchPlan, stoppable: bool = False):
        self.engine, self.plan = engine, plan
        self.raw, self.session = RawLoop(engine, stoppable), Session(engine)
        # Greedy with end-of-generation banned: every run yields exactly gen_tokens, in both paths.
        self.sampling = greedy_without_end(engine.vocab.end_of_generation_tokens())
        # Plain decoding: the overhead rows compare the Python layer with the raw loop, token for token.
        self.generation = GenerationOptions(self.sampling, plan.gen_tokens, speculate="off")
        n_corpus = max(plan.depths) + plan.prompt_tokens
        self.corpus = engine.vocab.tokenize(FILLER * (engine.n_ctx // 20 + 8), add_special=True)[:n_corpus]
        self.pp_text, self.pp_tokens = self._text_of_about(plan.prompt_tokens)
        self.chat_tokens = self.session.render(TTFT_PROMPT).tokens

    def _text_of_about(self, n_tokens: int) -> tuple[str, list[int]]:
        """A user message whose rendered prompt has at most `n_tokens` tokens, as close as words allow."""
        words = (FILLER * (n_tokens // 20 + 2)).split()
        low, high, best = 1, len(words), (words[0], self.session.render(words[0]).tokens)
        while low <= high:
            mid = (low + high) // 2
            text = " ".join(words[:mid])
            tokens = self.session.render(text).tokens
            if len(tokens) <= n_tokens:
                low, best = mid + 1, (text, tokens)
            else:
                high = mid - 1
        return best

    def warm_up(self) -> None:
        """Page in the weights, build the graphs."""
        self.raw.prefill(self.corpus[:64])
        self.raw.decode(self.corpus[:8], self.sampling, 8)

    def raw_prefill(self, depth: int) -> float:
        return self.plan.prompt_tokens / self.raw.prefill(self.corpus[: depth + self.plan.prompt_tokens], depth)

    def raw_decode(self, depth: int) -> float:
        return (self.plan.gen_tokens - 1) / self.raw.decode(self.corpus[: max(depth, 1)], self.sampling, self.plan.gen_tokens)

    def raw_prefill_same(self) -> float:
        return len(self.pp_tokens) / self.raw.prefill(self.pp_tokens)

    def raw_decode_same(self) -> float:
        return (self.plan.gen_tokens - 1) / self.raw.decode(self.chat_tokens, self.sampling, self.plan.gen_tokens)

    def llmcli_prefill(self) -> float:
        return self._ask(self.pp_text, self.generation).stats.prefill_tps

    def llmcli_decode(self) -> float:
        return self._ask(TTFT_PROMPT, self.generation).stats.decode_tps

    def ttft(self) -> float:
        return self._ask(TTFT_PROMPT, GenerationOptions(self.sampling, 1, speculate="off")).stats.ttft_s

    def _ask(self, text: str, generation: GenerationOptions) -> Done:
        self.engine.kv.clear()
        self.session.history.clear()
        done = [e for e in self.session.ask(text, generation) if isinstance(e, Done)]
        return done[0]


class Benchmark:
    """Every model at every thread count; `run()` yields progress and fills `rows`."""

    def __init__(self, models: Sequence[ResolvedModel], headers: Sequence[GGUFHeader], plan: BenchPlan):
        self.models, self.headers, self.plan = models, headers, plan
        self.threads = plan.threads or (cpu_topology.physical_cores(),)
        self.rows: list[Row] = []

    def run(self) -> Iterator[Progress]:
        plan = self.plan
        per_repetition = (len(plan.depths) * 2 + 5 + len(plan.parallel) + 2 * plan.contention + 2 * len(plan.cache_lengths)
                          + (2 * (1 + cpu_topology.physical_cores()) if plan.busy else 0)
                          + len(plan.kv_types) + 6 * plan.speculation + len(plan.batch_sizes) + 3 * bool(plan.image)
                          + len(CHAINS) * len(MODES) * plan.sampling)
        total = len(self.models) * len(self.threads) * (plan.repetitions * per_repetition + 1)  # + the bandwidth probe
        done = 0
        for model, header in zip(self.models, self.headers, strict=True):
            for threads in self.threads:
                for what in self._measure(model, header, threads):
                    done += 1
                    yield Progress(done, total, f"{model.name} t{threads} {what}")

    def _row(self, model: ResolvedModel, header: GGUFHeader, threads: int, test: str, path: str, unit: str) -> Row:
        row = Row(model.name, header.file_size, header.n_params, header.quant, threads, test, path, unit)
        self.rows.append(row)
        return row

    def _measure(self, model: ResolvedModel, header: GGUFHeader, threads: int) -> Iterator[str]:
        plan = self.plan
        row = partial(self._row, model, header, threads)
        n_ctx = max(plan.depths) + plan.prompt_tokens + plan.gen_tokens + 64
        with Engine(model.path, EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=plan.n_batch)) as engine:
            subject = _Subject(engine, plan)
            steps: list[tuple[Row, Callable[[], float]]] = []
            for depth in plan.depths:
                suffix = f" @ d{depth}" if depth else ""
                steps.append((row(f"pp{plan.prompt_tokens}{suffix}", "raw", "t/s"), partial(subject.raw_prefill, depth)))
                steps.append((row(f"tg{plan.gen_tokens}{suffix}", "raw", "t/s"), partial(subject.raw_decode, depth)))
            # llmcli's own path, and the raw loop on exactly the same prompt tokens for the overhead ratio
            n_pp = len(subject.pp_tokens)
            pp_same, tg_same = row(f"pp{n_pp}", "raw, same prompt", "t/s"), row(f"tg{plan.gen_tokens}", "raw, same prompt", "t/s")
            pp_run, tg_run = row(f"pp{n_pp}", "llmcli", "t/s"), row(f"tg{plan.gen_tokens}", "llmcli", "t/s")
            steps += [(pp_same, subject.raw_prefill_same), (pp_run, subject.llmcli_prefill),
                      (tg_same, subject.raw_decode_same), (tg_run, subject.llmcli_decode),
                      (row("ttft", "llmcli", "s"), subject.ttft)]
            subject.warm_up()
            for _ in range(plan.repetitions):
                for target, measure in steps:
                    target.samples.append(measure())
                    yield f"{target.test} ({target.path})"
        if plan.batch_sizes:
            yield from self._batch_size_rows(model, threads, row)
        if plan.parallel:
            yield from self._parallel_rows(model, threads, row)
        if plan.contention:
            yield from self._contention_rows(model, threads, row)
        if plan.busy:
            yield from self._busy_rows(model, row)
        if plan.cache_lengths:
            yield from prompt_cache_rows(model.path, threads, plan.n_batch, plan.cache_lengths, plan.repetitions, row)
        if plan.speculation:
            yield from pass_cost_rows(model.path, threads, plan.n_batch, max(plan.prompt_tokens, 256), plan.repetitions, row)
            yield from speculation_rows(model.path, threads, plan.n_batch, plan.gen_tokens, plan.repetitions, row)
        if plan.sampling:
            yield from sampling_rows(model.path, threads, plan.n_batch, plan.gen_tokens, plan.repetitions, row)
        if plan.image is not None and model.projector is not None:  # (the CLI checked that every model sees)
            yield from image_rows(model.path, model.projector, plan.image, threads, plan.n_batch, plan.repetitions, row)
        if plan.kv_types:
            yield from kv_type_rows(model.path, header, threads, plan.n_batch, plan.kv_types, plan.prompt_tokens,
                                    plan.gen_tokens, plan.repetitions, row)
        row(f"overhead tg{plan.gen_tokens}", "ratio", "x").samples.append(tg_run.mean / tg_same.mean)
        row(f"overhead pp{n_pp}", "ratio", "x").samples.append(pp_run.mean / pp_same.mean)
        # Decode reads every weight once per token: bandwidth / weight bytes is the ceiling.
        yield "memory bandwidth"
        bandwidth = memory_bandwidth(threads)
        ceiling = bandwidth / sum(t.n_bytes for t in header.tensors)
        row("memory bandwidth", "roofline", "GB/s").samples.append(bandwidth / 1e9)
        row(f"roofline tg{plan.gen_tokens}", "roofline", "% of ceiling").samples.append(100 * tg_same.mean / ceiling)

    def _contention_rows(self, model: ResolvedModel, threads: int, row: Callable[..., Row]) -> Iterator[str]:
        """Two processes at once, each at its share of the cores (the default) and each at `threads` (fixed)."""
        gen = min(self.plan.gen_tokens, 64)  # fixed threads can collapse to ~1 tok/s: keep the pair short
        shared = row(f"tg{gen} 2 processes", "each, shared cores", "t/s")
        fixed = row(f"tg{gen} 2 processes", f"each, -t {threads}", "t/s")
        for _ in range(self.plan.repetitions):
            shared.samples.append(pair_decode_rate(model.path, gen))
            yield shared.test
            fixed.samples.append(pair_decode_rate(model.path, gen, threads))
            yield fixed.test

    def _busy_rows(self, model: ResolvedModel, row: Callable[..., Row]) -> Iterator[str]:
        """One run's decode rate on an idle machine and with `busy` cores kept busy by other processes: the default
        threads (what the machine gives now) against each fixed count, and the default's ratio to the best of them."""
        gen = min(self.plan.gen_tokens, 64)  # a thread that shares its core can fall to ~2 tok/s: keep the runs short
        cores = cpu_topology.physical_cores()
        for busy in (0, self.plan.busy):
            label = f"tg{gen} {busy} core{'s' if busy != 1 else ''} busy"
            chosen = row(label, "default threads", "t/s")
            fixed = {n: row(label, f"-t {n}", "t/s") for n in range(1, cores + 1)}
            with busy_cores(busy):
                for _ in range(self.plan.repetitions):
                    for threads, target in [(None, chosen), *fixed.items()]:
                        target.samples.append(busy_decode_rate(model.path, gen, threads))
                        yield f"{target.test} ({target.path})"
            best = max(fixed.values(), key=lambda r: r.mean)
            row(label, f"default ÷ best fixed ({best.path})", "x").samples.append(chosen.mean / best.mean)

    def _batch_size_rows(self, model: ResolvedModel, threads: int, row: Callable[..., Row]) -> Iterator[str]:
        """The raw prefill of the -p prompt at each batch size (prompt tokens per llama_decode)."""
        plan = self.plan
        for n_batch in plan.batch_sizes:
            config = EngineConfig(n_ctx=plan.prompt_tokens + 64, n_threads=threads, n_batch=n_batch)
            with Engine(model.path, config) as engine:
                raw = RawLoop(engine)
                tokens = engine.vocab.tokenize(FILLER * (plan.prompt_tokens // 20 + 8), add_special=True)
                tokens = tokens[: plan.prompt_tokens]
                raw.prefill(tokens[:64])  # warm-up
                target = row(f"pp{plan.prompt_tokens} b{n_batch}", "raw, batch size", "t/s")
                for _ in range(plan.repetitions):
                    target.samples.append(len(tokens) / raw.prefill(tokens))
                    yield target.test

    def _parallel_rows(self, model: ResolvedModel, threads: int, row: Callable[..., Row]) -> Iterator[str]:
        """Aggregate decode rate with N sequences in one context (`llmcli run --batch --parallel N`)."""
        plan = self.plan
        config = EngineConfig(n_ctx=plan.gen_tokens + 128, n_threads=threads, n_batch=plan.n_batch)
        with Engine(model.path, config) as engine:
            session = Session(engine)
            sampling = greedy_without_end(engine.vocab.end_of_generation_tokens())

            def batch(n: int, gen_tokens: int) -> float:
                items = [BatchItem(i, f"{TTFT_PROMPT} ({i})") for i in range(n)]
                generation = GenerationOptions(sampling, gen_tokens, speculate="off")
                batch_plan = batch_planned(items, lambda item: session.prepare_alone(item.prompt or "", generation), engine,
                                           generation, n)
                engine.resize(batch_plan.cells, batch_plan.n_sequences)
                run = BatchRun(engine, batch_plan, generation, Cancellation(), lambda index, record: None)
                return run.run().decode_tps

            batch(1, 8)  # warm-up
            rows = {n: row(f"tg{plan.gen_tokens} x{n}", "parallel", "t/s") for n in plan.parallel}
            for _ in range(plan.repetitions):
                for n, target in rows.items():
                    target.samples.append(batch(n, plan.gen_tokens))
                    yield target.test


def quick_speed(path: Path, threads: int | None = None, prompt_tokens: int = 256, gen_tokens: int = 32,
                repetitions: int = 3, kv_type: str = "f16", cancel: Cancellation | None = None) -> tuple[float, float]:
    """(prefill, decode) tokens/s of the raw loop, as `bench`'s pp/tg rows measure them, the median of `repetitions`
    after a warm-up: a short measure for comparing files of one model (`quant advise`). `cancel` set (Ctrl-C) ends
    it with KeyboardInterrupt, at the next token or the next node of a prefill's graph."""
    import statistics

    plan = BenchPlan(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repetitions=repetitions)
    n_ctx = prompt_tokens + gen_tokens + 64
    config = EngineConfig(n_ctx=n_ctx, n_threads=threads, n_batch=plan.n_batch, kv_type=kv_type)
    with Engine(path, config, cancel) as engine:
        subject = _Subject(engine, plan, stoppable=cancel is not None)
        subject.warm_up()
        prefill = [subject.raw_prefill(0) for _ in range(repetitions)]
        decode = [subject.raw_decode(0) for _ in range(repetitions)]
    return statistics.median(prefill), statistics.median(decode)
