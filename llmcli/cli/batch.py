"""`llmcli run --batch`: many prompts, decoded together, answered as JSONL in input order."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from llmcli.errors import ExitCode, StdoutClosed, UsageError


def run_batch_command(source: str, request: Any, parallel: int, quiet: bool) -> None:
    from llmcli import render
    from llmcli.parallel import in_order, parse_items, run_batch
    from llmcli.pipeline import open_pipeline

    if source == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(source).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --batch {source}: {exc.strerror}") from None
    items = parse_items(lines)
    console = render.stderr_console()
    with render.download_progress() as progress:
        pipeline = open_pipeline(request, progress)

    def write(record: dict[str, Any]) -> None:
        try:
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None

    with pipeline:
        for notice in pipeline.session.notices:
            render.print_notice(console, notice)
        with render.progress_bar("batch") as advance, pipeline.cancel.on_signals():
            summary = run_batch(
                pipeline.engine, pipeline.session, items, pipeline.generation, parallel, pipeline.cancel,
                in_order(write), lambda done, total, rate: advance(done, total, f"batch · {rate:.0f} tok/s"),
            )
        signum = pipeline.cancel.signum
    if not quiet:
        console.print(
            f"batch: {summary.prompts} prompts ({summary.errors} errors) · prompt {summary.prompt_tokens} tok · "
            f"{summary.completion_tokens} tok generated · {summary.wall_s:.2f} s · "
            f"{summary.completion_tokens / summary.wall_s if summary.wall_s else 0:.1f} tok/s overall · "
            f"{summary.decode_tps:.1f} tok/s aggregate decode · {parallel} parallel"
            + (" · interrupted" if summary.interrupted else ""),
            style="dim",
        )
    if signum is not None:
        raise typer.Exit(128 + signum)
    raise typer.Exit(ExitCode.OK)
