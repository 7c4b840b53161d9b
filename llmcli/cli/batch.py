"""`llmcli run --batch`: many prompts, decoded together, answered as JSONL in input order."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from llmcli.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from llmcli.answer.answerer import Answerer
    from llmcli.answer.batch_jsonl import BatchItem, Record, Summary
    from llmcli.cluster.ray_batch import RayJob
    from llmcli.pipeline import Pipeline, Request
    from llmcli.store.answer_log import Entry


class BatchLog:
    """The batch's answers for the log (with --log, the default), written in one transaction at the end."""

    def __init__(self, pipeline: Pipeline[Answerer], items: list[BatchItem]):
        self.pipeline, self.items = pipeline, items
        self.entries: list[Entry] = []

    def add(self, record: Record) -> None:
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


@dataclass(frozen=True)
class RayOptions:
    """--ray's own options: the cluster (None: $RAY_ADDRESS, else a local one) and how many workers."""

    address: str | None = None
    workers: int | None = None


def run_batch_command(source: str, request: Request, parallel: int, quiet: bool, ray: RayOptions | None = None,
                      resume: Path | None = None) -> None:
    from llmcli.answer.batch_jsonl import answered, in_order, parse_items
    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line

    items = parse_items(_read(source, "--batch"), None if source == "-" else Path(source).parent)
    kept = {index: record for index, record in answered(_read(str(resume), "--resume")).items()
            if index < len(items)} if resume is not None else {}
    console = output.stderr_console()
    if resume is not None and not quiet:
        output.print_notice(console, f"--resume: {len(kept)} of {len(items)} records are answered in {resume}: "
                                     "copied, not asked again")
    todo = [item for item in items if item.index not in kept]
    if ray is not None:
        _run_on_ray(todo, items, kept, request, parallel, quiet, ray)
        return
    with output.open_pipeline(request, console) as pipeline:
        logged = BatchLog(pipeline, items)

        def write(record: Record) -> None:
            write_json_line(record)
            if record["index"] not in kept:
                logged.add(record)

        accept = in_order(write)
        for index, record in sorted(kept.items()):
            accept(index, record)
        with output.progress_bar("batch") as advance, pipeline.cancel.on_signals():
            summary = pipeline.session.batch(todo, pipeline.generation, parallel, pipeline.cancel, accept,
                                             lambda done, total, rate: advance(done, total, f"batch · {rate:.0f} tok/s"))
        signum = pipeline.cancel.signum
    logged.record(quiet)
    _end(summary, signum, quiet)


def _run_on_ray(todo: list[BatchItem], items: list[BatchItem], kept: dict[int, Record], request: Request,
                parallel: int, quiet: bool, ray: RayOptions) -> None:
    """The batch as a Ray job (llmcli/cluster/ray_batch.py): the same records, the same summary, the log."""
    from llmcli.cluster.ray_batch import BatchWorker, RayJob

    threads = request.settings.get("threads") or 1
    job = RayJob(todo, BatchWorker, (request, parallel, threads), parallel, ray.address, ray.workers, threads)
    summary, signum = run_ray_job(job, kept, quiet, request.verbose)
    _end(summary, signum, quiet)


def run_ray_job(job: RayJob, kept: dict[int, Record], quiet: bool, verbose: bool) -> tuple[Summary, int | None]:
    """A Ray job's records on stdout in input order (`kept` ones too), its progress, the log, the workers' memory:
    (its summary, the signal that stopped it)."""
    from llmcli.answer.batch_jsonl import in_order
    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line
    from llmcli.cluster.ray_batch import ray_module, run_on_ray
    from llmcli.interrupt import Cancellation
    from llmcli.store.answer_log import record as log_record

    ray_module()  # a missing extra is said before anything starts
    records = sys.stdout  # the JSONL's: what Ray's own threads print (a worker's death, in colour) goes elsewhere
    accept = in_order(lambda record: write_json_line(record, records), sorted([*kept, *(i.index for i in job.items)]))
    for index, record in sorted(kept.items()):
        accept(index, record)
    console = output.stderr_console()
    cancel = Cancellation()
    with output.progress_bar("ray") as advance, cancel.on_signals(), open(os.devnull, "w") as sink, \
            contextlib.redirect_stdout(sys.stderr if verbose else sink):
        summary = run_on_ray(job, cancel, accept,
                             lambda done, total, rate, alive: advance(done, total, f"ray · {alive} workers · {rate:.0f} tok/s"),
                             None if quiet else lambda text: console.print(text, style="dim"))
    warning = log_record(job.log_entries) if job.log_entries else None
    if warning:
        output.print_notice(console, warning)
    if not quiet and job.worker_memory:
        mib = max(job.worker_memory) / 2**20
        console.print(f"ray: each worker held {mib:.0f} MiB (the model's pages, shared on a node, included)", style="dim")
    return summary, cancel.signum


def _read(source: str, flag: str) -> list[str]:
    if source == "-":
        return sys.stdin.read().splitlines()
    try:
        return Path(source).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {flag} {source}: {exc.strerror}") from None


def _end(summary: Summary, signum: int | None, quiet: bool) -> None:
    from llmcli.cli import output

    if not quiet:
        output.stderr_console().print(summary_line(summary), style="dim")
    if signum is not None:
        raise typer.Exit(128 + signum)
    raise typer.Exit(ExitCode.OK)


def summary_line(summary: Summary) -> str:
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
