"""Command-line options: the settings' options generated from the one table (llmcli/config/settings.py), and
the options that are not settings, declared once here and shared by the commands that take them.

Setting options default to None ("not given") so that the precedence rule
(flag > env > profile > config file > model > built-in) can tell a flag from a default;
their built-in default is shown in the help, generated from the table.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmcli.config.setting import Setting
from llmcli.config.settings import DOWNLOADS, ENGINE, MODEL, OUTPUT, REMOTE, SETTINGS

if TYPE_CHECKING:
    from llmcli.pipeline import Request

Command = Callable[..., None]


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


def setting_option(setting: Setting) -> object:
    """The Typer option of one row of the settings table."""
    kind: Any = {list: Optional[list[str]], bool: Optional[bool], int: Optional[int], float: Optional[float]}.get(
        setting.kind, Optional[str])
    choices = f" ({'|'.join(setting.choices)})" if setting.choices else ""
    help_text = f"{setting.help}{choices} [default: {setting.shown_default()}; env {setting.env}]"
    completion = complete_model if setting.name == "model" else complete_choices(setting.choices) \
        if setting.choices else None  # (what the table cannot say: the CLI's own)
    option = typer.Option(*setting.flags, help=help_text, show_default=False, rich_help_panel=setting.panel,
                          autocompletion=completion)
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
REQUEST_OPTIONS: dict[str, tuple[object, object]] = {
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
                  exclude: tuple[str, ...] = (), tools: bool = False) -> Callable[[Command], Callable[..., None]]:
    """Give a command `def cmd(explicit…, request: Request[, tools: ToolOptions])` the options of every setting (or of
    those named in `only`, but none in `exclude`: each command offers what applies to it) and, with `request`,
    REQUEST_OPTIONS (but `exclude`); with `tools`, the tool options. Typer reads a command's options from its
    signature, so they are added there, generated from the tables instead of written out in each command; what they
    say reaches the command typed, read once: the `Request` (the settings given, by name) and the `ToolOptions`."""

    def decorate(command: Command) -> Callable[..., None]:
        typed_by_us = {"Request": object, "ToolOptions": object}  # (names a command may import for its type checks alone)
        explicit = [p for p in inspect.signature(command, locals=typed_by_us, eval_str=True).parameters.values()
                    if p.name not in ("request", "tools")]
        added: list[tuple[str, object, object]] = [
            (name, annotation, default) for name, (annotation, default) in REQUEST_OPTIONS.items()
            if name not in exclude] if request else [("profile", ProfileOpt, None)]
        if tools:
            from llmcli.cli.tool_options import TOOL_OPTIONS

            added += [(name, annotation, default) for name, (annotation, default) in TOOL_OPTIONS.items()]
        added += [(name, setting_option(setting), None) for name, setting in SETTINGS.items()
                  if (only is None or name in only) and name not in exclude]
        params = explicit + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                             for name, annotation, default in added]
        own = {p.name for p in explicit}

        @functools.wraps(command)
        def with_request(**options: object) -> None:
            mine = {name: options.pop(name) for name in own if name in options}
            if tools:
                from llmcli.cli.tool_options import ToolOptions

                mine["tools"] = ToolOptions.of(options)
            command(**mine, request=_request(options))

        with_request.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        with_request.__annotations__ = {p.name: p.annotation for p in params}
        return with_request

    return decorate


def _request(options: Mapping[str, object]) -> Request:
    """The Request that a command's options (settings and REQUEST_OPTIONS) describe (an empty --stop list is 'not
    given', as is an option the command does not offer)."""
    from llmcli.pipeline import Request  # not for --help: it loads the settings table and the store

    def text(name: str) -> str | None:
        value = options.get(name)
        return value if isinstance(value, str) else None

    def path(name: str) -> Path | None:
        value = options.get(name)
        return value if isinstance(value, Path) else None

    biases = options.get("logit_bias")
    return Request(
        settings={name: options[name] for name in SETTINGS if options.get(name) not in (None, [])},
        profile=text("profile"),
        raw=options.get("raw") is True,
        template_file=path("chat_template_file"),
        logit_bias=tuple(str(bias) for bias in biases) if isinstance(biases, list) else (),
        grammar=text("grammar"),
        grammar_file=path("grammar_file"),
        json_schema=text("json_schema"),
        output_format=text("output_format"),
        verbose=options.get("verbose") is True,
        api_key=text("api_key"),  # (serve's own --api-key is the key requests bring, not this)
        offline=options.get("offline") is True,
        force=options.get("force") is True,
    )
