"""chat's REPL: a message or a /command a line (read with readline on a terminal), the replies streamed, and the
/commands themselves — the `llmcli chat` command (llmcli/cli/chat.py) sets it up over a Conversation."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from llmcli.errors import UsageError
from llmcli.units import counted

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from rich.console import Console

    from llmcli.answer.events import AnswerEvent, Done
    from llmcli.answer.images import ImageInput
    from llmcli.chat.conversation import Conversation
    from llmcli.cli.trace_view import TraceView
    from llmcli.interrupt import Cancellation


def help_text() -> str:
    """The REPL's /help, with the settings /set takes from the settings table."""
    import textwrap

    from llmcli.chat.conversation import CHAT_SETTINGS

    names = textwrap.wrap(", ".join(CHAT_SETTINGS), 76)
    settings = "\n".join(" " * 24 + line for line in names)
    return f"""Commands:
  /help                 this list
  /system TEXT          set the system prompt (empty: remove it)
  /set NAME VALUE       change a setting (`none` clears an optional one):
{settings}
  /show                 model, settings, context used/total
  /clear                forget the conversation (the system prompt stays)
  /undo                 drop the last exchange
  /retry                sample the last reply again
  /save FILE            save the conversation as JSON;  /load FILE  load one
  /history              the conversation so far (tool calls and results too)
  /tools                the tools the model may call (--functions, --mcp)
  /image PATH           ask the next message about this picture (or drop an image file's path into a message)
  /stats                timings of the last reply and of the whole conversation
  /trace on [N] | off   show each step of the next replies (the prompt, every token with N candidates, the stop)
  /exit                 leave (or Ctrl-D)
A line with only \"\"\" starts and ends a multi-line message; a line ending in \\ continues."""


