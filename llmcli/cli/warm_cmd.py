"""`llmcli ps` and `llmcli stop`: the private servers that keep models warm between runs (--keep-alive)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.errors import LlmcliError, ModelNotFoundError
from llmcli.units import human_size

if TYPE_CHECKING:
    from llmcli.pipeline.warm import Health

JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per server on stdout.")]
UrlOpt = Annotated[Optional[str], typer.Option(
    "--url", help="Instead: what the `llmcli serve` at this URL has loaded (http://127.0.0.1:8080).",
    show_default=False)]
ModelArg = Annotated[Optional[str], typer.Argument(help="The model whose server to stop (none: every one).",
                                                   show_default=False)]


def ps(as_json: JsonOpt = False, url: UrlOpt = None) -> None:
    """The warm servers (`--keep-alive`): model, process, memory, when each exits; with --url, a server's models."""
    from llmcli.cli.output import print_table
    from llmcli.pipeline import launch
    from llmcli.pipeline.warm import running, served_at

    servers: list[tuple[Path | str, Health]] = [*running(), *launch.running()] if url is None \
        else [(url, served_at(url))]
    if as_json:
        for where, state in servers:
            print(json.dumps(_record(where, state)))
        return
    rows = []
    for where, state in servers:
        record = _record(where, state)
        for model in record["models"]:
            slots = model.get("slots") or {}
            known = record["pid"] > 0  # (a server tells its pid only to its key's holder: --url without it)
            restarts = (slots.get("engine") or {}).get("restarts")
            rows.append((model["name"], str(model.get("n_ctx") or "-"), str(record["pid"]) if known else "-",
                         human_size(model.get("size") or 0), f"{record['rss_mib']:.0f} MiB" if known else "-",
                         f"{slots.get('busy', 0)}/{slots.get('slots', 0)}", str(restarts) if restarts is not None else "-",
                         _expiry(model), record["socket"]))
    # (CONTEXT: a run with another -c has a server of its own, so one model may have two rows)
    print_table(("MODEL", "CONTEXT", "PID", "FILE", "MEMORY", "BUSY", "RESTARTS", "EXITS", "WHERE"), rows,
                right=("CONTEXT", "PID", "FILE", "MEMORY", "RESTARTS"),
                empty="No warm server: `llmcli run …` starts one (unless --keep-alive 0).")


def stop(model: ModelArg = None) -> None:
    """End warm servers (each finishes its answers first): the one of MODEL, or every one."""
    from llmcli.cli.output import stderr_console
    from llmcli.pipeline import launch
    from llmcli.pipeline.warm import running
    from llmcli.pipeline.warm import stop as stop_server

    path = _path_of(model) if model is not None else None
    chosen = [(socket, state) for socket, state in [*running(), *launch.running()]
              if model is None or model in {state.get("model"), *(m["name"] for m in state.get("models", []))}
              or str(path) in {m.get("path") for m in state.get("models", [])}]
    console = stderr_console()
    if not chosen:  # stopping nothing is done (exit 0); a name that means no model at all is not (exit 3)
        if model is not None and path is None:
            raise ModelNotFoundError(f"no warm server of {model}, and no model of that name",
                                     hint="llmcli ps lists the warm servers.")
        console.print(f"no warm server of {model} is running" if model else "no warm server is running")
        return
    for socket, state in chosen:
        if not stop_server(socket, state):
            raise LlmcliError(f"the server of {state.get('model')} (pid {state.get('pid')}) did not stop in time")
        console.print(f"stopped {state.get('model')} (pid {state.get('pid')})")


def _path_of(model: str) -> Path | None:
    """The file a model reference means here (None if it means none)."""
    from llmcli.config.settings import load_config_file
    from llmcli.store.catalog import local_model

    try:
        return local_model(model, load_config_file().aliases).path.resolve()
    except LlmcliError:
        return None


def _record(where: Path | str, state: Health) -> Health:
    from llmcli.pipeline.warm import server_pids

    pid = int(state.get("pid") or 0)  # (the memory: the server's and its engines', where each model is loaded)
    rss = sum(_rss_mib(each) for each in server_pids(state)) if pid else 0.0
    return {"model": state.get("model"), "pid": pid, "socket": state.get("url") or str(where), "rss_mib": rss,
            "models": state.get("models") or [], "version": state.get("version")}


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return 0.0
    return 0.0


def _expiry(model: Health) -> str:
    seconds = model.get("expires_in_s")
    if seconds is None:
        return "never" if model.get("pinned") else "when idle"
    return f"in {seconds:.0f} s" if seconds < 120 else f"in {seconds / 60:.0f} min"
