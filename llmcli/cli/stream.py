"""The streamed answer on stdout: written raw (never parsed as rich markup), flushed piece by piece,
coloured only on a terminal, with control characters neutralised there so model text cannot drive
the terminal. Piped, it is byte-clean UTF-8 with no escape codes. With --json, one record instead.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable
from typing import IO, TYPE_CHECKING

from rich.console import COLOR_SYSTEMS, Console
from rich.style import Style

from llmcli.answer.events import AnswerEvent, Done, Notice, Prefill, Token, TokenTrace, answer_record
from llmcli.answer.tool_call_parser import CallArguments, CallStarted
from llmcli.cli.keyboard import echo_off
from llmcli.errors import StdoutClosed, UsageError
from llmcli.text_escapes import NEUTRALISE as _NEUTRALISE  # control characters shown in caret notation on a terminal

if TYPE_CHECKING:
    from rich.color import ColorSystem

    from llmcli.cli.markdown_stream import MarkdownStream
    from llmcli.cli.output import PrefillStatus
    from llmcli.cli.trace_view import TraceView

REASONING_STYLE = Style(dim=True, italic=True)



class AnswerSink:
    """Streams answer text to stdout; collects it for --json. A reasoning model's thinking goes where
    `reasoning` says: `show` dimmed before the answer on a terminal (left out when stdout is piped: stdout
    carries the answer only), `hide` nowhere, `stderr` to stderr; always into the --json record. With `markdown`,
    the answer is rendered as it streams on a terminal (piped, it stays the model's bytes); `color`: its colour there
    (none: the terminal's own)."""

    def __init__(self, stream: IO[str] | None = None, as_json: bool = False, extra: dict[str, object] | None = None,
                 reasoning: str = "show", markdown: bool = False, color: str | None = None):
        self.stream = stream or sys.stdout
        self.as_json = as_json
        self.extra = extra or {}
        self.parts: list[str] = []
        self.thought: list[str] = []
        self.notices: list[str] = []
        console = Console(file=self.stream)
        self.terminal = console.is_terminal and not as_json  # neutralise control characters there
        color_system = COLOR_SYSTEMS.get(console.color_system or "") if self.terminal and not console.no_color else None
        answer_style = _answer_style(color)
        self._open, self._close = _codes(answer_style, color_system)
        self._dim = _codes(REASONING_STYLE, color_system)
        self._binary = getattr(self.stream, "buffer", None)
        self._thought_to: IO[str] | None = None if as_json else {
            "show": self.stream if self.terminal else None, "stderr": sys.stderr}.get(reasoning)
        self._thought_open = False  # thinking was printed and the answer has not begun yet
        self._line_open = False  # on a terminal: the answer's last line is not ended yet (a notice ends it first)
        rendered = markdown and self.terminal and not console.is_dumb_terminal  # (TERM=dumb cannot redraw)
        self._markdown: MarkdownStream | None = None
        if rendered:
            from llmcli.cli.markdown_stream import MarkdownStream  # (markdown-it and rich's Markdown: on a terminal only)

            self._markdown = MarkdownStream(console, answer_style)

    def handle(self, event: Token | Done) -> None:
        if isinstance(event, Token):
            if event.reasoning:
                self.thought.append(event.text)
                if self._thought_to is not None:
                    self._think(event.text)
                return
            if self._thought_open:
                self._end_thought()
            self.parts.append(event.text)
            if self._markdown is not None:
                try:
                    self._markdown.feed(event.text.translate(_NEUTRALISE))
                except BrokenPipeError:
                    raise StdoutClosed() from None
            elif not self.as_json:
                self._write(event.text.translate(_NEUTRALISE) if self.terminal else event.text)
                if event.text:
                    self._line_open = self.terminal and not event.text.endswith("\n")
            return
        if self._thought_open:
            self._end_thought()
        if self._markdown is not None:
            self.close()
        elif self.as_json:
            self._write(json.dumps(self.record(event), ensure_ascii=False) + "\n")
        elif self.parts and not self.parts[-1].endswith("\n") and (self._line_open or not self.terminal):
            self._write("\n")  # end the answer's last line, so the shell prompt does not follow it

    def pause(self) -> None:
        """Something else is about to print on the terminal: a rendered answer's open block steps aside, a plain
        answer's open line is ended (on a terminal only: piped, the answer stays the model's bytes)."""
        if self._markdown is not None:
            self._markdown.pause()
        elif self._line_open:
            self._write("\n")
            self._line_open = False

    def close(self) -> None:
        """The answer's text is over (or a tool call ends this part of it): what is rendered stays on screen."""
        if self._markdown is not None:
            try:
                self._markdown.close()
            except BrokenPipeError:
                raise StdoutClosed() from None

    def record(self, done: Done) -> dict[str, object]:
        return {**self.extra, **answer_record(done, self.notices)}

    def _think(self, text: str) -> None:
        self._thought_open = True
        if self._thought_to is self.stream:
            self._write(text.translate(_NEUTRALISE), self._dim)
        else:
            _write_to(sys.stderr, text)

    def _end_thought(self) -> None:
        """The thinking is over: a blank line between it and the answer."""
        self._thought_open = False
        ending = "\n" if "".join(self.thought).endswith("\n") else "\n\n"
        if self._thought_to is self.stream:
            self._write(ending, self._dim)
        else:
            _write_to(sys.stderr, ending)

    def _write(self, text: str, style: tuple[str, str] | None = None) -> None:
        start, end = style or (self._open, self._close)
        try:
            if self._binary is not None:
                self._binary.write(f"{start}{text}{end}".encode("utf-8", "replace"))
                self._binary.flush()
            else:
                self.stream.write(f"{start}{text}{end}")
                self.stream.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None


def _answer_style(color: str | None) -> Style:
    """The answer's look on a terminal: the terminal's own text (plain, as Ollama and `llm` print it), or
    --answer-color's colour."""
    if not color:
        return Style()
    try:
        return Style(color=color)
    except Exception:  # rich's ColorParseError
        raise UsageError(f"--answer-color {color!r} is not a colour",
                         hint="A name (cyan, bright_green), color(N) or #rrggbb.") from None


def _codes(style: Style, color_system: ColorSystem | None) -> tuple[str, str]:
    """The escape codes that open and close `style` (none without a colour system)."""
    if color_system is None:
        return "", ""
    start, _, end = style.render("\0", color_system=color_system).partition("\0")
    return start, end


def _write_to(stream: IO[str], text: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # stderr gone: the thinking is not the answer
        stream.write(text)
        stream.flush()


def show_answer(events: Iterable[AnswerEvent], sink: AnswerSink, console: Console, quiet: bool,
                on_done: Callable[[Done], None] | None = None, trace: TraceView | None = None) -> Done | None:
    """The one event loop of `run` and `chat`: the answer to the sink (stdout), notices to stderr (and into the
    --json record), then `on_done` and the stats line; a traced answer's steps to `trace` (and its text, when stdout
    is the terminal the trace is drawn on, once it is done). The Done, or None when the events stopped before it."""
    from llmcli.cli.output import PrefillStatus

    status = PrefillStatus(console) if console.is_terminal and not quiet and trace is None else None  # (nothing when
    typing = echo_off() if sink.terminal or console.is_terminal else contextlib.nullcontext()  # piped)
    with typing:  # (keys typed meanwhile are not echoed under the answer: they wait for the next prompt)
        return _show(events, sink, console, quiet, status, on_done, trace)


def _show(events: Iterable[AnswerEvent], sink: AnswerSink, console: Console, quiet: bool, status: PrefillStatus | None,
          on_done: Callable[[Done], None] | None, trace: TraceView | None = None) -> Done | None:
    from llmcli.cli.output import print_notice, print_stats

    done = None
    held: list[Token] = []  # (a trace drawn where the answer is: its text after it)
    try:
        for event in events:
            if isinstance(event, TokenTrace):
                if trace is not None:
                    trace.token(event)
                continue
            if isinstance(event, Token) and trace is not None and sink.terminal:
                held.append(event)
                continue
            if isinstance(event, Done) and trace is not None:
                trace.done(event)
                for token in held:
                    sink.handle(token)
            if isinstance(event, Prefill):
                if status is not None:
                    status.update(event.evaluated, event.total, event.prompt)
                continue
            if status is not None:  # (gone, for good, before anything else: a tool's question is never drawn over)
                status.stop()
            if isinstance(event, (CallStarted, CallArguments)):
                if isinstance(event, CallStarted):
                    sink.close()  # the text before a call is rendered whole: the call's output follows it
                continue  # a call is shown when it runs (--tools-debug), and kept in the Done
            if isinstance(event, Notice):
                sink.notices.append(event.text)
                if not (quiet and event.advisory):
                    sink.pause()
                    print_notice(console, event.text)
                continue
            early = False
            if isinstance(event, Done) and sink.as_json and on_done is not None:
                on_done(event)  # (before the record is written: what it does, such as logging the answer, can be in it)
                early = True
            sink.handle(event)
            if isinstance(event, Done):
                done = event
                if on_done is not None and not early:
                    on_done(event)
                if event.finish_reason == "interrupted" and console.is_terminal and not (sink.terminal and sink.parts):
                    console.print()  # off the line where the terminal echoed ^C
                if not quiet:
                    print_stats(console, event)
    finally:
        if status is not None:
            status.stop()
        with contextlib.suppress(StdoutClosed):
            sink.close()  # however the events end, what was rendered stays and the terminal's cursor comes back
    return done


def write_json_line(record: object, stream: IO[str] | None = None) -> None:
    """One JSON object per line on stdout (or `stream`: --batch, chat --json), flushed."""
    stream = stream or sys.stdout
    try:
        stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        stream.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None
