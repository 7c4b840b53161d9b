"""The tool options of `run` and `chat` (--functions, --mcp and their flags), parsed once into `ToolOptions`, and the
`ToolRunner` they make: the approval prompt on the terminal and the debug lines are the CLI's; the tools, their
sources and the loop are llmcli/tools/'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, TypeVar

import typer

from llmcli.config.settings import TOOLS
from llmcli.errors import UsageError
from llmcli.text_escapes import neutralised

if TYPE_CHECKING:
    from rich.console import Console

    from llmcli.answer.tool_calls import ToolCall, ToolResult
    from llmcli.tools.tool_loop import ToolRunner

T = TypeVar("T")

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
TOOL_OPTIONS: dict[str, tuple[object, object]] = {
    "functions": (FunctionsOpt, None),
    "tool_choice": (ToolChoiceOpt, "auto"),
    "chain_limit": (ChainLimitOpt, 5),
    "tools_debug": (ToolsDebugOpt, False),
    "tools_approve": (ToolsApproveOpt, False),
    "mcp": (McpOpt, None),
    "mcp_server": (McpServerOpt, None),
    "tool_timeout": (ToolTimeoutOpt, 60.0),
}


@dataclass(frozen=True)
class ToolOptions:
    """What a command's TOOL_OPTIONS say, read once."""

    functions: tuple[str, ...] = ()
    choice: str = "auto"
    chain_limit: int = 5
    debug: bool = False
    approve: bool = False
    mcp: Path | None = None
    mcp_servers: tuple[str, ...] = ()
    timeout: float = 60.0

    @staticmethod
    def of(options: Mapping[str, object]) -> ToolOptions:
        """What TOOL_OPTIONS' values say (each as Typer gives it: checked, not trusted)."""
        def listed(name: str) -> tuple[str, ...]:
            value = options.get(name)
            return tuple(str(item) for item in value) if isinstance(value, list) else ()

        def of_type(name: str, kind: type[T], default: T) -> T:
            value = options.get(name)
            return value if isinstance(value, kind) else default

        mcp, timeout = options.get("mcp"), options.get("tool_timeout")
        return ToolOptions(listed("functions"), of_type("tool_choice", str, "auto"), of_type("chain_limit", int, 5),
                           of_type("tools_debug", bool, False), of_type("tools_approve", bool, False),
                           mcp if isinstance(mcp, Path) else None, listed("mcp_server"),
                           float(timeout) if isinstance(timeout, (int, float)) else 60.0)

    @property
    def used(self) -> bool:
        """Whether any tools are offered (functions, or MCP servers)."""
        return bool(self.functions or self.mcp is not None or self.mcp_servers)

    def runner(self, console: Console, tool_format: str = "generic") -> ToolRunner | None:
        """The ToolRunner of these options (None without tools; close() it: MCP servers run). Checked before the
        model loads: a bad file, or --tools-approve without a terminal. MCP servers start here, in the background,
        while the model loads."""
        if not self.used:
            if self.approve or self.debug or self.choice != "auto":
                raise UsageError("--tool-choice, --tools-debug and --tools-approve apply to --functions and --mcp")
            return None
        from llmcli.answer.tool_calls import ToolChoice
        from llmcli.tools.tool_loop import ToolRunner, ToolSource, ToolSources

        approver = _approver() if self.approve else None  # refused before anything starts
        sources: list[ToolSource] = []
        if self.functions:
            from llmcli.tools.functions import load_functions

            sources.append(load_functions(list(self.functions)))
        if self.mcp is not None or self.mcp_servers:
            from llmcli.tools.mcp_servers import McpServers, default_config, read_config

            servers = McpServers(read_config(self.mcp or default_config(), self.mcp_servers), self.timeout)
            sources.append(servers.start())
        source = ToolSources(tuple(sources))
        try:
            parsed = ToolChoice.parse(self.choice, source.tools if self.choice not in ("auto", "none", "required")
                                      else (), "--tool-choice")
        except BaseException:
            ToolRunner(source, ToolChoice(), tool_format).close()
            raise
        runner = ToolRunner(source, parsed, tool_format, self.chain_limit)
        runner.approve = approver
        if self.debug:
            _show_calls(runner, console)
        return runner


def _show_calls(runner: ToolRunner, console: Console) -> None:
    """--tools-debug: each call, its result and the next prompt's end, dimmed on stderr (a tool's text and the model's
    calls shown, never obeyed by the terminal)."""
    from rich.text import Text

    def called(call: ToolCall) -> None:
        console.print(Text(neutralised(f"tool call {call.name}({call.arguments})"), style="dim"))

    def show(call: ToolCall, result: ToolResult) -> None:
        shown = result.content if len(result.content) <= 500 else result.content[:500] + "…"
        console.print(Text(neutralised(f"tool result {call.name}: {shown}"), style="red" if result.error else "dim"))

    def prompt(text: str) -> None:
        console.print(Text(neutralised(f"next prompt ends: …{text[-300:]}"), style="dim"))

    runner.on_call, runner.on_result, runner.on_prompt = called, show, prompt


def _approver() -> Callable[[ToolCall], bool]:
    """Ask on the terminal (not stdin, which may carry the prompt) before each call; no terminal: refused."""
    import os

    try:
        terminal = os.open("/dev/tty", os.O_RDWR) if os.isatty(2) else None  # kept open for the run
    except OSError:
        terminal = None
    if terminal is None:
        raise UsageError("--tools-approve asks before each call on a terminal, and there is none",
                         hint="Run it on a terminal, or drop --tools-approve.")

    def approve(call: ToolCall) -> bool:
        from llmcli.cli.keyboard import echo_on

        with echo_on():  # (the answer streams with the echo off)
            os.write(terminal, neutralised(f"run {call.name}({call.arguments})? [y/N] ").encode())
            answer = b""
            while not answer.endswith(b"\n") and (chunk := os.read(terminal, 256)):
                answer += chunk
        return answer.decode(errors="replace").strip().lower() in ("y", "yes")

    return approve


