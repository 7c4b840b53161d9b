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
    from llmcli.config.saved_templates import all_templates

    templates = all_templates()
    if not templates:
        from llmcli.cli import output

        output.stderr_console().print('no templates saved yet (llmcli run --save NAME -s "…" "… $input …")')
    for template in templates:
        text = (template.prompt or template.system or "").replace("\n", " ")
        print(f"{template.name:<20} {text[:70]}{'…' if len(text) > 70 else ''}")


@app.command("show")
def show(name: NameArg) -> None:
    """One template as it is saved."""
    from llmcli.config.saved_templates import load
    from llmcli.config.setting import show_value

    template = load(name)
    for key in ("system", "prompt"):
        if getattr(template, key) is not None:
            print(f"{key}: {getattr(template, key)}")
    for key, value in template.settings.items():
        print(f"{key}: {show_value(value)}")
    print(f"placeholders: {', '.join('$' + p for p in template.placeholders) or 'none'}")


@app.command("edit")
def edit(name: NameArg) -> None:
    """Open the template (a new one starts as `prompt = "$input"`) in $VISUAL or $EDITOR; it is checked and saved
    back into the config file when the editor exits, the rest of the file untouched."""
    import tempfile
    from pathlib import Path

    from llmcli.config.config_file import check_name
    from llmcli.config.saved_templates import as_text, replace_from_text

    check_name(name, "template")
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.TemporaryDirectory(prefix="llmcli-template-") as folder:
        path = Path(folder) / f"{name}.toml"
        path.write_text(as_text(name), encoding="utf-8")
        if subprocess.call([*shlex.split(editor), str(path)]) != 0:
            raise UsageError(f"{editor} exited with an error; the template is unchanged")
        template = replace_from_text(name, path.read_text(encoding="utf-8"))
    print(f"saved template {template.name}")


@app.command("rm")
def remove(name: NameArg) -> None:
    """Remove a template from the config file."""
    from llmcli.config.saved_templates import remove as remove_template

    remove_template(name)
    print(f"removed template {name}")
