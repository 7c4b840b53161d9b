"""Command-line options: the settings' options generated from the one table (llmcli/config/settings.py), and
the options that are not settings, declared once here and shared by the commands that take them.

Setting options default to None ("not given") so that the precedence rule
(flag > env > profile > config file > model > built-in) can tell a flag from a default;
their built-in default is shown in the help, generated from the table.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

from llmcli.config.settings import DOWNLOADS, ENGINE, MODEL, OUTPUT, REMOTE, SETTINGS, Setting

if TYPE_CHECKING:
    from llmcli.pipeline import Request

F = TypeVar("F", bound=Callable[..., Any])


def complete_model(incomplete: str) -> list[str]:
    """Shell completion for model names: installed models, aliases, the cache."""
    from llmcli.config.settings import load_config_file
    from llmcli.store import catalog

    try:
        aliases = load_config_file().aliases
    except Exception:  # a broken config file must not break the shell's completion
        aliases = {}
    return [name for name in catalog.known_names(aliases) if name.lower().startswith(incomplete.lower())]


def complete_choices(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion for an option that takes one of `choices` (not the files a shell offers by default)."""
    return lambda incomplete: [choice for choice in choices if choice.startswith(incomplete)]


# What the table cannot say about a setting's option: the CLI-only extras.
_EXTRAS: dict[str, dict[str, Any]] = {"model": {"autocompletion": complete_model}}


def setting_option(setting: Setting) -> Any:
    """The Typer option of one row of the settings table."""
    kind: Any = {list: Optional[list[str]], bool: Optional[bool], int: Optional[int], float: Optional[float]}.get(
        setting.kind, Optional[str])
    choices = f" ({'|'.join(setting.choices)})" if setting.choices else ""
    help_text = f"{setting.help}{choices} [default: {setting.shown_default()}; env {setting.env}]"
    extras = _EXTRAS.get(setting.name) or ({"autocompletion": complete_choices(setting.choices)} if setting.choices else {})
    option = typer.Option(*setting.flags, help=help_text, show_default=False, rich_help_panel=setting.panel, **extras)
    return Annotated[kind, option]


# -- options that are not settings --------------------------------------------------------------

ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", "-p", help="Use a [profiles.NAME] table of the config file ($LLMCLI_PROFILE).", show_default=False,
    rich_help_panel=MODEL)]
OfflineOpt = Annotated[bool, typer.Option(
    "--offline", help="Use only the local cache; never contact the Hub ($HF_HUB_OFFLINE=1).", rich_help_panel=DOWNLOADS)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Skip the check that the model and its KV cache fit in memory.",
                                        rich_help_panel=ENGINE)]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as-is, without the chat template (base models).",
                                      rich_help_panel=MODEL)]
TemplateFileOpt = Annotated[Optional[Path], typer.Option(
    "--chat-template-file", help="A Jinja chat template to use instead of the model's.", dir_okay=False, show_default=False,
    rich_help_panel=MODEL)]
_CONSTRAIN = "Constrained output"
LogitBiasOpt = Annotated[Optional[list[str]], typer.Option(
    "--logit-bias", help="TOKEN=BIAS: add BIAS to a token's logit (id or one-token text; -inf bans it). Repeatable.",
    show_default=False, rich_help_panel=_CONSTRAIN)]
GrammarOpt = Annotated[Optional[str], typer.Option(
    "--grammar", help="Constrain the answer with a GBNF grammar (root rule: root).", show_default=False,
    rich_help_panel=_CONSTRAIN)]
GrammarFileOpt = Annotated[Optional[Path], typer.Option(
    "--grammar-file", help="Constrain the answer with the GBNF grammar in FILE.", show_default=False,
    rich_help_panel=_CONSTRAIN)]
JsonSchemaOpt = Annotated[Optional[str], typer.Option(
    "--json-schema", help="Constrain the answer to JSON matching this schema (JSON text or a file); checked when it "
    "ends (exit 8 if not).", show_default=False, rich_help_panel=_CONSTRAIN)]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", help="(json) The answer is one JSON value, checked when it ends (exit 8 if not).", show_default=False,
    rich_help_panel=_CONSTRAIN, autocompletion=complete_choices(("json",)))]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", help="The API key of --endpoint's server ($LLMCLI_API_KEY).",
    show_default=False, rich_help_panel=REMOTE)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log on stderr.", rich_help_panel=ENGINE)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Do not print the stats line on stderr.", rich_help_panel=OUTPUT)]
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object (text, finish reason, token counts, timings) on stdout.", rich_help_panel=OUTPUT)]

# The options every command that answers prompts takes, besides the settings: name -> (annotation, default).
REQUEST_OPTIONS: dict[str, tuple[Any, Any]] = {
    "profile": (ProfileOpt, None),
    "offline": (OfflineOpt, False),
    "force": (ForceOpt, False),
    "raw": (RawOpt, False),
    "chat_template_file": (TemplateFileOpt, None),
    "logit_bias": (LogitBiasOpt, None),
    "grammar": (GrammarOpt, None),
    "grammar_file": (GrammarFileOpt, None),
    "json_schema": (JsonSchemaOpt, None),
    "output_format": (FormatOpt, None),
    "verbose": (VerboseOpt, False),
    "api_key": (ApiKeyOpt, None),
}


def with_settings(*, request: bool = True, only: tuple[str, ...] | None = None,
                  exclude: tuple[str, ...] = (), tools: bool = False) -> Callable[[F], F]:
    """Give a command `def cmd(explicit…, **given)` the options of every setting (or of those named in `only`, but
    none in `exclude`: each command offers what applies to it) and, with `request`, REQUEST_OPTIONS (but `exclude`): Typer reads a
    command's options from its signature, so they are added there, generated from the tables instead of written
    out in each command. A setting left out is absent from `given`."""

    def decorate(command: F) -> F:
        explicit = [p for p in inspect.signature(command, eval_str=True).parameters.values()
                    if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [(name, annotation, default) for name, (annotation, default) in REQUEST_OPTIONS.items()
                 if name not in exclude] if request else [("profile", ProfileOpt, None)]
        if tools:
            from llmcli.cli.tool_options import TOOL_OPTIONS

            added += [(name, annotation, default) for name, (annotation, default) in TOOL_OPTIONS.items()]
        added += [(name, setting_option(setting), None) for name, setting in SETTINGS.items()
                  if (only is None or name in only) and name not in exclude]
        params = explicit + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                             for name, annotation, default in added]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def given_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given on the command line, by name (an empty --stop list is 'not given')."""
    return {name: given[name] for name in SETTINGS if given.get(name) not in (None, [])}


def build_request(given: Mapping[str, Any], parallel: int | None = None) -> Request:
    """The Request that a command's options (settings and REQUEST_OPTIONS) describe; `parallel`: run --batch."""
    from llmcli.pipeline import Request, Shape  # not for --help: it loads the settings table and the store

    return Request(
        settings=given_settings(given),
        profile=given["profile"],
        raw=given["raw"],
        template_file=given["chat_template_file"],
        logit_bias=tuple(given["logit_bias"] or ()),
        grammar=given["grammar"],
        grammar_file=given["grammar_file"],
        json_schema=given["json_schema"],
        output_format=given["output_format"],
        verbose=given["verbose"],
        api_key=given.get("api_key"),  # (serve's own --api-key is the key requests bring, not this)
        offline=given["offline"],
        force=given["force"],
        shape=Shape(parallel, batch=True) if parallel is not None else Shape(),
    )
