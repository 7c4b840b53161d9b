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
            self.entries.append(log_entry(self.pipeline, "batch", self.items[record["index"]].prompt or "", record))

    def record(self, quiet: bool) -> None:
        from llmcli.cli import output
        from llmcli.store.answer_log import record

        warning = record(self.entries) if self.entries else None
        if warning:
            output.print_notice(output.stderr_console(), warning)


def _remote_batch(pipeline: Any, items: list[Any], parallel: int, quiet: bool) -> None:
    """--batch --endpoint: up to `parallel` requests at once, the records in input order."""
    import time

    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line
    from llmcli.inference.batch_input import in_order
    from llmcli.remote.session import batch

    started = time.perf_counter()
    with pipeline, output.progress_bar("batch") as advance:
        done = [0]

        def write(record: dict[str, Any]) -> None:
            write_json_line(record)
            logged.add(record)
            done[0] += 1
            advance(done[0], len(items), "batch")

        logged = BatchLog(pipeline, items)
        answered, errors = batch(pipeline.session, items, pipeline.generation, parallel, in_order(write))
    logged.record(quiet)
    if not quiet:
        output.stderr_console().print(f"batch: {answered} prompt{'' if answered == 1 else 's'} ({errors} error"
                                      f"{'' if errors == 1 else 's'}) · {time.perf_counter() - started:.2f} s · "
                                      f"{parallel} parallel · {pipeline.client.endpoint.url}", style="dim")
    raise typer.Exit(ExitCode.OK)


def run_batch_command(source: str, request: Request, parallel: int, quiet: bool) -> None:
    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line
    from llmcli.inference.batch_input import in_order, parse_items
    from llmcli.inference.parallel import BatchRun, plan
    from llmcli.pipeline import RemotePipeline, open_answering

    if source == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(source).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --batch {source}: {exc.strerror}") from None
    items = parse_items(lines)
    console = output.stderr_console()
    with output.download_progress() as progress:
        pipeline = open_answering(request, progress, on_waiting=output.waiting_for)
    if isinstance(pipeline, RemotePipeline):
        _remote_batch(pipeline, items, parallel, quiet)
        return
    with pipeline:
        for notice in pipeline.session.notices:
            output.print_notice(console, notice)
        generation = pipeline.generation_for_batch()
        if generation.speculation.draft_model is not None:
            raise UsageError("--batch drafts from each prompt and its answer (prompt lookup), not with --draft-model",
                             hint="Use --speculate auto or lookup with --batch; a draft model drafts for run and chat.")
        batch_plan = plan(items, pipeline.prompt_tokens, pipeline.engine, generation, parallel)
        pipeline.resize_kv(batch_plan.cells, batch_plan.n_sequences)  # sized to the work, checked against memory
        logged = BatchLog(pipeline, items)

        def write(record: dict[str, Any]) -> None:
            write_json_line(record)
            logged.add(record)

        run = BatchRun(pipeline.engine, batch_plan, generation, pipeline.cancel, in_order(write))
        with output.progress_bar("batch") as advance, pipeline.cancel.on_signals():
            summary = run.run(lambda done, total, rate: advance(done, total, f"batch · {rate:.0f} tok/s"))
        signum = pipeline.cancel.signum
    logged.record(quiet)
    if not quiet:
        rate = summary.completion_tokens / summary.wall_s if summary.wall_s else 0
        counts = f"{summary.errors} error{'' if summary.errors == 1 else 's'}" + (
            f", {summary.not_started} not started" if summary.not_started else "")
        console.print(
            f"batch: {summary.prompts} prompt{'' if summary.prompts == 1 else 's'} ({counts}) · "
            f"prompt {summary.prompt_tokens} tok ({summary.prefill_tokens} evaluated"
            + (f", a shared prefix of {summary.shared_prefix_tokens} once" if summary.shared_prefix_tokens else "") + ") · "
            f"{summary.completion_tokens} tok generated · {summary.wall_s:.2f} s · {rate:.1f} tok/s overall · "
            f"{summary.decode_tps:.1f} tok/s aggregate decode · {parallel} parallel"
            + (f" · KV cache grown {summary.grown}x" if summary.grown else "")
            + (f" · {summary.accepted_tokens}/{summary.draft_tokens} drafted accepted" if summary.draft_tokens else "")
            + (" · interrupted" if summary.interrupted else ""),
            style="dim",
        )
    if signum is not None:
        raise typer.Exit(128 + signum)
    raise typer.Exit(ExitCode.OK)
