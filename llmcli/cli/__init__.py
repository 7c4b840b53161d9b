"""The command line: Typer glue over the core, and the single error funnel."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmcli import __version__, paths
from llmcli.errors import ExitCode, LlmcliError, StdoutClosed, Terminated

app = typer.Typer(
    name="llmcli",
    help="Fast, local, quantized LLM inference on the CPU.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"llmcli {__version__}")
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")]
CacheDirOpt = Annotated[Optional[Path], typer.Option(
    "--cache-dir", help="Where downloaded models live ($LLMCLI_CACHE_DIR).", file_okay=False, show_default=False)]


@app.callback()
def _root(version: VersionOpt = False, cache_dir: CacheDirOpt = None) -> None:
    """Fast, local, quantized LLM inference on the CPU."""
    if cache_dir is not None:
        os.environ["LLMCLI_CACHE_DIR"] = str(cache_dir)  # read by llmcli.paths.cache_dir() at call time


def _register(only: str | None = None) -> None:
    """Add the commands to the app: all of them, or with `only` ("run" or "chat", the commands that answer) that one
    alone, so that a run imports none of the other commands' modules (bench, serve, embed...: ~60 ms)."""
    from llmcli.cli.help import EXAMPLES, SHORT_HELP, PanelledCommand

    if only == "run":
        from llmcli.cli.run import run

        app.command("run", cls=PanelledCommand, short_help=SHORT_HELP["run"], epilog=EXAMPLES["run"])(run)
        return
    if only == "chat":
        from llmcli.cli.chat import chat

        app.command("chat", cls=PanelledCommand, short_help=SHORT_HELP["chat"], epilog=EXAMPLES["chat"])(chat)
        return
    from llmcli.cli import (
        bench,
        cache_cmd,
        config_cmd,
        embed_cmd,
        eval_cmd,
        launch_cmd,
        logs_cmd,
        mcp_cmd,
        models_cmd,
        serve_cmd,
        templates_cmd,
        tokens_cmd,
        warm_cmd,
    )
    from llmcli.cli.chat import chat
    from llmcli.cli.run import run

    commands: tuple[tuple[str, Any], ...] = (("run", run), ("chat", chat), ("serve", serve_cmd.serve))
    for name, command in commands:
        app.command(name, cls=PanelledCommand, short_help=SHORT_HELP[name], epilog=EXAMPLES[name])(command)
    models_cmd.register(app)
    tools: tuple[tuple[str, Any], ...] = (("count", tokens_cmd.count), ("tokenize", tokens_cmd.tokenize),
                                          ("embed", embed_cmd.embed), ("similar", embed_cmd.similar),
                                          ("ps", warm_cmd.ps), ("stop", warm_cmd.stop), ("launch", launch_cmd.launch))
    for name, command in tools:
        app.command(name, short_help=SHORT_HELP[name], epilog=EXAMPLES[name])(command)
    app.add_typer(bench.app, name="bench", short_help=SHORT_HELP["bench"], epilog=EXAMPLES["bench"])
    app.add_typer(config_cmd.app, name="config", short_help=SHORT_HELP["config"])
    app.add_typer(cache_cmd.app, name="cache", short_help=SHORT_HELP["cache"])
    app.add_typer(logs_cmd.app, name="logs", short_help=SHORT_HELP["logs"], epilog=EXAMPLES["logs"])
    app.add_typer(templates_cmd.app, name="templates", short_help=SHORT_HELP["templates"])
    app.add_typer(mcp_cmd.app, name="mcp", short_help=SHORT_HELP["mcp"], epilog=EXAMPLES["mcp"])
    app.add_typer(eval_cmd.app, name="eval", short_help=SHORT_HELP["eval"], epilog=EXAMPLES["eval"])


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def main() -> None:
    """Entry point: run the app; turn every known failure into one `Error:` line and an exit code."""
    signal.signal(signal.SIGTERM, _on_sigterm)  # generation installs its own graceful handler
    completing = any(name.endswith("_COMPLETE") for name in os.environ)  # (the shell's completion asks for them all)
    _register(sys.argv[1] if len(sys.argv) > 1 and not completing else None)
    try:
        app(prog_name="llmcli")
    except StdoutClosed:
        _silence_stdout()
        sys.exit(ExitCode.STDOUT_CLOSED)
    except LlmcliError as exc:
        if paths.debug():
            raise
        from llmcli.cli.output import print_error, stderr_console

        print_error(stderr_console(), exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except BrokenPipeError:
        _silence_stdout()
        sys.exit(ExitCode.STDOUT_CLOSED)
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)
    except Terminated:
        sys.exit(ExitCode.TERMINATED)
    except Exception as exc:  # an internal error: one line, the traceback only with LLMCLI_DEBUG=1
        if paths.debug():
            raise
        from llmcli.cli.output import print_error, stderr_console

        log = _write_debug_log(exc)
        print_error(
            stderr_console(),
            f"internal error: {type(exc).__name__}: {exc}",
            f"The traceback is in {log}; LLMCLI_DEBUG=1 prints it. Please report it." if log
            else "Run again with LLMCLI_DEBUG=1 for the traceback, and report it.",
        )
        sys.exit(ExitCode.ERROR)


def _write_debug_log(exc: BaseException) -> Path | None:
    """Append the traceback of an internal error to the debug log; its path, or None if unwritable."""
    import time
    import traceback

    path = paths.debug_log()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} llmcli {__version__} argv={sys.argv[1:]}\n")
            handle.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


def _silence_stdout() -> None:
    """The reader is gone: point stdout at /dev/null so the final flush at exit cannot complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
