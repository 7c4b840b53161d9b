"""`llmcli embed` and `llmcli similar`: vectors for texts, and the stored texts nearest to a query."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmcli.answer.batch_jsonl import read_json_line
from llmcli.cli import options as o
from llmcli.errors import ExitCode, ResourceError, StdoutClosed, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmcli.embed.embedded import Embedded
    from llmcli.embed.embedding import Embedder
    from llmcli.pipeline import Request
    from llmcli.pipeline.warm import WarmEmbedder

EmbedRecord = dict[str, Any]  # one text's JSONL object, as json.loads reads it (with its other fields)

SETTINGS_TAKEN = ("model", "ctx_size", "threads", "mmap", "mlock", "keep_alive")
TextArg = Annotated[Optional[str], typer.Argument(
    help="The text to embed (prints one JSON vector). Without it: --input, else one text per line of stdin.",
    show_default=False)]
InputOpt = Annotated[Optional[Path], typer.Option(
    "--input", "-i", help="JSONL in (`-`: stdin): each object gets an `embedding` (or an `error`), in input order.",
    show_default=False)]
FieldOpt = Annotated[str, typer.Option("--field", help="The field of each JSONL object that holds its text.")]
FormatOpt = Annotated[str, typer.Option("--format", help="jsonl (one object per text) or npy (one float32 array).",
                                        autocompletion=o.complete_choices(("jsonl", "npy")))]
PoolingOpt = Annotated[str, typer.Option(
    "--pooling", help="model (its own pooling, else mean), mean, cls or last.")]
NormalizeOpt = Annotated[bool, typer.Option("--normalize/--no-normalize", help="Scale each vector to length 1.")]
TruncateOpt = Annotated[bool, typer.Option(
    "--truncate", help="Embed the first tokens of a text longer than the context (else: an error record).")]
PerBatchOpt = Annotated[int, typer.Option("--texts-per-pass", min=1, max=256,
                                          help="Texts evaluated together in one pass (-b, --batch-size elsewhere: "
                                          "prompt tokens per step).")]


RayOpt = Annotated[bool, typer.Option(
    "--ray", help="With --input: embed on a Ray cluster — $RAY_ADDRESS or --ray-address, else a local one (needs the "
    "ray extra); JSONL out.")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", help="With --input: the Ray cluster to embed on; implies --ray.", show_default=False)]
RayWorkersOpt = Annotated[Optional[int], typer.Option(
    "--ray-workers", min=1, max=4096, show_default=False, help="With --ray: workers, each loading the model once.")]


@o.with_settings(request=False, only=SETTINGS_TAKEN)
def embed(
    text: TextArg = None,
    *,
    input_file: InputOpt = None,
    field: FieldOpt = "text",
    output_format: FormatOpt = "jsonl",
    pooling: PoolingOpt = "model",
    normalize: NormalizeOpt = False,
    truncate: TruncateOpt = False,
    texts_per_batch: PerBatchOpt = 32,
    force: o.ForceOpt = False,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    ray_workers: RayWorkersOpt = None,
    request: Request,
) -> None:
    """Embed texts with any GGUF (a dedicated embedding model, or a chat model with mean pooling)."""
    from llmcli.cli import output
    from llmcli.cli.stream import write_json_line

    if output_format not in ("jsonl", "npy"):
        raise UsageError(f"--format must be jsonl or npy (got {output_format!r})")
    records = _records(text, input_file, field)
    if ray or ray_address is not None:
        if input_file is None or output_format != "jsonl":
            raise UsageError("--ray embeds an --input file into JSONL", hint="llmcli embed --input texts.jsonl --ray")
        _embed_on_ray(records, field, replace(request, force=force), pooling, normalize, truncate, texts_per_batch,
                      ray_address, ray_workers)
    embedder = _open(replace(request, force=force), pooling, normalize, truncate, texts_per_batch)
    texts = [record.get(field, "") if "error" not in record else "" for record in records]
    with embedder.engine, output.progress_bar("embed") as advance:
        results = list(embedder.embed([t if isinstance(t, str) else "" for t in texts],
                                      lambda done: advance(done, len(texts), "embed")))
    if text is not None:
        (result,) = results
        if result.vector is None:
            raise _failure(result)
        output.print_json(result.vector)
        return
    if output_format == "npy":
        _write_npy(records, results)
        return
    failed = 0
    for index, (record, result) in enumerate(zip(records, results, strict=True)):
        if "error" in record or result.vector is None:
            failed += 1
            write_json_line({**record, "index": index, "error": record.get("error") or result.error})
        else:
            write_json_line({**record, "index": index, "embedding": result.vector, "tokens": result.tokens})
    if failed and failed == len(records):  # nothing embedded: a failure (the records say why, one by one)
        first = next((r for r in results if r.vector is None), None)
        raise _failure(first) if first is not None else UsageError(records[0]["error"])
    if failed:  # some embedded: as --batch, the error records say which did not, and the exit code is 0
        output.print_notice(output.stderr_console(), f"{failed} of {len(records)} texts have an error record")


def _failure(result: Embedded) -> UsageError | ResourceError:
    """A text with no vector, as the command's error: too long is a resource (exit 6), anything else bad input."""
    message = result.error or "no vector"
    return ResourceError(message, hint="Or a larger -c (--ctx-size).") if result.too_long \
        else UsageError(message)


