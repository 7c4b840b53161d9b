"""`llmcli bench`: llama-bench's tests plus TTFT, the llmcli path, overhead and roofline; `bench compare`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.bench.plan import BenchPlan
from llmcli.bench.rows import format_rows
from llmcli.cli.options import complete_choices
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.bench.compare import Result
    from llmcli.bench.rows import Row
    from llmcli.bench.tune import Dimension, Tuner

app = typer.Typer(help="Measure prefill/decode speed, TTFT and the Python layer's overhead.",
                  subcommand_metavar="[compare BEFORE AFTER]")  # (it runs without a command)


def _int_list(text: str, flag: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, e.g. 1,2 (got {text!r})") from None
    if not values or min(values) < minimum:
        raise UsageError(f"{flag} values must be >= {minimum} (got {text!r})")
    return values


@app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", "-m", help="Model to measure (repeatable). Default: the default model.", show_default=False)] = None,
    n_prompt: Annotated[int, typer.Option(
        "--n-prompt", "-p", min=1, help="Prompt tokens for the prefill test (ppP; -p as in llama-bench), and of --tune's job.",
    )] = BenchPlan.prompt_tokens,
    n_gen: Annotated[int, typer.Option(
        "--n-gen", "-n", min=2, help="Tokens for the decode test (tgN), and the answer of --tune's job.",
    )] = BenchPlan.gen_tokens,
    repetitions: Annotated[int, typer.Option("--repetitions", "-r", min=1,
                                             help="Repetitions of each test, after a warm-up.")] = BenchPlan.repetitions,
    threads: Annotated[Optional[str], typer.Option(
        "--threads", "-t", help="Thread counts to compare, e.g. 1,2. [default: the threads setting, else one per "
        "physical core]",
        show_default=False)] = None,
    depth: Annotated[str, typer.Option("--depth", "-d", help="KV-cache depths for the raw tests, e.g. 0,512.")] = "0",
    batch_size: Annotated[str, typer.Option(
        "--batch-size", "-b", help="Prompt tokens per step; several (64,512) also measure the prefill at each.",
    )] = str(BenchPlan.n_batch),
    parallel: Annotated[Optional[str], typer.Option(
        "--parallel", "-P", help="Also measure aggregate decode with N sequences at once, e.g. 1,8.", show_default=False)] = None,
    busy: Annotated[int, typer.Option(
        "--busy", min=0, help="Also measure one run's decode rate while N other processes keep a core busy each: the "
        "default threads against each fixed count (and on an idle machine).")] = 0,
    contention: Annotated[bool, typer.Option(
        "--contention", help="Also measure two llmcli processes decoding at once (shared cores vs every core each).")] = False,
    prompt_cache: Annotated[Optional[str], typer.Option(
        "--prompt-cache", help="Also measure TTFT cold vs warm (prompt cache) at these prompt lengths, e.g. 512,2048, "
        "and the time to save and restore a state.", show_default=False)] = None,
    kv_type: Annotated[Optional[str], typer.Option(
        "--kv-type", help="Also compare KV cache types (speed and memory), e.g. f16,q8_0,q4_0.", show_default=False)] = None,
    speculate: Annotated[bool, typer.Option(
        "--speculate", help="Also measure speculative decoding: the cost of an n-token pass, and decode rates with and "
        "without drafts on a grounded task (copy a text) and an ungrounded one (a story).")] = False,
    sampling: Annotated[bool, typer.Option(
        "--sampling", help="Also measure what choosing a token costs in the decode loop (a model pass between tokens): "
        "plain, with --logprobs 5 and traced (--trace), for greedy, a logit bias, the default chain, a repeat penalty "
        "and top-p alone.")] = False,
    image: Annotated[Optional[str], typer.Option(
        "--image", help="Also measure a picture (a model that sees): its encoding, and the TTFT of a question about it "
        "encoded now, with its embeddings kept and with its KV cells kept.", show_default=False)] = None,
    tune: Annotated[bool, typer.Option(
        "--tune", help="Instead: find this machine's best threads, batch size, flash attention, KV type and mmap for "
        "the model (each judged against the default beyond the noise).")] = False,
    budget: Annotated[str, typer.Option("--budget", help="With --tune: the time to spend, e.g. 60s or 2m.")] = "60s",
    save: Annotated[Optional[str], typer.Option(
        "--save", help="With --tune: write the winners to [profiles.NAME] of the config file (then: run -p NAME).",
        show_default=False)] = None,
    endpoint: Annotated[Optional[str], typer.Option(
        "--endpoint", help="Measure an OpenAI-compatible server instead (TTFT and decode rate seen from here; "
        "--parallel N: the aggregate rate of N answers at once).", show_default=False)] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="The --endpoint's API key ($LLMCLI_API_KEY).",
                                                   show_default=False)] = None,
    output_format: Annotated[str, typer.Option("--format", "-o", help="md, json or csv.",
                                               autocompletion=complete_choices(("md", "json", "csv")))] = "md",
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Also draw the results as a picture, FILE.svg or FILE.png: each sweep against its variable, "
        "--tune's search (needs the plot extra).", dir_okay=False, show_default=False)] = None,
) -> None:
    """Run the benchmark (the default when no subcommand is given)."""
    if ctx.invoked_subcommand is not None:
        return
    from llmcli.bench.environment import environment
    from llmcli.bench.measure import Benchmark
    from llmcli.cli import output
    from llmcli.config import settings
    from llmcli.store import models
    from llmcli.store.gguf_header import read_header

    if output_format not in ("md", "json", "csv"):
        raise UsageError(f"--format must be md, json or csv (got {output_format!r})")
    if not tune and save is not None:
        raise UsageError("--save writes what --tune found", hint="llmcli bench --tune --save NAME")
    if plot is not None:
        _check_plot(plot)  # before anything is measured
    if tune:
        _tune(model, _seconds(budget), save, output_format, n_prompt, n_gen, plot)
        return
    config = settings.load_config_file()
    endpoint = endpoint or settings.resolve({}, config=config)["endpoint"]
    if endpoint:
        _bench_endpoint(endpoint, api_key, model, n_gen, repetitions,
                        _int_list(parallel, "--parallel", 1) if parallel else (), output_format, plot)
        return
    configured = settings.resolve({})["threads"]  # $LLMCLI_THREADS or the config file's, else one per core
    batch_sizes = _int_list(batch_size, "--batch-size", 1)
    plan = BenchPlan(
        prompt_tokens=n_prompt, gen_tokens=n_gen, repetitions=repetitions,
        threads=_int_list(threads, "--threads", 1) if threads else (configured,) if configured else (),
        depths=_int_list(depth, "--depth", 0),
        n_batch=batch_sizes[0],
        batch_sizes=batch_sizes if len(batch_sizes) > 1 else (),
        parallel=_int_list(parallel, "--parallel", 1) if parallel else (),
        contention=contention,
        busy=busy,
        cache_lengths=_int_list(prompt_cache, "--prompt-cache", 16) if prompt_cache else (),
        kv_types=_kv_types(kv_type) if kv_type else (),
        speculation=speculate,
        image=image,
        sampling=sampling,
    )
    default_model = settings.resolve({}, config=config)["model"]
    resolved = [models.resolve(m, config.aliases) for m in (model or [default_model])]
    if image is not None:
        from llmcli.answer.image_bytes import read_image

        read_image(image)  # a bad picture is said before anything is measured
        blind = [m.name for m in resolved if m.projector is None]
        if blind:
            raise UsageError(f"bench --image: {', '.join(blind)} does not see images (no vision projector found with it)",
                             hint="Put its mmproj file beside the model.")
    benchmark = Benchmark(resolved, [read_header(m.path) for m in resolved], plan)
    with output.progress_bar("benchmark") as advance:
        for step in benchmark.run():
            advance(step.done, step.total, step.what)
    measured_on = environment(resolved, benchmark.threads)
    print(format_rows(benchmark.rows, measured_on, plan, output_format), end="")
    if plot is not None:
        _plot_rows(plot, benchmark.rows, measured_on)


def _check_plot(path: Path) -> None:
    """A picture llmcli can draw where it can write it, with the plot extra installed."""
    import importlib.util

    from llmcli.config.install_hint import install_hint

    if path.suffix.lower() not in (".svg", ".png"):
        raise UsageError(f"--plot draws an .svg or a .png file (got {path.name!r})")
    if not path.parent.is_dir():
        raise UsageError(f"--plot: no folder {str(path.parent)!r}")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs the plot extra (matplotlib is missing)", hint=install_hint("plot"))


def _plot_rows(path: Path, rows: list[Row], environment: dict[str, object]) -> None:
    from llmcli.bench.plot import plot_rows

    _plotted(path, plot_rows(rows, environment, path))


def _plotted(path: Path, panels: int) -> None:
    from llmcli.cli import output

    output.stderr_console().print(f"plot: {path} ({panels} panel{'s' * (panels != 1)})", highlight=False)


def _bench_endpoint(url: str, api_key: str | None, model: list[str] | None, n_gen: int, repetitions: int,
                    parallel: tuple[int, ...], output_format: str, plot: Path | None) -> None:
    import time

    from llmcli.bench.remote import endpoint_rows
    from llmcli.bench.rows import Row
    from llmcli.cli import output
    from llmcli.pipeline import Request, open_answering
    from llmcli.remote.session import RemoteSession

    if model and len(model) > 1:
        raise UsageError("--endpoint measures one model: give one -m")
    flags: dict[str, object] = {"endpoint": url, "temp": 0.0, **({"model": model[0]} if model else {})}
    pipeline = open_answering(Request(settings=flags, api_key=api_key))
    session = pipeline.session
    assert isinstance(session, RemoteSession)  # flags carry --endpoint: a server answers
    rows: list[Row] = []

    def row(test: str, path: str, unit: str) -> Row:
        rows.append(Row(pipeline.model.name, None, None, "", None, test, path, unit))  # what a server does not say
        return rows[-1]

    with pipeline, output.progress_bar("benchmark") as advance:
        total = repetitions * (1 + sum(1 for n in parallel if n > 1))
        for done, what in enumerate(endpoint_rows(session, pipeline.generation, n_gen, repetitions, parallel,
                                                  row), 1):
            advance(done, total, what)
    environment: dict[str, object] = {"endpoint": session.where, "cpu": None, "physical_cores": None,
                                   "llama_cpp_python": None, "models": [], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(format_rows(rows, environment, BenchPlan(gen_tokens=n_gen, repetitions=repetitions, parallel=parallel),
                  output_format), end="")
    if plot is not None:
        _plot_rows(plot, rows, environment)


def _seconds(text: str) -> float:
    """`60s`, `2m`, `90` -> seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in ("s", "m") else (text, "s")
    try:
        seconds = float(number) * (60 if unit == "m" else 1)
    except ValueError:
        seconds = 0
    if not 0 < seconds <= 24 * 3600:
        raise UsageError(f"--budget takes a duration such as 60s or 2m (got {text!r})")
    return seconds


