"""What the user sees: the answer on stdout, everything else on stderr.

The answer is written raw (never parsed as rich markup), flushed piece by piece,
coloured only on a terminal, with control characters neutralised there so model
text cannot drive the terminal. Piped, it is byte-clean UTF-8 with no escape codes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from rich.console import Console
from rich.style import Style
from rich.text import Text

from llmcli.engine import Done, Token
from llmcli.errors import StdoutClosed
from llmcli.stats import summary_line

ANSWER_STYLE = Style(color="cyan")

# C0 and C1 control characters except tab and newline, shown in caret notation on a terminal.
_NEUTRALISE = {c: f"^{chr(c + 64)}" for c in range(32) if chr(c) not in "\t\n"}
_NEUTRALISE.update({0x7F: "^?", **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)}})


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, markup=False, soft_wrap=True)


class AnswerSink:
    """Streams answer text to stdout; collects it for --json."""

    def __init__(self, stream: IO[str] | None = None, as_json: bool = False, extra: dict[str, Any] | None = None):
        self.stream = stream or sys.stdout
        self.as_json = as_json
        self.extra = extra or {}
        self.parts: list[str] = []
        self.notices: list[str] = []
        console = Console(file=self.stream)
        self.terminal = console.is_terminal and not as_json  # neutralise control characters there
        color_system = console.color_system if self.terminal and not console.no_color else None
        self._open, self._close = "", ""
        if color_system:
            self._open, _, self._close = ANSWER_STYLE.render("\0", color_system=color_system).partition("\0")
        self._binary = getattr(self.stream, "buffer", None)

    def handle(self, event: Token | Done) -> None:
        if isinstance(event, Token):
            self.parts.append(event.text)
            if not self.as_json:
                self._write(event.text.translate(_NEUTRALISE) if self.terminal else event.text)
        elif self.as_json:
            self._write(json.dumps(self.record(event), ensure_ascii=False) + "\n")
        elif self.parts and not self.parts[-1].endswith("\n"):
            self._write("\n")  # end the answer's last line, so the shell prompt does not follow it

    def record(self, done: Done) -> dict[str, Any]:
        stats = done.stats
        return {
            **self.extra,
            "text": "".join(self.parts),
            "finish_reason": done.finish_reason,
            "stop_sequence": done.stop_sequence,
            "notices": self.notices,
            "usage": {
                "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens,
                "completion_tokens": stats.completion_tokens,
                "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            },
            "timings": stats.to_dict(),
        }

    def _write(self, text: str) -> None:
        try:
            if self._binary is not None:
                self._binary.write(f"{self._open}{text}{self._close}".encode("utf-8", "replace"))
                self._binary.flush()
            else:
                self.stream.write(f"{self._open}{text}{self._close}")
                self.stream.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None


def print_stats(console: Console, done: Done) -> None:
    console.print(Text(summary_line(done.stats, done.finish_reason, done.stop_sequence), style="dim"))


def print_notice(console: Console, message: str) -> None:
    console.print(Text.assemble(("Warning: ", "yellow"), message))


def print_error(console: Console, message: str, hint: str | None = None) -> None:
    console.print(Text.assemble(("Error: ", "bold red"), message))
    if hint:
        console.print(Text.assemble(("Hint: ", "bold"), hint))


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr (hidden when stderr is not a terminal); yields advance(done, total, what)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = stderr_console()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True, disable=not console.is_terminal, redirect_stdout=False,
    ) as progress:
        task = progress.add_task(label, total=None)

        def advance(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, description=what)

        yield advance


@contextmanager
def download_progress() -> Iterator[Callable[[str, int, int | None], None]]:
    """Per-file download bars on stderr (size, speed, ETA), hidden when stderr is not a terminal."""
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    console = stderr_console()
    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
        console=console, disable=not console.is_terminal, redirect_stdout=False,
    ) as progress:

        def update(name: str, done: int, total: int | None) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name.rsplit("/", 1)[-1], total=total)
            progress.update(tasks[name], completed=done, total=total)

        yield update
