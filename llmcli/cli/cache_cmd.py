"""`llmcli cache`: the prompt cache on disk (saved KV states of long prompts): list, info, clear."""

from __future__ import annotations

import typer

from llmcli.cli import options as o
from llmcli.cli.help import EXAMPLES
from llmcli.units import counted

app = typer.Typer(help="The prompt cache: KV states of long prompts saved on disk, reused by later runs.",
                  no_args_is_help=True)


@app.command("list", epilog=EXAMPLES["cache list"])
def list_states(as_json: o.JsonOpt = False) -> None:
    """Every saved state, the most recently used first: model, tokens, size, last use."""
    import time

    from llmcli import paths
    from llmcli.cli import output
    from llmcli.store.prompt_store import all_entries
    from llmcli.units import human_size

    entries = sorted(all_entries(paths.prompt_cache_dir()), key=lambda e: e.used, reverse=True)
    if as_json:
        output.print_json([{"path": str(e.path), "model": e.model, "tokens": e.n_tokens, "bytes": e.size,
                            "last_used": e.used, "key": e.key} for e in entries])
        return
    rows = [(e.path.stem[:12], e.model, e.n_tokens, human_size(e.size),
             time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))) for e in entries]
    output.print_table(("ID", "MODEL", "TOKENS", "SIZE", "LAST USED"), rows, right=("TOKENS", "SIZE"),
                       empty=f"no saved prompt states yet (in {paths.prompt_cache_dir()})")


@app.command("info", epilog=EXAMPLES["cache info"])
def info(as_json: o.JsonOpt = False) -> None:
    """Where the prompt cache is, how much it holds and its budget."""
    from llmcli import paths
    from llmcli.cli import output
    from llmcli.config.settings import resolve
    from llmcli.store.prompt_store import all_entries
    from llmcli.units import human_size

    effective = resolve({})
    entries = all_entries(paths.prompt_cache_dir())
    used = sum(e.size for e in entries)
    budget = int(effective["prompt_cache_size"] * 2**30)
    record = {"path": str(paths.prompt_cache_dir()), "enabled": effective["prompt_cache"], "states": len(entries),
              "bytes": used, "budget_bytes": budget, "min_tokens": effective["prompt_cache_min"],
              "tokens": sum(e.n_tokens for e in entries)}
    if as_json:
        output.print_json(record)
        return
    output.print_fields([
        ("path", record["path"]),
        ("enabled", "yes" if effective["prompt_cache"] else f"no ({effective.sources['prompt_cache']})"),
        ("states", f"{len(entries)} ({record['tokens']} tokens)"),
        ("size", f"{human_size(used)} of {human_size(budget)} (--prompt-cache-size)"),
        ("saves", f"prompts with at least {effective['prompt_cache_min']} tokens evaluated (--prompt-cache-min)"),
    ])


@app.command("clear", epilog=EXAMPLES["cache clear"])
def clear() -> None:
    """Remove every saved state (prompts are evaluated again the next time)."""
    from llmcli import paths
    from llmcli.store.prompt_store import clear as clear_store
    from llmcli.units import human_size

    removed, freed = clear_store(paths.prompt_cache_dir())
    print(f"removed {counted(removed, 'saved state')}, {human_size(freed)}")