def _tune(model: list[str] | None, budget_s: float, save: str | None, output_format: str, n_prompt: int,
          n_gen: int, plot: Path | None) -> None:
    from llmcli.bench.tune import Tuner
    from llmcli.cli import output
    from llmcli.config import settings
    from llmcli.store import models

    if model and len(model) > 1:
        raise UsageError("--tune tunes one model: give one -m")
    config = settings.load_config_file()
    resolved = models.resolve(model[0] if model else settings.resolve({}, config=config)["model"], config.aliases)
    tuner = Tuner(resolved.path, budget_s, n_prompt, n_gen)
    with output.progress_bar("tune") as advance:
        for step in tuner.run():
            advance(step.done, step.total, step.what)
    if output_format == "json":
        output.print_json({"model": resolved.name, "budget_s": budget_s, "elapsed_s": round(tuner.elapsed_s, 1),
                           "dimensions": [_dimension_record(d) for d in tuner.dimensions], "profile": tuner.profile()})
    else:
        print(_tune_table(resolved.name, tuner), end="")
    if plot is not None:
        from llmcli.bench.environment import machine  # (the title's: not environment(), which hashes the model)
        from llmcli.bench.plot import plot_tune

        _plotted(plot, plot_tune(resolved.name, tuner.dimensions, machine(), plot))
    if save is not None:
        from llmcli import paths
        from llmcli.config.config_file import save_profile

        chosen = tuner.profile()
        save_profile(save, chosen, f"llmcli bench --tune on {resolved.name}: the settings that beat the default "
                     "beyond the noise" + ("" if chosen else " (none did)"))
        from llmcli.config.setting import show_value

        shown = ", ".join(f"{k} = {show_value(v)}" for k, v in chosen.items()) or "no setting (the defaults won)"
        output.stderr_console().print(f"saved [profiles.{save}] in {paths.config_file()}: {shown}; use it with -p {save}")


