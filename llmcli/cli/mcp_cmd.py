"""`llmcli mcp`: the MCP servers of the configuration — their state and tools, and one call, for checking a setup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli.errors import UsageError

app = typer.Typer(help="MCP servers: list them with their tools, or call one tool.", no_args_is_help=True)
FileOpt = Annotated[Optional[Path], typer.Option(
    "--mcp", help="The mcpServers JSON file [default: mcp.json in the config dir].", show_default=False, dir_okay=False)]
TimeoutOpt = Annotated[float, typer.Option("--tool-timeout", min=0.1, help="Seconds the call may take.")]


@app.command("list")
def list_servers(mcp: FileOpt = None, as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
                 ) -> None:
    """Each server: its state (running, or why it failed) and the tools it offers (as SERVER_TOOL); exit 1 if one
    failed."""
    from llmcli.cli import output
    from llmcli.tools.mcp_servers import McpServers, default_config, read_config

    with McpServers(read_config(mcp or default_config())).start() as servers:
        servers.wait()
        # each as it was while running (stopped once the block ends)
        found = [(s.config.name, s.state, s.error, s.config.where, list(s.tools)) for s in servers.servers]
    if as_json:
        output.print_json([{"name": name, "state": state, "error": error, "where": where,
                            "tools": [{"name": t.name, "description": t.description} for t in tools]}
                           for name, state, error, where, tools in found])
    else:
        if not found:
            output.stderr_console().print("no MCP servers in the configuration")
        for name, state, error, where, tools in found:
            print(f"{name}  {state}" + (f" ({error})" if error else "") + f"  {where}")
            for tool in tools:
                print(f"  {tool.name:<28} {tool.description[:80]}")
    if any(state == "failed" for _, state, *_ in found):  # (a health check a script can test: every server is listed)
        raise typer.Exit(1)


@app.command("call")
def call(server: Annotated[str, typer.Argument(help="The server's name.", show_default=False)],
         tool: Annotated[str, typer.Argument(help="The tool's own name (not SERVER_TOOL).", show_default=False)],
         arguments: Annotated[str, typer.Argument(help="The arguments, a JSON object.")] = "{}",
         mcp: FileOpt = None, tool_timeout: TimeoutOpt = 60.0) -> None:
    """Call one tool of one server and print its result (exit 1 if the tool reports an error)."""
    from llmcli.cli import output
    from llmcli.tools.mcp_servers import McpServers, default_config, read_config

    try:
        values = json.loads(arguments)
    except ValueError as exc:
        raise UsageError(f"the arguments are not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise UsageError("the arguments are a JSON object, e.g. '{\"path\": \"/tmp\"}'")
    with McpServers(read_config(mcp or default_config(), (server,)), tool_timeout).start() as servers:
        for notice in servers.wait():
            output.print_notice(output.stderr_console(), notice)
        text, error = servers.call(server, tool, values)
    print(text)
    if error:
        raise typer.Exit(1)
