"""`llmcli templates`: the prompt templates saved in the config file."""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import Annotated

import typer

from llmcli.errors import UsageError

app = typer.Typer(help="Prompt templates: a system prompt, a prompt with $input, settings (run -T NAME).",
                  no_args_is_help=True)
NameArg = Annotated[str, typer.Argument(help="The template's name.", show_default=False)]


@app.command("list")
def list_templates() -> None:
    """Every template: its name and the start of its prompt or system prompt."""
    from llmcli.saved_templates import all_templates

    for template in all_templates():
        text = (template.prompt or template.system or "").replace("\n", " ")
        print(f"{template.name:<20} {text[:70]}{'…' if len(text) > 70 else ''}")


@app.command("show")
def show(name: NameArg) -> None:
    """One template as it is saved."""
    from llmcli.saved_templates import load
    from llmcli.settings import show_value

    template = load(name)
    for key in ("system", "prompt"):
        if getattr(template, key) is not None:
            print(f"{key}: {getattr(template, key)}")
    for key, value in template.settings.items():
        print(f"{key}: {show_value(value)}")
    print(f"placeholders: {', '.join('$' + p for p in template.placeholders) or 'none'}")


@app.command("edit")
def edit(name: NameArg) -> None:
    """Open the config file in $EDITOR (the template is added first if it is new), then check it."""
    from llmcli import paths
    from llmcli.saved_templates import PromptTemplate, load, save
    from llmcli.settings import load_config_file

    if name not in load_config_file().templates:
        save(PromptTemplate(name, None, "$input"))
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    if subprocess.call([*shlex.split(editor), str(paths.config_file())]) != 0:
        raise UsageError(f"{editor} exited with an error; the config file may not be saved")
    load(name)  # one-line error if the edit broke it


@app.command("rm")
def remove(name: NameArg) -> None:
    """Remove a template from the config file."""
    from llmcli.saved_templates import remove as remove_template

    remove_template(name)
    print(f"removed template {name}")
