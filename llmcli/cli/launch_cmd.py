"""`llmcli launch AGENT`: a coding agent (Claude Code, Codex, OpenCode, aider) run on a local model — the model's
server (llmcli/pipeline/launch.py) reused or started, the agent configured and run in the foreground."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Annotated, Optional

import typer

from llmcli.errors import ExitCode, LlmcliError

AgentArg = Annotated[str, typer.Argument(help="claude, codex, opencode or aider.", show_default=False, metavar="AGENT")]
AgentArgs = Annotated[Optional[list[str]], typer.Argument(help="After `--`: the agent's own arguments.",
                                                          show_default=False, metavar="-- AGENT_ARGS")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="The model (default: the default model).",
                                                 show_default=False)]
CtxOpt = Annotated[Optional[int], typer.Option(
    "--ctx-size", "-c", min=256, show_default=False,
    help="The context the agent gets [default: the agent's (32768 tokens; aider 16384), at most the model's trained "
    "context].")]
KeepAliveOpt = Annotated[Optional[str], typer.Option(
    "--keep-alive", show_default=False, help="How long the model's server stays after its last answer [default: 30m].")]
ConfigOpt = Annotated[bool, typer.Option(
    "--config", help="Print what the agent is given (environment, arguments), the server running, and do not launch.")]


def launch(agent_name: AgentArg, agent_args: AgentArgs = None, model: ModelOpt = None, ctx_size: CtxOpt = None,
           keep_alive: KeepAliveOpt = None, config: ConfigOpt = False) -> None:
    """Run a coding agent on a local model: its server started (or reused) with a context sized for the agent."""
    from llmcli.cli import output
    from llmcli.config.settings import SETTINGS, check_value
    from llmcli.pipeline import Request, resolve_settings
    from llmcli.pipeline import launch as launcher
    from llmcli.store.gguf_header import read_header

    agent = launcher.agent_of(agent_name)
    if keep_alive is not None:
        check_value(SETTINGS["keep_alive"], keep_alive, "--keep-alive")  # (before a server is started with it)
    if not config and shutil.which(agent.command) is None:
        raise LlmcliError(f"{agent.title} is not installed ({agent.command} is not on PATH)",
                          hint=f"Install it: {agent.install}", exit_code=ExitCode.NOT_FOUND)
    given = {name: value for name, value in (("model", model), ("keep_alive", keep_alive)) if value is not None}
    with output.download_progress() as progress:
        effective, resolved = resolve_settings(Request(settings=given), progress, output.waiting_for)
    n_ctx = launcher.context_for(agent, resolved.name, read_header(resolved.path).context_length, ctx_size)
    console = output.stderr_console()
    with console.status(f"starting the server of {resolved.name} ({n_ctx} tokens of context)"):
        served = launcher.ensure(effective["model"] or str(resolved.path), resolved.path, n_ctx, effective)
    setup = agent.configure(served)
    command = [agent.command, *setup.args, *(agent_args or ())]
    where = f"{served.model} at {served.url} (context {served.n_ctx} tokens, pid {served.pid}; `llmcli stop` ends it)"
    if config:
        for name, value in setup.env.items():
            print(f"{name}={shlex.quote(value)}")
        print(shlex.join(command))
        console.print(f"# {agent.title} on {where}", style="dim")
        raise typer.Exit(ExitCode.OK)
    console.print(f"{agent.title} on {where}", style="dim")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(agent.command, command, {**os.environ, **setup.env})  # the agent is the foreground process now
    except OSError as exc:
        raise LlmcliError(f"{agent.title} could not be started: {exc.strerror}", hint=f"Reinstall it: {agent.install}",
                          exit_code=ExitCode.NOT_FOUND) from None
