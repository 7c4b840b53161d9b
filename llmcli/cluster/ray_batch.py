"""`run --batch FILE --ray` (and `embed --input FILE --ray`): the same JSONL in and out as a local --batch (or embed),
answered by a pool of Ray actors.

Each actor (`BatchWorker`; `EmbedWorker` for embeddings) loads the model once — llmcli's own pipeline: engine,
scheduler, `--parallel` sequences — on the CPUs Ray gives it (its threads), and answers blocks of records with the
local batch path (`Session.batch`). The driver hands out blocks, one at a time per actor, and writes each block's
records when the whole block is back, in input order: a worker that dies (killed, out of memory, its node gone) loses
only its block, which goes to another worker (a replacement is started); so every record appears exactly once. A block
whose worker died three times becomes error records (a record that kills llama.cpp is not retried forever). A record
that fails by itself (too long, a bad image) is the same error record as locally. Ctrl-C (or SIGTERM) kills the actors
and, for a local cluster started for the job, the cluster: no Ray process outlives the job; the records not answered
say so, as a local batch's do.

No address: a local Ray cluster of this machine's cores, started for the job and stopped after it. An address (or
RAY_ADDRESS, Ray's own variable): the user's cluster, where every node resolves the model itself (a path on shared
storage, an installed package, or a Hub reference, cached on each node on first use).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.batch_jsonl import BatchItem, Record, Summary
from llmcli.config.install_hint import install_hint
from llmcli.errors import LlmcliError, UsageError
from llmcli.interrupt import Cancellation

RETRIES = 2  # times a block goes to another worker after its worker died
POLL_S = 0.25  # how often the driver looks at the workers (Ctrl-C, progress)
LOG_NAME = "llmcli-batch"  # the Ray namespace of the job's actors


def ray_module() -> Any:
    """Ray, or the one-line hint that installs the `ray` extra."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray, which is not installed", hint=install_hint("ray")) from None
    return ray


class BatchWorker:
    """One actor: the model loaded once from `request` (its threads: the CPUs Ray gave it), answering blocks."""

    def __init__(self, request: Any, parallel: int, threads: int):
        import dataclasses

        from llmcli.pipeline.local import open_pipeline

        settings = dict(request.settings)
        settings.setdefault("threads", threads)
        self.pipeline = open_pipeline(dataclasses.replace(request, settings=settings))
        self.parallel = parallel

    def answer(self, items: list[BatchItem]) -> tuple[list[Record], Summary, list[Any]]:
        """A block's records (in the block's order), its summary, and its entries for the answer log."""
        from llmcli.pipeline import log_entry

        found: dict[int, Record] = {}
        pipeline = self.pipeline
        summary = pipeline.session.batch(items, pipeline.generation, self.parallel, pipeline.cancel,
                                         lambda index, record: found.__setitem__(index, record))
        records = [found[item.index] for item in items]
        entries = [log_entry(pipeline, "batch", item.prompt or "", record, pipeline.generation)
                   for item, record in zip(items, records, strict=True)
                   if pipeline.settings["log"] and "error" not in record] if pipeline.settings["log"] else []
        return records, summary, entries

    def memory(self) -> int:
        return _resident()


class EmbedWorker:
    """One actor: an embedding model loaded once (`embed --input FILE --ray`), embedding blocks of records whose
    `prompt` is the text (their other fields carried)."""

    def __init__(self, request: Any, threads: int, pooling: str, normalize: bool, truncate: bool, per_pass: int):
        import dataclasses

        from llmcli.pipeline.local import open_embedder

        settings = dict(request.settings)
        settings.setdefault("threads", threads)
        _, _, self.embedder = open_embedder(dataclasses.replace(request, settings=settings), pooling, normalize, truncate,
                                            per_pass)

    def answer(self, items: list[BatchItem]) -> tuple[list[Record], Summary, list[Any]]:
        results = list(self.embedder.embed([item.prompt or "" for item in items]))
        records = [{**item.extra, "index": item.index, "embedding": result.vector, "tokens": result.tokens}
                   if result.vector is not None else item.error_record(result.error or "no vector")
                   for item, result in zip(items, results, strict=True)]
        return records, Summary(prompts=len(items), prompt_tokens=sum(r.tokens or 0 for r in results)), []

    def memory(self) -> int:
        return _resident()


