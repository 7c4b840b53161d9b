"""The command line: Typer glue over the core, and the single error funnel."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli import __version__, paths
from llmcli.errors import ExitCode, LlmcliError, StdoutClosed, Terminated
from llmcli.llama import cpu_load

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


# Every command: its name, the module under llmcli.cli that holds it, the attribute, and how it is added (a command
# with option panels, a plain one, or a Typer app of subcommands). In this order they are listed by `llmcli --help`.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("run", "run", "panelled"), "chat": ("chat", "chat", "panelled"), "serve": ("serve_cmd", "serve", "panelled"),
    "pull": ("models_cmd", "pull", "panelled"), "list": ("models_cmd", "list_models", "panelled"),
    "show": ("models_cmd", "show", "panelled"), "rm": ("models_cmd", "rm", "panelled"),
    "verify": ("models_cmd", "verify", "panelled"), "prune": ("models_cmd", "prune", "panelled"),
    "count": ("tokens_cmd", "count", "plain"), "tokenize": ("tokens_cmd", "tokenize", "plain"),
    "embed": ("embed_cmd", "embed", "plain"), "similar": ("embed_cmd", "similar", "plain"),
    "ps": ("warm_cmd", "ps", "plain"), "stop": ("warm_cmd", "stop", "plain"), "launch": ("launch_cmd", "launch", "plain"),
    "quantize": ("quant_cmd", "quantize", "plain"),
    "bench": ("bench", "app", "typer"), "config": ("config_cmd", "app", "typer"), "cache": ("cache_cmd", "app", "typer"),
    "logs": ("logs_cmd", "app", "typer"), "templates": ("templates_cmd", "app", "typer"),
    "mcp": ("mcp_cmd", "app", "typer"), "eval": ("eval_cmd", "app", "typer"),
    "quant": ("quant_cmd", "app", "typer"),
}


def _register(only: str | None = None) -> None:
    """Add the commands to the app: all of them, or the one named `only` alone (the command given on the command
    line), so that a command imports none of the others' modules: `llmcli ps` no longer loads bench, serve or the
    answer path (0.31 s -> 0.24 s)."""
    import importlib

    from llmcli.cli.help import EXAMPLES, SHORT_HELP, PanelledCommand

    for name, (module_name, attribute, kind) in _COMMANDS.items():
        if only in _COMMANDS and name != only:
            continue
        target = getattr(importlib.import_module(f"llmcli.cli.{module_name}"), attribute)
        if kind == "typer":
            app.add_typer(target, name=name, short_help=SHORT_HELP[name], epilog=EXAMPLES.get(name))
        else:
            app.command(name, cls=PanelledCommand if kind == "panelled" else None, short_help=SHORT_HELP[name],
                        epilog=EXAMPLES.get(name))(target)


def _register_listing() -> None:
    """What `llmcli`, `llmcli -h` and `llmcli --version` need of the commands: their names and one-line help, in
    order. No command's module is imported and no option built (`llmcli --help` 0.15 s -> 0.08 s); these entries
    only ever appear in that listing, as a command given on the command line is registered whole by `_register`."""
    from llmcli.cli.help import SHORT_HELP

    def listed() -> None:  # pragma: no cover - never invoked: only the root's help or version runs
        raise AssertionError("a listed command is registered whole before it runs")

    for name in _COMMANDS:
        app.command(name, short_help=SHORT_HELP[name], add_help_option=False)(listed)


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def main() -> None:
    """Entry point: run the app; turn every known failure into one `Error:` line and an exit code."""
    cpu_load.mark_start()  # the first window of what other processes take begins here (the default --threads)
    signal.signal(signal.SIGTERM, _on_sigterm)  # generation installs its own graceful handler
    completing = any(name.endswith("_COMPLETE") for name in os.environ)  # (the shell's completion asks for them all)
    given = sys.argv[1:]
    if not completing and given in ([], ["-h"], ["--help"], ["--version"]):
        _register_listing()
    else:
        _register(given[0] if given and not completing else None)
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