class Repl:
    def __init__(self, conversation: Conversation, cancel: Cancellation, console: Console, quiet: bool, as_json: bool,
                 reasoning: str = "show",
                 markdown: bool = False, color: str | None = None):
        self.conversation = conversation
        self.reasoning = reasoning  # where a reasoning model's thinking goes (--reasoning)
        self.markdown = markdown  # replies rendered as they stream, on a terminal (--markdown/--plain)
        self.color = color  # the replies' colour on a terminal (--answer-color; none: the terminal's own)
        self.cancel = cancel
        self.console = console
        self.quiet = quiet
        self.as_json = as_json
        self.trace: int | None = None  # /trace on: candidates shown a token (run --trace's view, on stderr)
        # the trace's view of a message, its prompt stage shown (chat sets it: the prompt after the conversation)
        self.open_trace: Callable[[str, tuple[ImageInput, ...], int], TraceView] | None = None
        self.images: list[ImageInput] = []  # /image: pictures the next message asks about

    # -- input -----------------------------------------------------------------------------

    def interactive(self) -> None:
        from llmcli import paths

        history = paths.chat_history_file()
        readline = _readline(history)
        # (what was typed is kept for the up arrow only where the conversation is recorded: --no-save, --no-log and
        # `llmcli logs off` keep nothing of it; the file is this user's alone, as the log is)
        keep = self.conversation.saved and self.conversation.log is not None
        self.console.print(f"llmcli chat · {self.conversation.model_name} · /help for commands · Ctrl-D to leave")
        try:
            while True:
                try:
                    text = self._read_message()
                except KeyboardInterrupt:
                    self.console.print("\n(Ctrl-D or /exit to leave)")
                    continue
                except EOFError:
                    self.console.print()
                    return
                try:
                    if text is not None and not self.handle(text):
                        return
                except KeyboardInterrupt:  # Ctrl-C outside a reply (a command, or before it began)
                    self.console.print("\n(interrupted)")
        finally:
            if readline is not None and keep:
                paths.private_dir(history.parent, history.parent)
                os.close(paths.open_private(history, os.O_WRONLY | os.O_CREAT))
                os.chmod(history, 0o600)
                readline.write_history_file(str(history))

    def _read_message(self) -> str | None:
        line = input(">>> ")
        if line.strip() == '"""':
            lines = []
            while (more := input("... ")).strip() != '"""':
                lines.append(more)
            return "\n".join(lines)
        parts = [line]
        while parts[-1].endswith("\\"):
            parts[-1] = parts[-1][:-1]
            parts.append(input("... "))
        text = "\n".join(parts)
        return text if text.strip() else None

    def lines(self) -> None:
        """stdin is not a terminal: one message (or /command) per line, until EOF."""
        for raw_line in sys.stdin:
            text = raw_line.rstrip("\r\n")
            if text.strip() and not self.handle(text):
                return

    # -- commands and turns ----------------------------------------------------------------

    def handle(self, text: str) -> bool:
        """Act on one message or /command; False to leave. Only /exit (and EOF) ends the session:
        a message that does not fit, a bad value or an unreadable file is one error line."""
        from llmcli.cli.output import print_error, print_notice
        from llmcli.errors import ContextLost, LlmcliError

        command, _, argument = text[1:].partition(" ") if text.startswith("/") else ("", "", text)
        if "/" in command:  # a path (an image file dropped on the terminal): a message, not a command
            command, argument = "", text
        command = command.lower()
        if command in ("exit", "quit", "bye"):
            return False
        action = COMMANDS.get(command) if command else _message
        if action is None:
            self.console.print(f"Unknown command /{command}. Type /help for the list.")
            return True
        try:
            action(self, argument.strip() if command else argument)
        except ContextLost:
            raise  # (no KV cache left in this process: the session cannot go on — said as run says it, exit 6)
        except LlmcliError as exc:
            print_error(self.console, exc.message, exc.hint)
        except OSError as exc:  # a file a command was given: never the end of the session
            print_error(self.console, f"/{command}: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        failure = self.conversation.take_save_failure()
        if failure:
            print_notice(self.console, failure)
        return True

    def reply(self, events: Iterable[AnswerEvent], view: TraceView | None = None) -> None:
        """Show a reply (with /trace on, through `view`, or a view without the prompt stage)."""
        from llmcli.cli.output import print_error
        from llmcli.cli.stream import AnswerSink, show_answer

        def told(done: Done) -> None:
            if done.format_error is not None:
                print_error(self.console, done.format_error)
            if done.finish_reason == "interrupted" and (done.text or done.tool_calls):
                self.console.print("[interrupted: the partial reply stays in the conversation]")

        sink = AnswerSink(as_json=self.as_json, extra={"model": self.conversation.model_name}, reasoning=self.reasoning,
                          markdown=self.markdown, color=self.color)
        if view is None and self.trace is not None:
            from llmcli.cli.trace_view import TraceView

            view = TraceView(self.console, self.trace)
        with self.cancel.on_signals():
            done = show_answer(events, sink, self.console, self.quiet, told, view)
        self.cancel.signum = None  # Ctrl-C ended this reply, not the session
        if done is not None and done.finish_reason == "interrupted" and not (done.text or done.tool_calls):
            self.conversation.undo()  # stopped before the reply began: the question is not left unanswered in it
            self.console.print("[interrupted before the reply began: the message is not in the conversation]")


def _message(repl: Repl, text: str) -> None:
    from llmcli.cli.inputs import dropped_images, read_images

    text, paths = dropped_images(text)
    images = (*repl.images, *read_images(paths))
    repl.images = []
    if paths:
        repl.console.print(f"[{', '.join(image.source for image in images)}: asked about with this message]")
    view = repl.open_trace(text, images, repl.trace) if repl.trace is not None and repl.open_trace else None
    repl.reply(repl.conversation.ask(text, images), view)


def _image(repl: Repl, argument: str) -> None:
    from llmcli.cli.inputs import dropped_images, read_images

    if not argument:
        raise UsageError("usage: /image PATH (the next message asks about it)")
    _, paths = dropped_images(argument)
    repl.images += read_images(paths or [argument])
    repl.console.print(f"[{counted(len(repl.images), 'image')} attached: the next message asks about "
                       f"{'it' if len(repl.images) == 1 else 'them'}]")


def _help(repl: Repl, argument: str) -> None:
    repl.console.print(help_text())


def _system(repl: Repl, argument: str) -> None:
    repl.conversation.set_system(argument)
    repl.console.print("system prompt " + ("set" if argument else "removed"))


def _set(repl: Repl, argument: str) -> None:
    from llmcli.errors import UsageError

    name, _, value = argument.partition(" ")
    if not name or not value:
        raise UsageError("usage: /set NAME VALUE (e.g. /set temp 0)")
    repl.console.print(repl.conversation.set(name, value))


def _show(repl: Repl, argument: str) -> None:
    conversation = repl.conversation
    session = conversation.session
    repl.console.print(f"model    {conversation.model_name} ({session.where})")
    from llmcli.answer.answerer import exchange_starts

    exchanges = len(exchange_starts(conversation.history))
    context = conversation.context()
    if not context.n_ctx:  # (a server's: its last answer's figures)
        repl.console.print(f"context  {context.used} tokens used by the conversation as of its last answer (kept by "
                           f"the server), {counted(exchanges, 'exchange')}")
    elif context.last_answer:  # (the warm server's: its context, and its last answer's figures)
        repl.console.print(f"context  {context.used} / {context.n_ctx} tokens used by the conversation as of its last "
                           f"answer ({context.cached} of that prompt from the warm server's cache), "
                           f"{counted(exchanges, 'exchange')}")
    else:
        repl.console.print(f"context  {context.used} / {context.n_ctx} tokens used by the conversation "
                           f"({context.cached} in the KV cache), {counted(exchanges, 'exchange')}")
    if conversation.system:
        repl.console.print(f"system   {conversation.system}")
    else:
        added = conversation.template_system
        repl.console.print("system   (none given" + (f"; the chat template adds its own: {added}" if added else "") + ")")
    repl.console.print(_settings_lines(conversation.settings_record()))
    if conversation.saved:
        from llmcli import paths

        repl.console.print(f"saved as {conversation.id} in {paths.answer_log_file()} (chat --resume {conversation.id})")


def _settings_lines(record: dict[str, object]) -> str:
    """The settings, wrapped to the terminal: changed ones first (marked *), then the rest."""
    import shutil
    import textwrap

    from llmcli.config.settings import SETTINGS

    def changed(name: str, value: object) -> bool:
        return name in SETTINGS and value != SETTINGS[name].default and not (value == [] and SETTINGS[name].default is None)

    ordered = sorted(record.items(), key=lambda item: not changed(*item))
    items = [f"{name}={_shown(name, value)}" + ("*" if changed(name, value) else "") for name, value in ordered]
    width = max(60, min(shutil.get_terminal_size().columns, 120))
    return textwrap.fill("  ".join(items), width, initial_indent="settings ", subsequent_indent=" " * 9,
                         break_on_hyphens=False) + "\n         (* changed from the built-in default)"


def _shown(name: str, value: object) -> str:
    """A setting's value as a person reads it (no Python reprs); an unset seed is a random one."""
    from llmcli.config.setting import show_value

    return "random" if name == "seed" and value is None else show_value(value)


def _tools(repl: Repl, argument: str) -> None:
    runner = repl.conversation.tools
    if runner is None:
        repl.console.print("no tools (--functions FILE.py, --mcp FILE)")
        return
    for tool in runner.functions.tools:
        repl.console.print(f"{tool.name:<28} {tool.description[:80]}")


def _clear(repl: Repl, argument: str) -> None:
    repl.conversation.clear()
    repl.console.print("conversation cleared")


def _undo(repl: Repl, argument: str) -> None:
    repl.console.print("last exchange removed" if repl.conversation.undo() else "nothing to undo")


def _retry(repl: Repl, argument: str) -> None:
    from llmcli.cli.output import print_notice

    if repl.conversation.generation.sampling.greedy:
        print_notice(repl.console, "--temp 0 gives the same reply again: /set temp 0.7 for another one")
    repl.reply(repl.conversation.retry())


def _save(repl: Repl, argument: str) -> None:
    from llmcli.errors import UsageError

    if not argument:
        raise UsageError("usage: /save FILE")
    repl.conversation.save(Path(argument).expanduser())
    repl.console.print(f"saved {len(repl.conversation.history)} messages to {argument}")


def _load(repl: Repl, argument: str) -> None:
    from llmcli.errors import UsageError

    if not argument:
        raise UsageError("usage: /load FILE")
    count, changed = repl.conversation.load(Path(argument).expanduser())
    repl.console.print(f"loaded {count} messages from {argument}"
                       + (f" and its settings: {', '.join(changed)}" if changed else ""))


def _history(repl: Repl, argument: str) -> None:
    from llmcli.answer.images import described

    conversation = repl.conversation
    if conversation.system:
        repl.console.print(f"[system] {conversation.system}")
    for message in conversation.history:
        mark = " (interrupted)" if message.interrupted else ""
        calls = "".join(f" → {call.name}({call.arguments})" for call in message.tool_calls)
        content = described(message.content, message.images)
        text = content + calls if content else calls.lstrip(" ")
        repl.console.print(f"[{message.role}{mark}] {text}")
    if not conversation.history:
        repl.console.print("(no messages yet)")


def _stats(repl: Repl, argument: str) -> None:
    from llmcli.answer.stats import summary_line

    turns = repl.conversation.turn_stats
    if not turns:
        repl.console.print("no replies yet")
        return
    last = turns[-1]
    repl.console.print("last:  " + summary_line(last.stats, last.finish_reason, last.stop_sequence))
    tokens = sum(t.stats.completion_tokens for t in turns)
    ttft = sum(t.stats.ttft_s for t in turns) / len(turns)
    rates = [t.stats.decode_tps for t in turns if t.stats.decode_steps]
    rate = f"{sum(rates) / len(rates):.1f} tok/s" if rates else "n/a"
    repl.console.print(f"total: {counted(len(turns), 'reply')} · {counted(tokens, 'token')} · "
                       f"mean TTFT {ttft:.2f} s · mean decode {rate}")


def _trace(repl: Repl, argument: str) -> None:
    """/trace on [N] | off: run --trace's view for the next replies (a message's prompt after the conversation first;
    /retry's reply from its prefill)."""
    import dataclasses

    words = argument.split()
    if words[:1] == ["off"] and len(words) == 1:
        repl.trace = None
    elif words[:1] == ["on"] and len(words) <= 2 and (len(words) == 1 or words[1].isdigit() and 1 <= int(words[1]) <= 50):
        repl.trace = int(words[1]) if len(words) == 2 else 5
    else:
        raise UsageError("usage: /trace on [N] (N candidates a token, 1-50; 5) | /trace off")
    conversation = repl.conversation
    conversation.generation = dataclasses.replace(conversation.generation, trace=repl.trace)
    repl.console.print(f"trace {'on: ' + str(repl.trace) + ' candidates a token' if repl.trace else 'off'}")


COMMANDS = {
    "help": _help, "?": _help, "system": _system, "set": _set, "show": _show, "clear": _clear,
    "undo": _undo, "retry": _retry, "save": _save, "load": _load, "stats": _stats, "history": _history, "tools": _tools,
    "image": _image, "trace": _trace,
}


def _readline(history: Path) -> ModuleType | None:
    """Line editing and persistent history, where the readline module exists."""
    try:
        import readline
    except ImportError:
        return None
    try:
        readline.read_history_file(str(history))
    except OSError:
        pass
    readline.set_history_length(1000)
    return readline