def _resident() -> int:
    """This worker's resident memory, bytes (the model's mapped pages included)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class RayJob:
    """What the job is, and how far it got."""

    items: list[BatchItem]
    worker: type  # BatchWorker or EmbedWorker
    worker_args: tuple[Any, ...]  # what it is made with (the request first)
    parallel: int  # records a worker answers at once (a block is whole rounds of them)
    address: str | None
    workers: int | None  # None: as many as the cluster's CPUs allow at `threads` each
    threads: int
    summary: Summary = field(default_factory=Summary)
    log_entries: list[Any] = field(default_factory=list)
    worker_memory: list[int] = field(default_factory=list)
    replaced: int = 0  # workers that died and were replaced


Progress = Callable[[int, int, float, int], None]  # (records done, total, tokens/s, workers alive)


def run_on_ray(job: RayJob, cancel: Cancellation, on_result: Callable[[int, Record], None],
               on_progress: Progress | None = None, on_started: Callable[[str], None] | None = None) -> Summary:
    """Answer every item of `job` on Ray; each record to `on_result` as its block comes back (any order)."""
    ray = ray_module()
    started = time.perf_counter()
    local = job.address is None and not os.environ.get("RAY_ADDRESS")
    try:
        if local:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR", namespace=LOG_NAME)
        else:
            ray.init(address=job.address or "auto", log_to_driver=False, logging_level="ERROR", namespace=LOG_NAME)
    except Exception as exc:  # Ray's own errors: a cluster not reachable, a port taken
        raise LlmcliError(f"Ray could not start or reach the cluster: {exc}".splitlines()[0],
                          hint="`ray start --head` on the head node, then --ray-address HOST:6379 "
                               "(or no address: a local cluster of this machine's cores).") from None
    try:
        return _Driver(ray, job, cancel, on_result, on_progress, on_started, started).run()
    finally:
        ray.shutdown()  # a local cluster stops with it; a remote one keeps running, without this job's actors


class _Driver:
    def __init__(self, ray: Any, job: RayJob, cancel: Cancellation, on_result: Callable[[int, Record], None],
                 on_progress: Progress | None, on_started: Callable[[str], None] | None, started: float):
        self.ray, self.job, self.cancel, self.on_result = ray, job, cancel, on_result
        self.on_progress, self.started = on_progress, started
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.n_workers = max(1, job.workers or cpus // max(1, job.threads))
        if job.threads > cpus:
            raise UsageError(f"--threads {job.threads} per worker: the cluster has {cpus} CPUs")
        self.actor_class = ray.remote(num_cpus=job.threads, max_restarts=0)(job.worker)
        todo = [item for item in job.items if item.error is None]
        for item in job.items:
            if item.error is not None:
                self._record(item.index, item.error_record(item.error), error=True)
        size = _block_size(len(todo), self.n_workers, job.parallel)
        self.blocks: deque[tuple[list[BatchItem], int]] = deque(
            (todo[start : start + size], 0) for start in range(0, len(todo), size))
        self.running: dict[Any, tuple[Any, list[BatchItem], int]] = {}  # future -> (actor, block, tries)
        self.idle: list[Any] = [self._new_actor() for _ in range(self.n_workers)]
        self._loaded()
        if on_started is not None:
            on_started(f"ray: {_workers(self.n_workers, job.threads)} (models loaded), {len(self.blocks)} blocks of "
                       f"≤ {size} records, {'a local cluster' if job.address is None else job.address}")

    def _new_actor(self) -> Any:
        return self.actor_class.remote(*self.job.worker_args)

    def _loaded(self) -> None:
        """Wait until every worker has loaded the model (their memory then); a load that fails is the job's error,
        in llmcli's words (the model not found, not enough memory), not a retry."""
        ray = self.ray
        try:
            self.job.worker_memory = ray.get([actor.memory.remote() for actor in self.idle])
        except ray.exceptions.RayError as exc:
            for actor in self.idle:
                ray.kill(actor, no_restart=True)
            raise LlmcliError(f"a Ray worker could not load the model: {_cause(exc)}") from None

    def run(self) -> Summary:
        ray, job = self.ray, self.job
        job.summary.prompts, job.summary.parallel = len(job.items), job.parallel
        try:
            while (self.blocks or self.running) and not self.cancel:
                self._hand_out()
                if not self.running:
                    break
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=POLL_S)
                for future in ready:
                    self._collect(future)
                self._progress()
        finally:
            self._stop()
        job.summary.wall_s = time.perf_counter() - self.started
        job.summary.interrupted = bool(self.cancel)
        job.summary.where = f"ray, {_workers(self.n_workers, job.threads)}" + (
            f", {job.replaced} replaced" if job.replaced else "")
        return job.summary

    def _hand_out(self) -> None:
        while self.idle and self.blocks:
            actor = self.idle.pop()
            block, tries = self.blocks.popleft()
            self.running[actor.answer.remote(block)] = (actor, block, tries)

    def _collect(self, future: Any) -> None:
        ray = self.ray
        actor, block, tries = self.running.pop(future)
        try:
            records, summary, entries = ray.get(future)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError):
            self._worker_died(actor, block, tries)
            return
        except ray.exceptions.RayTaskError as exc:  # an error inside the worker that is not a record's own
            raise LlmcliError(f"a Ray worker failed: {_cause(exc)}") from None
        for item, record in zip(block, records, strict=True):
            self._record(item.index, record, error="error" in record)
        self._add(summary)
        self.job.log_entries += entries
        self.idle.append(actor)

    def _worker_died(self, actor: Any, block: list[BatchItem], tries: int) -> None:
        self.ray.kill(actor, no_restart=True)
        if tries < RETRIES:
            self.blocks.appendleft((block, tries + 1))  # to another worker, first
        else:
            for item in block:
                self._record(item.index, item.error_record(f"its Ray worker died {tries + 1} times answering it"),
                             error=True)
        self.job.replaced += 1
        self.idle.append(self._new_actor())

    def _record(self, index: int, record: Record, error: bool) -> None:
        if error:
            self.job.summary.errors += 1
        self.on_result(index, record)

    def _add(self, block: Summary) -> None:
        total = self.job.summary
        total.prompt_tokens += block.prompt_tokens
        total.completion_tokens += block.completion_tokens
        total.prefill_tokens += block.prefill_tokens
        total.decode_steps_s += block.decode_steps_s
        total.decode_step_tokens += block.decode_step_tokens
        total.draft_tokens += block.draft_tokens
        total.accepted_tokens += block.accepted_tokens

    def _progress(self) -> None:
        if self.on_progress is None:
            return
        elapsed = time.perf_counter() - self.started
        done = self.job.summary.prompts - sum(len(b) for b, _ in self.blocks) - sum(
            len(b) for _, b, _ in self.running.values())
        rate = self.job.summary.completion_tokens / elapsed if elapsed > 0 else 0.0
        self.on_progress(done, self.job.summary.prompts, rate, len(self.running) + len(self.idle))

    def _stop(self) -> None:
        """Interrupted (or failed): the actors killed; a record for every item not answered."""
        for actor, _, _ in self.running.values():
            self.ray.kill(actor, no_restart=True)
        for actor in self.idle:
            self.ray.kill(actor, no_restart=True)
        unanswered = [item for _, block, _ in self.running.values() for item in block] + [
            item for block, _ in self.blocks for item in block]
        self.running.clear()
        self.blocks.clear()
        for item in sorted(unanswered, key=lambda item: item.index):
            self.job.summary.not_started += 1
            self.on_result(item.index, item.error_record("interrupted before it was answered"))


def _cause(exc: BaseException) -> str:
    """The worker's own error line out of Ray's report of it (`llmcli.errors.ModelNotFoundError: …`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        name, sep, message = line.partition(": ")
        if sep and name.rsplit(".", 1)[-1].endswith(("Error", "Exception")):
            return message
    return lines[-1] if lines else type(exc).__name__


def _workers(n: int, threads: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''} × {threads} thread{'s' if threads != 1 else ''}"


def _block_size(n_records: int, n_workers: int, parallel: int) -> int:
    """Records a block: a whole number of rounds of `parallel` sequences (a block's last round leaves slots idle), about
    four blocks a worker (a lost block is a small loss; the last ones spread out), at most 8 rounds."""
    rounds = -(-n_records // (4 * n_workers * parallel))
    return parallel * max(1, min(8, rounds))
