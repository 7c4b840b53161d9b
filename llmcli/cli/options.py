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

from llmcli.config.settings import DOWNLOADS, ENGINE, MODEL, OUTPUT, REMOTE, SETTINGS, TOOLS, Setting
from llmcli.errors import UsageError
from llmcli.text_escapes import neutralised

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

FunctionsOpt = Annotated[Optional[list[str]], typer.Option(
    "--functions", help="Python functions the model may call: a .py file or code (repeatable); each public function's "
    "signature and docstring are its tool's schema.", show_default=False, rich_help_panel=TOOLS)]
ToolChoiceOpt = Annotated[str, typer.Option(
    "--tool-choice", help="auto (the model decides), required (it calls one), none, or a function's name; a forced "
    "choice applies to the first call.", rich_help_panel=TOOLS)]
ChainLimitOpt = Annotated[int, typer.Option(
    "--chain-limit", min=0, help="The most rounds of calls before llmcli stops running them.", rich_help_panel=TOOLS)]
ToolsDebugOpt = Annotated[bool, typer.Option(
    "--tools-debug", help="Show each call and its result on stderr.", rich_help_panel=TOOLS)]
ToolsApproveOpt = Annotated[bool, typer.Option(
    "--tools-approve", help="Ask before each call (on a terminal; refused without one).", rich_help_panel=TOOLS)]


McpOpt = Annotated[Optional[Path], typer.Option(
    "--mcp", help="Tools from the MCP servers of this mcpServers JSON file (Claude Desktop's, Cursor's, LM Studio's "
    "shape); --mcp-server alone reads the config dir's mcp.json.", show_default=False, dir_okay=False,
    rich_help_panel=TOOLS)]
McpServerOpt = Annotated[Optional[list[str]], typer.Option(
    "--mcp-server", help="Use only this server of the MCP file. Repeatable.", show_default=False, rich_help_panel=TOOLS)]
ToolTimeoutOpt = Annotated[float, typer.Option(
    "--tool-timeout", min=0.1, help="Seconds an MCP call may take before it is an error result for the model.",
    rich_help_panel=TOOLS)]


# The tool options of run and chat: name -> (annotation, default), added by with_settings(tools=True).
TOOL_OPTIONS: dict[str, tuple[Any, Any]] = {
    "functions": (FunctionsOpt, None),
    "tool_choice": (ToolChoiceOpt, "auto"),
    "chain_limit": (ChainLimitOpt, 5),
    "tools_debug": (ToolsDebugOpt, False),
    "tools_approve": (ToolsApproveOpt, False),
    "mcp": (McpOpt, None),
    "mcp_server": (McpServerOpt, None),
    "tool_timeout": (ToolTimeoutOpt, 60.0),
}


def uses_tools(given: Mapping[str, Any]) -> bool:
    return bool(given.get("functions") or given.get("mcp") or given.get("mcp_server"))


def tool_runner_of(given: Mapping[str, Any], console: Any) -> Any:
    """The ToolRunner that a command's TOOL_OPTIONS describe (see tool_runner)."""
    return tool_runner(given["functions"], given["tool_choice"], given["chain_limit"], given["tools_debug"],
                       given["tools_approve"], "generic", console, given["mcp"], given["mcp_server"],
                       given["tool_timeout"])


def tool_runner(functions: list[str] | None, choice: str, chain_limit: int, debug: bool, approve: bool,
                tool_format: str, console: Any, mcp: Path | None = None, mcp_servers: list[str] | None = None,
                tool_timeout: float = 60.0) -> Any:
    """The ToolRunner of --functions, --mcp and their flags (None without either; close() it: MCP servers run);
    the approval prompt and the debug lines are the CLI's. Checked before the model loads: a bad file, or
    --tools-approve without a terminal. MCP servers start here, in the background, while the model loads."""
    if not functions and mcp is None and not mcp_servers:
        if approve or debug or choice != "auto":
            raise UsageError("--tool-choice, --tools-debug and --tools-approve apply to --functions and --mcp")
        return None
    from rich.text import Text

    from llmcli.answer.tool_calls import ToolChoice
    from llmcli.tools.tool_loop import ToolRunner, ToolSource, ToolSources

    approver = _approver(console) if approve else None  # refused before anything starts
    sources: list[ToolSource] = []
    if functions:
        from llmcli.tools.functions import load_functions

        sources.append(load_functions(functions))
    if mcp is not None or mcp_servers:
        from llmcli.tools.mcp_servers import McpServers, default_config, read_config

        servers = McpServers(read_config(mcp or default_config(), tuple(mcp_servers or ())), tool_timeout)
        sources.append(servers.start())
    source = ToolSources(tuple(sources))
    try:
        parsed = ToolChoice.parse(choice, source.tools if choice not in ("auto", "none", "required") else (),
                                  "--tool-choice")
    except BaseException:
        ToolRunner(source, ToolChoice(), tool_format).close()
        raise
    runner = ToolRunner(source, parsed, tool_format, chain_limit)
    runner.approve = approver
    if debug:
        def called(call: Any) -> None:  # (a tool's text, the model's calls: shown, never obeyed by the terminal)
            console.print(Text(neutralised(f"tool call {call.name}({call.arguments})"), style="dim"))

        def show(call: Any, result: Any) -> None:
            shown = result.content if len(result.content) <= 500 else result.content[:500] + "…"
            console.print(Text(neutralised(f"tool result {call.name}: {shown}"), style="red" if result.error else "dim"))

        def prompt(text: str) -> None:
            console.print(Text(neutralised(f"next prompt ends: …{text[-300:]}"), style="dim"))

        runner.on_call, runner.on_result, runner.on_prompt = called, show, prompt
    return runner


def _approver(console: Any) -> Callable[[Any], bool]:
    """Ask on the terminal (not stdin, which may carry the prompt) before each call; no terminal: refused."""
    import os

    try:
        terminal = os.open("/dev/tty", os.O_RDWR) if os.isatty(2) else None  # kept open for the run
    except OSError:
        terminal = None
    if terminal is None:
        raise UsageError("--tools-approve asks before each call on a terminal, and there is none",
                         hint="Run it on a terminal, or drop --tools-approve.")

    def approve(call: Any) -> bool:
        os.write(terminal, neutralised(f"run {call.name}({call.arguments})? [y/N] ").encode())
        answer = b""
        while not answer.endswith(b"\n") and (chunk := os.read(terminal, 256)):
            answer += chunk
        return answer.decode(errors="replace").strip().lower() in ("y", "yes")

    return approve


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
        added += [(name, annotation, default) for name, (annotation, default) in TOOL_OPTIONS.items()] if tools else []
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
