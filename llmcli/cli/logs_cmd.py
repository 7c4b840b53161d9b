"""`llmcli logs`: every answer, recorded in SQLite — list, search, remove, turn off."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated, Optional

import typer

from llmcli.errors import LlmcliError, UsageError

app = typer.Typer(help="The log of every answer (SQLite, full-text search).", invoke_without_command=True,
                  subcommand_metavar="[path|status|on|off|rm …]")  # (it lists without a command)


def _since(text: str) -> float:
    """`2026-11-30`, `2026-11-30T14:00`, or an age: `30m`, `12h`, `7d`."""
    age = re.fullmatch(r"(\d+)([mhd])", text.strip())
    if age:
        return time.time() - int(age.group(1)) * {"m": 60, "h": 3600, "d": 86400}[age.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise UsageError(f"{text!r} is not a date (2026-11-30, 2026-11-30T14:00) or an age (30m, 12h, 7d)") from None


@app.callback()
def logs(
    ctx: typer.Context,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="How many, newest first.")] = 10,
    query: Annotated[Optional[str], typer.Option("--query", "-q", help="Search prompts, answers and reasoning: words "
                                                 "match as typed (what?, C++, it's); \"a phrase\", a OR b, NOT, prefix* "
                                                 "are the search syntax (SQLite FTS5).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Only this model's answers.",
                                                 show_default=False)] = None,
    since: Annotated[Optional[str], typer.Option("--since", help="Only answers since a date or an age (7d).",
                                                 show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List the newest answers (or those a search finds)."""
    if ctx.invoked_subcommand is not None:
        return
    import sqlite3

    from llmcli import paths
    from llmcli.cli import output
    from llmcli.store.answer_log import AnswerLog

    found = []
    if paths.answer_log_file().exists():
        try:
            with AnswerLog(paths.answer_log_file(), read_only=True) as log:
                found = log.find(count, query, model, _since(since) if since else None)
        except sqlite3.DatabaseError as exc:  # unreadable or damaged: SQLite's own words are all there is to say
            raise LlmcliError(f"cannot read the log {paths.answer_log_file()}: {exc}") from None
    if as_json:
        output.print_json(found)
        return
    if not found:
        filtered = query or model or since
        output.stderr_console().print("no answer matches" if filtered else "the log is empty" + (
            "" if paths.answer_log_file().exists() else f" (nothing logged yet at {paths.answer_log_file()})"))
        return
    for record in reversed(found):
        print(f"# {record['time']} · {record['model']} · {record['kind']} · id {record['id']}"
              + (f" · conversation {record['conversation_id']}" if record["conversation_id"] else ""))
        print("> " + record["prompt"].replace("\n", "\n> "))
        print(record["answer"] + "\n")


@app.command("path")
def path() -> None:
    """Print where the log is."""
    from llmcli import paths

    print(paths.answer_log_file())


@app.command("status")
def status() -> None:
    """Whether answers are logged (and why), where, and how many there are."""
    from llmcli import paths
    from llmcli.config import settings
    from llmcli.store.answer_log import AnswerLog

    effective = settings.resolve({})
    where = paths.answer_log_file()
    count = 0
    if where.exists():
        import sqlite3

        try:
            with AnswerLog(where, read_only=True) as log:
                count = log.count()
        except sqlite3.DatabaseError as exc:
            raise LlmcliError(f"cannot read the log {where}: {exc}") from None
    print(f"logging {'on' if effective['log'] else 'off'} ({effective.sources['log']}) · {where} · {count} answers")


@app.command("on")
def turn_on() -> None:
    """Log every answer (writes `log = true` in the config file)."""
    _switch(True)


@app.command("off")
def turn_off() -> None:
    """Stop logging answers (writes `log = false` in the config file; --log logs one anyway)."""
    _switch(False)


def _switch(value: bool) -> None:
    from llmcli import paths
    from llmcli.config.config_file import save_setting

    save_setting("log", value)
    print(f"logging {'on' if value else 'off'} ({paths.config_file()})")


@app.command("rm")
def remove(
    record_id: Annotated[Optional[int], typer.Argument(help="The id of one answer (llmcli logs shows it).",
                                                       show_default=False)] = None,
    before: Annotated[Optional[str], typer.Option("--before", help="Every answer older than this date or age.",
                                                  show_default=False)] = None,
) -> None:
    """Remove one answer, or all before a date."""
    from llmcli import paths
    from llmcli.store.answer_log import AnswerLog

    if (record_id is None) == (before is None):
        raise UsageError("give an ID or --before DATE")
    with AnswerLog(paths.answer_log_file()) as log:
        removed = log.remove(record_id, _since(before) if before else None)
    if record_id is not None and not removed:
        raise UsageError(f"no answer {record_id} in the log")
    print(f"removed {removed} answer{'' if removed == 1 else 's'}")