@o.with_settings(request=False, only=SETTINGS_TAKEN)
def similar(
    query: Annotated[str, typer.Argument(help="The text to compare with the collection.", show_default=False)],
    *,
    collection: Annotated[Path, typer.Option(
        "--collection", help="JSONL with an `embedding` per line (what `llmcli embed` writes).", show_default=False)],
    top: Annotated[int, typer.Option("--top", "-n", min=1, help="How many to show.")] = 5,
    as_json: o.JsonOpt = False,
    pooling: PoolingOpt = "model",
    normalize: NormalizeOpt = False,
    force: o.ForceOpt = False,
    request: Request,
) -> None:
    """The texts of a collection nearest to a query: cosine similarity, embedded with the same model and pooling."""
    from llmcli.cli import output
    from llmcli.embed.embedding import cosine

    stored = _collection(collection)
    embedder = _open(replace(request, force=force), pooling, normalize, False, 1)
    with embedder.engine:
        (result,) = list(embedder.embed([query]))
    if result.vector is None:
        raise UsageError(result.error or "the query has no vector")
    dims = {len(r["embedding"]) for r in stored}
    if dims != {len(result.vector)}:
        raise UsageError(f"{collection} holds vectors of {', '.join(map(str, sorted(dims)))} dimensions; this model "
                         f"makes {len(result.vector)}", hint="Embed the query with the model that made the collection (-m).")
    ranked = sorted(((cosine(result.vector, r["embedding"]), r) for r in stored), key=lambda pair: -pair[0])[:top]
    if as_json:
        output.print_json([{"score": round(score, 6), **{k: v for k, v in r.items() if k != "embedding"}}
                           for score, r in ranked])
        return
    for score, record in ranked:
        label = record.get("text") if isinstance(record.get("text"), str) else json.dumps(
            {k: v for k, v in record.items() if k != "embedding"}, ensure_ascii=False)
        print(f"{score:.4f}  {label}")


def _open(request: Request, pooling: str, normalize: bool, truncate: bool, per_batch: int) -> Embedder | WarmEmbedder:
    from llmcli.cli import output
    from llmcli.embed.embedding import POOLINGS
    from llmcli.pipeline.local import open_embedder

    if pooling not in POOLINGS:
        raise UsageError(f"--pooling must be one of {', '.join(POOLINGS)} (got {pooling!r})")
    with output.download_progress() as progress:
        warm = _warm(request, pooling, normalize, truncate, progress)
        if warm is not None:
            return warm
        _, _, embedder = open_embedder(request, pooling, normalize, truncate, per_batch, progress)
    return embedder


