"""`llmcli chat`: an interactive conversation (a REPL on a terminal, one message per line otherwise)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli import options as o

if TYPE_CHECKING:
    from rich.console import Console

    from llmcli.chat.conversation import Conversation
    from llmcli.cli.tool_options import ToolOptions
    from llmcli.pipeline import Request
    from llmcli.tools.tool_loop import ToolRunner
from llmcli.units import counted

_SAVED = "Saved conversations"
ResumeOpt = Annotated[Optional[str], typer.Option("--resume", help="Continue a saved conversation: its id, or `last`.",
                                                  show_default=False, rich_help_panel=_SAVED)]
NoSaveOpt = Annotated[bool, typer.Option("--no-save", help="Do not save this conversation under the data dir.",
                                         rich_help_panel=_SAVED)]
ListOpt = Annotated[bool, typer.Option("--list", help="List the saved conversations (ids for --resume), then exit.",
                                       rich_help_panel=_SAVED)]


@o.with_settings(tools=True)
def chat(
    *,
    resume: ResumeOpt = None,
    no_save: NoSaveOpt = False,
    list_saved: ListOpt = False,
    as_json: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    request: Request,
    tools: ToolOptions,
) -> None:
    """Talk with a model: the KV cache is reused, so only each new turn is prefilled."""
    from llmcli.cli import output

    if list_saved:
        _list_saved(as_json)
        return
    console = output.stderr_console()
    runner = tools.runner(console)
    with contextlib.ExitStack() as stack:
        if runner is not None:
            stack.enter_context(runner)  # MCP servers stay up for the session, and stop with it
        _session(resume, no_save, as_json, quiet, request, runner, console)


def _session(resume: str | None, no_save: bool, as_json: bool, quiet: bool, request: Request,
             runner: ToolRunner | None, console: Console) -> None:
    from llmcli.chat.conversation import Conversation
    from llmcli.chat.saved import find_conversation
    from llmcli.cli import output
    from llmcli.pipeline import log_entry, prompt_text

    resumed = find_conversation(resume) if resume else None
    with output.open_pipeline(request, console, runner) as pipeline:
        if runner is not None:  # (--tools-debug's prompt after the results: this process's, or the warm server's)
            runner.render_prompt = prompt_text(pipeline, request)
        conversation = Conversation(
            pipeline.session, pipeline.generation, pipeline.model.name, pipeline.model.path,
            save=not no_save, conversation_id=resumed.id if resumed else None,
            pinned=pipeline.settings.chosen_now(),
            log=(lambda text, answer, added: log_entry(pipeline, "chat", text, answer, conversation.generation,
                                                       conversation.id, added))
            if pipeline.settings["log"] else None, tools=runner, cancel=pipeline.cancel, served=pipeline.served,
        )
        if resumed is not None:
            records = resumed.records()
            conversation.replay(records)
            if resumed.file is not None and not no_save:  # an older chat's file: it goes on in the log, whole
                conversation.carry_over(records)
            _restore_state(conversation, console)
        from llmcli.cli.chat_repl import Repl

        repl = Repl(conversation, pipeline.cancel, console, quiet, as_json, pipeline.settings["reasoning"],
                    pipeline.settings["markdown"], pipeline.settings["answer_color"])
        from llmcli.cli.trace_view import open_trace

        repl.open_trace = lambda text, images, top: open_trace(pipeline, request, text, images, top, console)
        interactive = sys.stdin is not None and sys.stdin.isatty()
        repl.interactive() if interactive else repl.lines()
        if not no_save:
            for notice in conversation.keep_state():  # for --resume: its KV state, not only its text
                output.print_notice(console, notice)


def _restore_state(conversation: Conversation, console: Console) -> None:
    """A resumed conversation: its KV state from the prompt cache, or a notice that it is evaluated again."""
    from llmcli.answer.answerer import exchange_starts
    from llmcli.cli import output

    exchanges = len(exchange_starts(conversation.history))
    resumed = conversation.resume()
    for notice in resumed.notices:
        output.print_notice(console, notice)
    console.print(f"resumed {conversation.id}: {counted(exchanges, 'exchange')}" +
                  (f", KV state of {resumed.restored} tokens restored" if resumed.restored else ""))
    if resumed.missing is not None:
        output.print_notice(console, f"no saved KV state for this conversation ({resumed.missing}): "
                            "the first turn evaluates the conversation again")


def _list_saved(as_json: bool) -> None:
    import time

    from llmcli.chat.saved import saved_conversations
    from llmcli.cli import output

    saved = saved_conversations()
    if as_json:
        output.print_json([{"id": c.id, "path": str(c.where), "modified": c.modified, "model": c.model,
                            "exchanges": c.exchanges, "first_message": c.first_message} for c in saved])
        return
    rows = [(c.id, time.strftime("%Y-%m-%d %H:%M", time.localtime(c.modified)), c.model, c.exchanges,
             c.first_message[:60] + ("…" if len(c.first_message) > 60 else "")) for c in reversed(saved)]
    from llmcli import paths

    output.print_table(("ID", "LAST CHANGE", "MODEL", "EXCHANGES", "FIRST MESSAGE"), rows, right=("EXCHANGES",),
                       empty=f"no saved conversations yet (in {paths.answer_log_file()})")
