"""`llmcli run --batch`: many prompts, decoded together, answered as JSONL in input order."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from llmcli.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from llmcli.pipeline import Request


class BatchLog:
    """The batch's answers for the log (with --log, the default), written in one transaction at the end."""

    def __init__(self, pipeline: Any, items: list[Any]):
        self.pipeline, self.items = pipeline, items
        self.entries: list[Any] = []

    def add(self, record: dict[str, Any]) -> None:
        from llmcli.pipeline import log_entry

        if self.pipeline.settings["log"] and "error" not in record:
            self.entries.append(log_entry(self.pipeline, "batch", self.items[record["index"]].prompt or "", record,
                                          self.pipeline.generation))

    def record(self, quiet: bool) -> None:
        from llmcli.cli import output
        from llmcli.store.answer_log import record

        warning = record(self.entries) if self.entries else None
        if warning:
            output.print_notice(output.stderr_console(), warning)


def run_batch_command(source: str, request: Request, parallel: int, quiet: bool) -> None:
    from llmcli.answer.batch_jsonl import in_order, parse_items
    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line

    if source == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(source).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --batch {source}: {exc.strerror}") from None
    items = parse_items(lines, None if source == "-" else Path(source).parent)
    console = output.stderr_console()
    with output.open_pipeline(request, console) as pipeline:
        logged = BatchLog(pipeline, items)

        def write(record: dict[str, Any]) -> None:
            write_json_line(record)
            logged.add(record)

        with output.progress_bar("batch") as advance, pipeline.cancel.on_signals():
            summary = pipeline.session.batch(items, pipeline.generation, parallel, pipeline.cancel, in_order(write),
                                             lambda done, total, rate: advance(done, total, f"batch · {rate:.0f} tok/s"))
        signum = pipeline.cancel.signum
    logged.record(quiet)
    if not quiet:
        console.print(summary_line(summary), style="dim")
    if signum is not None:
        raise typer.Exit(128 + signum)
    raise typer.Exit(ExitCode.OK)


def summary_line(summary: Any) -> str:
    """The batch's one line on stderr: prompts, errors, tokens, time, rates (local or remote alike)."""
    plural = "" if summary.prompts == 1 else "s"
    counts = f"{summary.errors} error{'' if summary.errors == 1 else 's'}" + (
        f", {summary.not_started} not started" if summary.not_started else "")
    rate = summary.completion_tokens / summary.wall_s if summary.wall_s else 0
    prompt = f"prompt {summary.prompt_tokens} tok"
    if summary.where is None:
        prompt += f" ({summary.prefill_tokens} evaluated" + (
            f", a shared prefix of {summary.shared_prefix_tokens} once" if summary.shared_prefix_tokens else "") + ")"
    return (f"batch: {summary.prompts} prompt{plural} ({counts}) · {prompt} · {summary.completion_tokens} tok generated · "
            f"{summary.wall_s:.2f} s · {rate:.1f} tok/s overall"
            + (f" · {summary.decode_tps:.1f} tok/s aggregate decode" if summary.where is None else "")
            + f" · {summary.parallel} parallel"
            + (f" · {summary.where}" if summary.where else "")
            + (f" · KV cache grown {summary.grown}x" if summary.grown else "")
            + (f" · {summary.accepted_tokens}/{summary.draft_tokens} drafted accepted" if summary.draft_tokens else "")
            + (" · interrupted" if summary.interrupted else ""))