def _warm(request: Request, pooling: str, normalize: bool, truncate: bool,
          progress: Callable[[str, int, int | None], None]) -> WarmEmbedder | None:
    """Unless --keep-alive 0: the warm server's embedder (None: none, or it will not start — then a notice)."""
    from llmcli.cli import output
    from llmcli.errors import LlmcliError
    from llmcli.pipeline import resolve_settings
    from llmcli.pipeline.warm import WarmEmbedder, ensure, first_start_notice, without_serve
    from llmcli.units import keeps_loaded

    effective, model = resolve_settings(request, progress)
    if not keeps_loaded(effective["keep_alive"]):
        return None
    why_not = without_serve(effective.sources["keep_alive"] != "default", "embedding")
    if why_not is not None:  # (quietly in this process, unless a keep-alive was asked for)
        if why_not:
            output.print_notice(output.stderr_console(), why_not)
        return None
    if pooling != "model":
        output.print_notice(output.stderr_console(), "--keep-alive's server embeds with the model's own pooling: "
                            f"--pooling {pooling} is answered in this process")
        return None
    try:
        server = ensure(model.path, effective, None, projector=model.projector)
    except LlmcliError as exc:
        output.print_notice(output.stderr_console(), f"{exc.message}; embedding in this process")
        return None
    notice = first_start_notice(model.name, str(effective["keep_alive"])) if server.start_s is not None else None
    if notice:
        output.print_notice(output.stderr_console(), notice)
    return WarmEmbedder(server, normalize, truncate)


def _records(text: str | None, input_file: Path | None, field: str) -> list[EmbedRecord]:
    """What to embed, as records: the argument, the JSONL objects (bad lines become error records), or stdin lines."""
    if text is not None:
        if input_file is not None:
            raise UsageError("give a text or --input, not both")
        return [{field: text}]
    if input_file is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("nothing to embed: give a text, --input FILE, or pipe lines in")
        return [{field: line} for line in sys.stdin.read().splitlines()]
    try:
        lines = (sys.stdin.read() if str(input_file) == "-" else input_file.read_text(encoding="utf-8")).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --input {input_file}: {exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        record, problem = read_json_line(line)
        if problem is not None:
            records.append({"error": f"line {number}: not JSON ({problem})"})
            continue
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            records.append({"error": f"line {number}: no {field!r} string"})
            continue
        records.append(record)
    return records


def _collection(path: Path) -> list[EmbedRecord]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --collection {path}: {exc}") from None
    stored = []
    for line in lines:
        record, _ = read_json_line(line)
        if isinstance(record, dict) and isinstance(record.get("embedding"), list) and record["embedding"]:
            stored.append(record)
    if not stored:
        raise UsageError(f"{path} holds no record with an `embedding`", hint="llmcli embed --input FILE > collection.jsonl")
    return stored


def _write_npy(records: list[EmbedRecord], results: list[Embedded]) -> None:
    import numpy as np

    bad = [i for i, (record, result) in enumerate(zip(records, results, strict=True))
           if "error" in record or result.vector is None]
    if bad:
        raise UsageError(f"texts {bad[:5]} have no vector: --format npy needs one for every text",
                         hint="--format jsonl keeps going past them with error records.")
    data = io.BytesIO()  # numpy asks a file where it is: a pipe cannot say
    np.save(data, np.asarray([r.vector for r in results], dtype=np.float32))
    try:
        sys.stdout.buffer.write(data.getvalue())
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None
    raise typer.Exit(ExitCode.OK)


def _embed_on_ray(records: list[EmbedRecord], field: str, request: Request, pooling: str, normalize: bool,
                  truncate: bool, per_pass: int, address: str | None, workers: int | None) -> None:
    """`embed --input FILE --ray`: the records embedded by Ray workers (llmcli/cluster/ray_batch.py), in input order."""
    from llmcli.answer.batch_jsonl import BatchItem
    from llmcli.cli import output
    from llmcli.cli.batch import run_ray_job
    from llmcli.cluster.ray_batch import EmbedWorker, RayJob
    from llmcli.embed.embedding import POOLINGS

    if pooling not in POOLINGS:
        raise UsageError(f"--pooling must be one of {', '.join(POOLINGS)} (got {pooling!r})")
    threads = request.settings.get("threads") or 1
    items = [BatchItem(index, record.get(field), {k: v for k, v in record.items() if k != "error"}, record.get("error"))
             for index, record in enumerate(records)]
    job = RayJob(items, EmbedWorker, (request, threads, pooling, normalize, truncate, per_pass), per_pass, address,
                 workers, threads)
    summary, signum = run_ray_job(job, {}, False, False)
    from llmcli.units import counted

    output.stderr_console().print(f"embed: {counted(len(records), 'text')} ({counted(summary.errors, 'error')}) · "
                                  f"{summary.prompt_tokens} tok · {summary.wall_s:.2f} s · {summary.where}", style="dim")
    raise typer.Exit(128 + signum if signum is not None else ExitCode.OK)
