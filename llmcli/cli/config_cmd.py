"""`llmcli config`: where the config file is, and every effective setting with its source."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from llmcli.cli import options as o
from llmcli.cli.help import EXAMPLES, PanelledCommand

if TYPE_CHECKING:
    from llmcli.pipeline import Request

app = typer.Typer(help="Show the effective settings and where each comes from.", no_args_is_help=True)


@app.command("show", cls=PanelledCommand, epilog=EXAMPLES["config show"])
@o.with_settings(request=False)
def show(*, as_json: o.JsonOpt = False, request: Request) -> None:
    """Print each effective setting, its value and where it came from (flag > env > profile > config > model > default)."""
    from llmcli import paths
    from llmcli.cli import output
    from llmcli.config.settings import SETTINGS
    from llmcli.pipeline import resolve_settings

    effective, model = resolve_settings(request)
    if as_json:
        record = {name: {"value": effective[name], "source": effective.sources[name]} for name in SETTINGS}
        output.print_json({"config_file": str(paths.config_file()), "profile": effective.profile,
                           "model_path": str(model.path), "settings": record})
        return
    rows = []
    for name, setting in SETTINGS.items():
        value = effective[name]
        shown = model.path if name == "model" and value is None else value
        rows.append((setting.flag, shown, effective.sources[name]))
    title = f"config file: {paths.config_file()}" + (f" · profile {effective.profile}" if effective.profile else "")
    output.print_table(("SETTING", "VALUE", "SOURCE"), rows, title=title)


@app.command("path")
def path() -> None:
    """Print the path of the config file ($LLMCLI_CONFIG or the platform config dir)."""
    from llmcli import paths

    print(paths.config_file())
