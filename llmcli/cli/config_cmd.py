"""`llmcli config`: where the config file is, and every effective setting with its source."""

from __future__ import annotations

import inspect
import json
from typing import Any

import typer

from llmcli.cli import options as o
from llmcli.cli.run import run, setting_flags

app = typer.Typer(help="Show the effective settings and where each comes from.", no_args_is_help=True)


def show(**given: Any) -> None:
    """Print each effective setting, its value and where it came from (flag > env > profile > config > model > default)."""
    from rich.console import Console
    from rich.table import Table

    from llmcli.pipeline import Request, resolve_settings
    from llmcli.settings import SETTINGS, config_path

    effective, model = resolve_settings(Request(setting_flags(given), given.get("profile")))
    if given.get("as_json"):
        record = {name: {"value": effective[name], "source": effective.sources[name]} for name in SETTINGS}
        print(json.dumps({"config_file": str(config_path()), "profile": effective.profile, "model_path": str(model.path), "settings": record}))
        return
    table = Table(title=f"config file: {config_path()}" + (f" · profile {effective.profile}" if effective.profile else ""))
    for column in ("setting", "value", "source"):
        table.add_column(column)
    for name, setting in SETTINGS.items():
        value = effective[name]
        shown = model.path if name == "model" and value is None else value
        table.add_row(setting.flag, "" if shown is None else str(shown), effective.sources[name])
    Console(highlight=False).print(table)


# `config show` takes exactly the setting flags of `run`: declared once, there.
o.borrow_options(show, run, [*setting_flags({name: 1 for name in inspect.signature(run).parameters}), "profile"],
                 [o.option("as_json", o.JsonOpt, False)])
app.command("show")(show)


@app.command("path")
def path() -> None:
    """Print the path of the config file ($LLMCLI_CONFIG or the platform config dir)."""
    from llmcli.settings import config_path

    print(config_path())
