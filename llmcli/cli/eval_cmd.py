"""`llmcli eval tools`: how well a model calls tools, on BFCL-format items, the way run, chat and serve ask it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli import options as o
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from llmcli.eval.tool_eval import ItemResult, Report
    from llmcli.pipeline import Request

app = typer.Typer(help="Measure how well a model does a task: `eval tools` (tool calling, BFCL's items and rules).",
                  no_args_is_help=True)

SETTINGS_TAKEN = ("model", "system", "temp", "top_k", "top_p", "min_p", "seed", "max_tokens", "tool_format",
                  "call_preference", "ctx_size", "threads", "endpoint", "endpoint_timeout", "keep_alive", "think")
EXCLUDED = ("raw", "grammar", "grammar_file", "json_schema", "output_format", "logit_bias")
CategoriesArg = Annotated[Optional[list[str]], typer.Argument(
    help="BFCL categories (simple, multiple, parallel, parallel_multiple, irrelevance, live_simple, live_multiple, "
    "live_parallel, live_irrelevance). [default: simple multiple parallel irrelevance]", show_default=False)]
ChoiceOpt = Annotated[str, typer.Option(
    "--tool-choice", help="auto (the model decides), required (a call), one (the function by name when an item offers "
    "one, else required), none.", autocompletion=o.complete_choices(("auto", "required", "one", "none")))]
LimitOpt = Annotated[int, typer.Option("--limit", "-l", min=0, help="Items a category (0: all).")]
ItemsOpt = Annotated[Optional[Path], typer.Option(
    "--items", help="Your own items, BFCL's format (JSON lines), instead of BFCL's data: one category, named after "
    "the file.", dir_okay=False, show_default=False)]
AnswersOpt = Annotated[Optional[Path], typer.Option(
    "--answers", help="Their possible answers (BFCL's format); none: no call is right for any item (irrelevance).",
    dir_okay=False, show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object: per category and per item.")]


@app.command("tools")
@o.with_settings(only=SETTINGS_TAKEN, exclude=EXCLUDED)
def tools(categories: CategoriesArg = None, *, tool_choice: ChoiceOpt = "auto", limit: LimitOpt = 30,
          items: ItemsOpt = None, answers: AnswersOpt = None, as_json: JsonOpt = False, request: Request) -> None:
    """Ask a model BFCL-format tool-calling items (BFCL's own from `pip install --no-deps bfcl-eval`, or yours) through
    the path `run --functions` and `serve` take, greedy unless --temp; per category: accuracy by BFCL's AST rules,
    the valid-call rate, answers with no call, seconds an item."""
    from llmcli.cli import output
    from llmcli.eval import bfcl
    from llmcli.eval.tool_eval import CHOICES, evaluate

    if tool_choice not in CHOICES:
        raise UsageError(f"--tool-choice {tool_choice!r}: one of {', '.join(CHOICES)}")
    if items is not None:
        if categories:
            raise UsageError("give categories or --items, not both")
        sources = [(items.stem.removeprefix("BFCL_v4_"), items, answers)]
    else:
        if answers is not None:
            raise UsageError("--answers goes with --items")
        sources = bfcl.category_files(categories or bfcl.DEFAULT_CATEGORIES)
    loaded = [item for category, path, answer_path in sources
              for item in bfcl.load(category, path, answer_path, limit or None)]
    # Greedy unless --temp (the figures repeat: BFCL's own runs are greedy too), and a call or a short answer at most
    # (an item never runs to the end of the context).
    request = replace(request, settings={"temp": 0.0, "max_tokens": 400, **request.settings})
    console = output.stderr_console()
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
