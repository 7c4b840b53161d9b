"""Everything a command prints besides the streamed answer: notices, errors, stats, tables, JSON, progress.

stdout is data (tables, JSON); stderr is everything else. Nothing is parsed as rich markup, and text from elsewhere in
a notice, an error, a table or a field (a server's message, a tool's name or result, a file name) has its control
characters shown, not obeyed (text_escapes.neutralised), as the model's text on a terminal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmcli.answer.events import Done
from llmcli.answer.stats import summary_line
from llmcli.text_escapes import neutralised

if TYPE_CHECKING:
    import threading

    from rich.live import Live

    from llmcli.answer.answerer import Answerer
    from llmcli.pipeline import Pipeline, Request
    from llmcli.tools.tool_loop import ToolRunner


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, markup=False, soft_wrap=True)


def stdout_console() -> Console:
    """For tables on stdout: piped, whole names (never cut or wrapped)."""
    console = Console(highlight=False, markup=False)
    return console if console.is_terminal else Console(highlight=False, markup=False, width=1000)


def print_stats(console: Console, done: Done) -> None:
    print_stats_line(console, summary_line(done.stats, done.finish_reason, done.stop_sequence))


def print_stats_line(console: Console, line: str) -> None:
    """A line of figures (run's stats line; serve's per-answer line), dimmed."""
    console.print(Text(line, style="dim"))


def print_notice(console: Console, message: str) -> None:
    console.print(Text.assemble(("Warning: ", "yellow"), neutralised(message)))


def print_error(console: Console, message: str, hint: str | None = None) -> None:
    console.print(Text.assemble(("Error: ", "bold red"), neutralised(message)))
    if hint:
        console.print(Text.assemble(("Hint: ", "bold"), neutralised(hint)))


def print_json(value: object) -> None:
    """One JSON document on stdout."""
    print(json.dumps(value, ensure_ascii=False))


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[str] = (), title: str | None = None,
                boxed: bool = False, empty: str | None = None) -> None:
    """A table on stdout, plain columns as `docker ps` and `ollama list` print them (`boxed`: rules around it); `right`
    names the right-aligned columns. No rows and an `empty` message: the message on stderr instead (a header alone
    says nothing)."""
    from rich import box

    if not rows and empty is not None:
        stderr_console().print(empty)
        return

    table = Table(title=title, box=box.HEAVY_HEAD if boxed else None, pad_edge=boxed, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    for row in rows:
        table.add_row(*("" if cell is None else neutralised(str(cell)) for cell in row))
    stdout_console().print(table)


def print_fields(rows: Sequence[tuple[str, object]]) -> None:
    """`key  value` lines on stdout, keys aligned."""
    width = max((len(key) for key, _ in rows), default=0)
    for key, value in rows:
        print(f"{key:<{width}}  {'' if value is None else neutralised(str(value))}")


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
def waiting_for(host: str, after_s: float = 2.0) -> Iterator[None]:
    """A "waiting for HOST…" status on a terminal's stderr once a request has taken `after_s` seconds."""
    import threading

    console = stderr_console()
    if not console.is_terminal:
        yield
        return
    status = console.status(f"waiting for {host}…")
    timer = threading.Timer(after_s, status.start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        status.stop()


@contextmanager
def download_progress() -> Iterator[Callable[[str, int, int | None], None]]:
    """Per-file download bars on stderr (size, speed, ETA), hidden when stderr is not a terminal."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = stderr_console()
    tasks: dict[str, TaskID] = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
        console=console, disable=not console.is_terminal, redirect_stdout=False,
    ) as progress:

        def update(name: str, done: int, total: int | None) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name.rsplit("/", 1)[-1], total=total)
            progress.update(tasks[name], completed=done, total=total)

        yield update


class PrefillStatus:
    """A sign of life while a long prompt is evaluated: `evaluating the prompt · 1,024 / 3,142 tokens · 410 tok/s ·
    about 5 s left` on a terminal's stderr, shown once the prompt has taken `after_s`, gone (erased) before the first
    token. rich's refresh thread redraws it, so its clock moves while llama.cpp computes a chunk (ctypes calls
    release the GIL); the decode loop never waits for it."""

    def __init__(self, console: Console, after_s: float = 1.0):
        import threading

        self.console, self.after_s = console, after_s
        self.started: float | None = None
        self.evaluated = self.total = self.prompt = 0
        self.rate: float | None = None  # tokens a second, from the chunks done so far
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._timer: threading.Timer | None = None
        self._stopped = False

    def update(self, evaluated: int, total: int, prompt: int = 0) -> None:
        import threading
        import time

        now = time.perf_counter()
        if self.started is None:
            self.started = now
            self._timer = threading.Timer(self.after_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        elif evaluated > 0 and now > self.started:
            self.rate = evaluated / (now - self.started)
        self.evaluated, self.total, self.prompt = evaluated, total, prompt

    def _show(self) -> None:
        from rich.live import Live

        with self._lock:
            if self._stopped:
                return
            self._live = Live(self, console=self.console, transient=True, refresh_per_second=4, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start()

    def __rich__(self) -> Text:
        import time

        elapsed = time.perf_counter() - (self.started or time.perf_counter())
        parts = [f"evaluating the prompt · {self.evaluated:,} / {self.total:,} tokens"
                 + (f" (of {self.prompt:,}: the rest was cached)" if self.prompt > self.total else "")]
        if self.rate:
            left = (self.total - self.evaluated) / self.rate - (elapsed - self.evaluated / self.rate)
            parts += [f"{self.rate:,.0f} tok/s", f"about {max(1, round(left))} s left"]
        else:
            parts.append(f"{elapsed:.0f} s")
        return Text(" · ".join(parts), style="dim")

    def stop(self) -> None:
        """The prompt is evaluated (or the answer ended): erase the status, for good."""
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
            if self._live is not None:
                self._live.stop()
                self._live = None


def open_pipeline(request: Request, console: Console, runner: ToolRunner | None = None) -> Pipeline[Answerer]:
    """A command's pipeline, opened as every answering command opens it: a download's progress while the model is
    fetched, the tools told how this model writes a call, then the tools' and the pipeline's notices."""
    from llmcli.answer.answerer import tool_format
    from llmcli.pipeline import open_answering

    with download_progress() as progress:  # shown only if the model must be downloaded first
        pipeline = open_answering(request, progress, on_waiting=waiting_for)
    if runner is not None:
        runner.format = tool_format(pipeline.session, pipeline.settings["tool_format"])
        for notice in runner.notices():
            print_notice(console, notice)
    for notice in pipeline.session.notices:
        print_notice(console, notice)
    return pipeline