def _dimension_record(dimension: Dimension) -> dict[str, object]:
    return {"setting": dimension.setting, "default": dimension.baseline, "chosen": dimension.winner,
            "verdict": dimension.verdict,
            "candidates": [{"value": c.value, "job_s": c.summary(), "prefill_tps": c.prefill_tps,
                            "decode_tps": c.decode_tps, "load_s": c.load_s} for c in dimension.candidates]}


def _tune_table(name: str, tuner: Tuner) -> str:
    from statistics import fmean

    from llmcli.config.setting import show_value

    lines = [f"{name}: a {tuner.prompt_tokens}-token prompt and a {tuner.answer_tokens}-token answer per sample "
             f"({tuner.elapsed_s:.0f} s of a {tuner.budget_s:.0f} s budget)", "",
             "| setting | value | job | prefill t/s | decode t/s | load | n | |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for dimension in tuner.dimensions:
        for candidate in dimension.candidates:
            job = candidate.summary()
            if not job["n"]:
                continue
            marks = [m for m, on in (("default", candidate.value == dimension.baseline),
                                     ("chosen", candidate.value == dimension.winner)) if on]
            lines.append(f"| {dimension.setting} | {show_value(candidate.value)} | {job['mean'] * 1000:.0f} ± "
                         f"{job['sd'] * 1000:.0f} ms | {fmean(candidate.prefill_tps):.1f} | {fmean(candidate.decode_tps):.1f} "
                         f"| {fmean(candidate.load_s) * 1000:.0f} ms | {job['n']} | {', '.join(marks)} |")
        lines.append(f"| {dimension.setting} | → {show_value(dimension.winner)} | | | | | | {dimension.verdict} |")
    return "\n".join(lines) + "\n"


def _kv_types(text: str) -> tuple[str, ...]:
    from llmcli.config.settings import SETTINGS

    types = tuple(part.strip() for part in text.split(",") if part.strip())
    choices = SETTINGS["kv_type"].choices
    if not types or any(t not in choices for t in types):
        raise UsageError(f"--kv-type takes {', '.join(choices)}, comma-separated (got {text!r})")
    return types


@app.command("compare")
def compare_cmd(
    before: Annotated[Path, typer.Argument(help="Results of `llmcli bench --format json` (the baseline).",
                                           exists=True, dir_okay=False)],
    after: Annotated[Path, typer.Argument(help="Results to compare with the baseline.", exists=True, dir_okay=False)],
) -> None:
    """Per-test ratio after/before: better, worse (beyond the noise: Welch's t-test at 95 %) or within noise."""
    from llmcli.bench.compare import compare

    def load(path: Path) -> list[Result]:
        try:
            results: list[Result] = json.loads(path.read_text(encoding="utf-8"))["results"]
            return results
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{path} is not a `llmcli bench --format json` file: {exc}") from None

    rows = compare(load(before), load(after))
    if not rows:
        raise UsageError("the two files have no test in common")
    print("| model | threads | test | path | before | after | ratio | note |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | --- |")
    for c in rows:
        model, threads, test, path = c.key
        print(f"| {model} | {threads} | {test} | {path} | {c.before:.4g} | {c.after:.4g} | {c.ratio:.3f} | {c.verdict} |")
