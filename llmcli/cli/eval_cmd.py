"""`llmcli eval tools`: how well a model calls tools, on BFCL-format items, the way run, chat and serve ask it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmcli.cli import options as o
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from llmcli.eval.bfcl import Item
    from llmcli.eval.tool_eval import ItemResult, Report
    from llmcli.pipeline import Request

app = typer.Typer(help="Measure a model: `eval tools` (tool calling, BFCL's items and rules), `eval quality` (a quant "
                  "against its reference: KL divergence, perplexity).",
                  no_args_is_help=True)

SETTINGS_TAKEN = ("model", "system", "temp", "top_k", "top_p", "min_p", "seed", "max_tokens", "tool_format",
                  "call_preference", "call_gain", "ctx_size", "threads", "endpoint", "endpoint_timeout", "keep_alive", "think")
EXCLUDED = ("raw", "grammar", "grammar_file", "json_schema", "output_format", "logit_bias")
CategoriesArg = Annotated[Optional[list[str]], typer.Argument(
    help="BFCL categories (simple, multiple, parallel, parallel_multiple, irrelevance, live_simple, live_multiple, "
    "live_parallel, live_irrelevance). [default: simple multiple parallel irrelevance]", show_default=False)]
ChoiceOpt = Annotated[str, typer.Option(
    "--tool-choice", help="auto (the model decides), required (a call), one (the function by name when an item offers "
    "one, else required), none.", autocompletion=o.complete_choices(("auto", "required", "one", "none")))]
LimitOpt = Annotated[int, typer.Option("--limit", "-l", min=0, help="Items a category (0: all).")]
ItemsOpt = Annotated[Optional[list[Path]], typer.Option(
    "--items", help="Your own items, BFCL's format (JSON lines), instead of BFCL's data: a category each, named after "
    "the file (repeatable).", dir_okay=False, show_default=False)]
AnswersOpt = Annotated[Optional[list[Path]], typer.Option(
    "--answers", help="Their possible answers (BFCL's format), the Nth for the Nth --items; an --items without one: no "
    "call is right for any of its items (irrelevance).", dir_okay=False, show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object: per category and per item.")]
CalibrateOpt = Annotated[bool, typer.Option(
    "--calibrate", help="Choose --call-preference and --call-gain (tool choice auto) for this model on half the items "
    "(categories a tool fits and irrelevance ones) and report the choice on the other half, asked for real: forced, "
    "auto with the defaults, auto calibrated. [default categories: live_simple live_multiple live_irrelevance]")]
SaveOpt = Annotated[bool, typer.Option(
    "--save", help="With --calibrate: write the choice to the model's own table of the config file ([models.NAME]), "
    "which run, chat, --batch and serve use for it.")]
MinGainOpt = Annotated[Optional[int], typer.Option(
    "--min-gain", min=0, help="With --calibrate: items of the choosing half the best pair must get right beyond the "
    "numbers in use to replace them (else those stand, and --save writes nothing); 0: the best pair of the grid. "
    "[default: 2]", show_default=False)]


@app.command("tools")
@o.with_settings(only=SETTINGS_TAKEN, exclude=EXCLUDED)
def tools(categories: CategoriesArg = None, *, tool_choice: ChoiceOpt = "auto", limit: LimitOpt = 30,
          items: ItemsOpt = None, answers: AnswersOpt = None, calibrate: CalibrateOpt = False, save: SaveOpt = False,
          min_gain: MinGainOpt = None,
          as_json: JsonOpt = False, request: Request) -> None:
    """Ask a model BFCL-format tool-calling items (BFCL's own from `pip install --no-deps bfcl-eval`, or yours) through
    the path `run --functions` and `serve` take, greedy unless --temp; per category: accuracy by BFCL's AST rules,
    the valid-call rate, answers with no call, seconds an item. --calibrate chooses auto's two numbers for the
    model (and --save keeps them for it)."""
    from llmcli.cli import output
    from llmcli.eval import bfcl
    from llmcli.eval.tool_eval import CHOICES, evaluate

    if tool_choice not in CHOICES:
        raise UsageError(f"--tool-choice {tool_choice!r}: one of {', '.join(CHOICES)}")
    if min_gain is not None and not calibrate:
        raise UsageError("--min-gain is how much --calibrate's choice must win by",
                         hint="llmcli eval tools --calibrate --min-gain 1 -m MODEL")
    if save and not calibrate:
        raise UsageError("--save keeps what --calibrate chose", hint="llmcli eval tools --calibrate --save -m MODEL")
    if items:
        if categories:
            raise UsageError("give categories or --items, not both")
        if len(answers or ()) > len(items):
            raise UsageError("each --answers goes with an --items (the Nth with the Nth)")
        paired = list(answers or ()) + [None] * (len(items) - len(answers or ()))
        sources = [(path.stem.removeprefix("BFCL_v4_"), path, answer) for path, answer in zip(items, paired, strict=True)]
    else:
        if answers:
            raise UsageError("--answers goes with --items")
        sources = bfcl.category_files(categories or (bfcl.CALIBRATION_CATEGORIES if calibrate else
                                                     bfcl.DEFAULT_CATEGORIES))
    loaded = [item for category, path, answer_path in sources
              for item in bfcl.load(category, path, answer_path, limit or None)]
    # Greedy unless --temp (the figures repeat: BFCL's own runs are greedy too), and a call or a short answer at most
    # (an item never runs to the end of the context).
    request = replace(request, settings={"temp": 0.0, "max_tokens": 400, **request.settings})
    console = output.stderr_console()
    if calibrate:
        if tool_choice != "auto":
            raise UsageError("--calibrate chooses what --tool-choice auto does: leave --tool-choice out")
        if not any(item.irrelevant for item in loaded) or all(item.irrelevant for item in loaded):
            raise UsageError("--calibrate needs items a tool fits and items no tool fits (an irrelevance category)")
        from llmcli.eval.calibration import MIN_GAIN

        _calibrate(request, loaded, save, MIN_GAIN if min_gain is None else min_gain, as_json, console)
        return
    with output.open_pipeline(request, console) as pipeline:
        from llmcli.answer.answerer import tool_format

        format_name = tool_format(pipeline.session, pipeline.settings["tool_format"])
        with output.progress_bar("eval tools") as advance, pipeline.cancel.on_signals():
            done = [0]

            def step(result: ItemResult) -> None:
                done[0] += 1
                advance(done[0], len(loaded), f"eval tools · {result.category}")

            report = evaluate(pipeline.session, pipeline.generation, loaded, tool_choice, format_name,
                              pipeline.cancel, step)
        where = pipeline.session.where if pipeline.settings["endpoint"] else pipeline.model.name
    _show(report, where, tool_choice, format_name, as_json, console)
    if report.interrupted:
        raise typer.Exit(130)


def _calibrate(request: Request, loaded: list[Item], save: bool, min_gain: int, as_json: bool,
               console: Console) -> None:
    from llmcli.answer.answerer import tool_format
    from llmcli.cli import output
    from llmcli.eval.calibration import NO_CALL_GOAL, calibrate

    with output.open_pipeline(request, console) as pipeline:
        format_name = tool_format(pipeline.session, pipeline.settings["tool_format"])
        with output.progress_bar("eval tools --calibrate") as advance, pipeline.cancel.on_signals():
            found = calibrate(pipeline.session, pipeline.generation, loaded, format_name, pipeline.cancel,
                              lambda phase, done, total: advance(done, total, f"calibrate · {phase}"), min_gain)
        model = pipeline.model.name
        before = (pipeline.settings["call_preference"], pipeline.settings["call_gain"])
    rows = {name: {score.category: score.row() for score in report.scores()} for name, report in found.reported.items()}
    choice = found.choice
    result = {"model": model, "tool_format": format_name, "interrupted": found.interrupted,
              "no_call_goal": NO_CALL_GOAL, "before": {"call_preference": before[0], "call_gain": before[1]},
              "chosen": None if choice is None else {"call_preference": choice.base, "call_gain": choice.gain,
                                                     "predicted_accuracy": round(choice.accuracy, 4),
                                                     "predicted_no_call": round(choice.no_call, 4),
                                                     "kept": choice.kept},
              "min_gain": min_gain, "save": save,
              "choosing_items": len(found.probes), "report": rows,
              "probes": [{**dataclasses.asdict(p), "threshold": p.threshold if math.isfinite(p.threshold) else
                          "unled" if p.threshold < 0 else "never"} for p in found.probes]}
    if save and choice is not None and not choice.kept and not found.interrupted:
        from llmcli.config.config_file import save_model_settings

        save_model_settings(model, {"call_preference": choice.base, "call_gain": choice.gain},
                            f"llmcli eval tools --calibrate on {len(found.probes)} items: auto's lead toward a call")
        result["saved"] = f"[models.{model}]"
    if as_json:
        output.print_json(result)
    else:
        _show_calibration(result, console)
    if found.interrupted:
        raise typer.Exit(130)


def _show_calibration(result: dict[str, Any], console: Console) -> None:
    from llmcli.cli import output

    chosen = result["chosen"]
    if chosen is None:
        console.print(f"interrupted after {result['choosing_items']} items: nothing was chosen")
        return
    rows = []
    for name, categories in result["report"].items():
        for category, row in categories.items():
            rows.append((name, category, row["items"], f"{row['correct']}/{row['items']} ({100 * row['accuracy']:.0f}%)",
                         f"{100 * row['no_call_rate']:.0f}%"))
    output.print_table(("ASKED", "CATEGORY", "ITEMS", "ACCURACY", "NO CALL"), rows, right=("ITEMS", "ACCURACY", "NO CALL"),
                       title=f"{result['model']} · the report half (items the choice never saw) · {result['tool_format']} calls")
    if chosen["kept"]:
        console.print(f"kept on {result['choosing_items']} items: --call-preference {chosen['call_preference']:g} "
                      f"--call-gain {chosen['call_gain']:g}, the numbers in use (no pair got {result['min_gain']} more "
                      f"items right: --min-gain); predicted there: {100 * chosen['predicted_accuracy']:.0f}% of the "
                      f"items a tool fits answered, {100 * chosen['predicted_no_call']:.0f}% of the others uncalled"
                      + ("; nothing was saved" if result.get("save") else ""))
        return
    console.print(f"chosen on {result['choosing_items']} items: --call-preference {chosen['call_preference']:g} "
                  f"--call-gain {chosen['call_gain']:g} (predicted there: {100 * chosen['predicted_accuracy']:.0f}% of "
                  f"the items a tool fits answered, {100 * chosen['predicted_no_call']:.0f}% of the others uncalled; "
                  f"goal ≥ {100 * result['no_call_goal']:.0f}%); was {result['before']['call_preference']:g} and "
                  f"{result['before']['call_gain']:g}")
    if result.get("saved"):
        console.print(f"saved in {result['saved']} of the config file: run, chat, --batch and serve use it for "
                      f"{result['model']}")


def _show(report: Report, where: str, choice: str, format_name: str, as_json: bool, console: Console) -> None:
    from dataclasses import asdict

    from llmcli.cli import output

    rows = [score.row() for score in report.scores()]
    if as_json:
        output.print_json({"model": where, "tool_choice": choice, "tool_format": format_name,
                           "interrupted": report.interrupted, "categories": rows,
                           "items": [asdict(result) for result in report.results]})
        return
    output.print_table(("CATEGORY", "ITEMS", "ACCURACY", "VALID CALLS", "NO CALL", "S/ITEM"), [
        (row["category"], row["items"], f"{row['correct']}/{row['items']} ({100 * row['accuracy']:.0f}%)",
         "–" if row["valid_call_rate"] is None else f"{100 * row['valid_call_rate']:.0f}%",
         f"{100 * row['no_call_rate']:.0f}%", f"{row['seconds_per_item']:.2f}") for row in rows],
        right=("ITEMS", "ACCURACY", "VALID CALLS", "NO CALL", "S/ITEM"),
        title=f"{where} · --tool-choice {choice} · {format_name} calls")
    if report.interrupted:
        console.print(f"interrupted after {len(report.results)} items: the rows above are what was measured")


CandidateOpt = Annotated[str, typer.Option("--model", "-m", help="The model to measure (a quant).", show_default=False,
                                           autocompletion=o.complete_model)]
ReferenceOpt = Annotated[str, typer.Option(
    "--reference", "-r", help="What it is measured against: the same model at higher precision (F16, BF16, Q8_0).",
    show_default=False, autocompletion=o.complete_model)]
TextOpt = Annotated[Optional[Path], typer.Option(
    "--text", help="The text to score (UTF-8) [default: llmcli's own: prose, code, numbers and dialogue, ~4k tokens].",
    dir_okay=False, show_default=False)]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", min=16, max=32768,
                                     help="Tokens a chunk (llama-perplexity's -c); the second half of each is scored.")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=1, max=1024, help="The reference's most likely tokens kept a "
                                      "position, and as many drawn from the rest (an unbiased estimate of its share).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="Threads [default: the cores].",
                                                   show_default=False)]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="The candidate's KV cache type (f16, q8_0, q4_0): a "
                                        "quantized cache's loss, measured the same way (the reference's is f16).")]


@app.command("quality")
def quality(model: CandidateOpt, reference: ReferenceOpt, text: TextOpt = None, ctx_size: CtxOpt = 512,
            top_k: TopKOpt = 128, kv_type: KvTypeOpt = "f16", threads: ThreadsOpt = None,
            as_json: JsonOpt = False) -> None:
    """How far a quant's predictions are from its reference's on a text, llama-perplexity's way: perplexity, and
    against the reference KL divergence (mean, median, p99, max), top-1 agreement and RMS Δp, each mean with its
    uncertainty. The reference's pass is kept (its top log-probabilities: a few MB), so the next candidate costs one
    pass."""
    from llmcli.cli import output
    from llmcli.cli.models_cmd import _aliases
    from llmcli.eval import quality as q
    from llmcli.interrupt import Cancellation
    from llmcli.store import catalog

    console = output.stderr_console()
    if kv_type not in ("f16", "q8_0", "q4_0"):
        raise UsageError(f"--kv-type {kv_type!r}: one of f16, q8_0, q4_0")
    words = q.read_text(text)
    candidate = catalog.local_model(model, _aliases())
    base = catalog.local_model(reference, _aliases())
    cancel = Cancellation()
    with output.progress_bar("eval quality") as advance, cancel.on_signals():
        def progress(phase: str, done: int, total: int) -> None:
            advance(done, total, f"{phase} ({base.name if phase == 'reference' else candidate.name}) · chunks")

        from llmcli.cli.quant_cmd import _threads

        result = q.evaluate(candidate.path, base.path, words, ctx_size, top_k, _threads(threads), cancel, progress,
                            candidate.name, kv_type)
    from llmcli.bench.environment import machine

    result = {"model": candidate.name, "reference": base.name, "kv_type": kv_type,
              "text": str(text) if text else "built-in", **result,
              "machine": {k: v for k, v in machine().items() if k in ("cpu", "physical_cores", "llama_cpp_python")}}
    if as_json:
        output.print_json(result)
    else:
        _show_quality(result, console)
    if result.get("interrupted"):
        raise typer.Exit(130)


def _show_quality(result: dict[str, Any], console: Console) -> None:
    from llmcli.cli import output

    machine = result["machine"]
    where = f"{machine['cpu']}, {machine['physical_cores']} cores, llama-cpp-python {machine['llama_cpp_python']}"
    if not result.get("tokens_scored"):
        console.print("interrupted before any position was scored: nothing measured")
        return
    kld = result["kld"]
    output.print_fields([
        ("model", f"{result['model']} against {result['reference']}"
                  + (f" (its KV cache {result['kv_type']})" if result["kv_type"] != "f16" else "")),
        ("text", f"{result['text']} · {result['tokens_scored']} tokens scored, chunks of {result['ctx']}"),
        ("perplexity", f"{result['perplexity']:.4f} ± {result['perplexity_error']:.4f} (reference "
                       f"{result['reference_perplexity']:.4f} ± {result['reference_perplexity_error']:.4f})"),
        ("KL divergence", f"mean {kld['mean']:.5f} ± {kld['mean_error']:.5f} · median {kld['median']:.5f} · "
                          f"p99 {kld['p99']:.4f} · max {kld['max']:.4f}"),
        ("top-1 agreement", f"{100 * result['top1_agreement']:.2f} % ± {100 * result['top1_agreement_error']:.2f}"),
        ("RMS Δp", f"{100 * result['rms_delta_p']:.3f} % ± {100 * result['rms_delta_p_error']:.3f}"),
        ("reference", ("kept from an earlier pass" if result["reference_kept"] else "computed now, kept")
                      + f" (a position's top {result['top_k']} and {result['top_k']} drawn from the rest)"),
        ("machine", where),
    ])
    if result.get("interrupted"):
        console.print(f"interrupted after {result['tokens_scored']} of {result['tokens_in_reference']} positions: the "
                      "figures above are what was measured")
