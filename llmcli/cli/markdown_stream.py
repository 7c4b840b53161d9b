"""Markdown rendered while the answer streams (rich, and markdown-it-py under it; no second renderer).

An answer's source grows at its end, and CommonMark's block structure is settled line by line: once a block is
followed by the start of another, later text cannot change it. So the blocks before the last one are *committed*
(rendered once, printed, never touched again) and only the last, still open, block is redrawn — by rich's Live, from
its own thread a few times a second, so the decode loop hands over text and never waits for the screen. An open block
taller than the terminal shows its last lines until it is committed in full.

Model text is text: raw HTML in an answer is shown as written (markdown-it's `html` option off), never dropped or
interpreted, and control characters are neutralised before rich sees them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import pairwise
from queue import Empty, SimpleQueue

from markdown_it import MarkdownIt
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown, TableElement
from rich.segment import Segment
from rich.style import StyleType
from rich.table import Table

REFRESHES_PER_SECOND = 4  # the open block's redraws: a few a second at most
RENDER_SHARE = 0.02  # ... and rendering it takes at most this share of the time (a long code block: fewer redraws)
_PARSER = MarkdownIt("commonmark", {"html": False}).enable(["strikethrough", "table"])


def settled_blocks(source: str) -> tuple[list[str], str]:
    """The whole blocks at the start of `source` that later text cannot change (everything before the last block
    that begins on a complete line), one by one, and the rest."""
    complete = source[: source.rfind("\n") + 1]  # a partial last line may yet become something else
    if not complete:
        return [], source
    starts = [token.map[0] for token in _PARSER.parse(complete) if token.level == 0 and token.nesting >= 0
              and token.map is not None]
    if len(starts) < 2:
        return [], source
    offsets = [0]
    for line in complete.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    cuts = [0] + [offsets[start] for start in starts[1:]]
    return [source[a:b] for a, b in pairwise(cuts)], source[cuts[-1]:]


class _FoldedTable(TableElement):
    """A table whose cells fold a word wider than its column onto the next line (rich cuts it with "…")."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for renderable in super().__rich_console__(console, options):
            if isinstance(renderable, Table):
                for column in renderable.columns:
                    column.overflow = "fold"
            yield renderable


class AnswerMarkdown(Markdown):
    """rich's Markdown, parsed with raw HTML as text (rich's own parser drops `<tags>` from the output)."""

    elements = {**Markdown.elements, "table_open": _FoldedTable}

    def __init__(self, source: str, style: StyleType = "none"):
        super().__init__("", style=style)
        self.markup = source
        self.parsed = _PARSER.parse(source)


class _Block:
    """Rendered Markdown without rich's blank lines around it, a blank line above it after earlier blocks, and, as
    the open block, no taller than the terminal (its last lines)."""

    def __init__(self, source: str = "", gap: bool = False, crop: bool = False, style: StyleType = "none"):
        self.source = source  # the open block's is set by the decode loop and read by Live's thread: no lock
        self.gap = gap
        self.crop = crop
        self.style = style
        self._drawn: tuple[float, int, list[list[Segment]]] | None = None  # (fresh until, width, lines): the open block

    def forget(self) -> None:
        """The open block's source was cut (its start committed): the next redraw renders it again."""
        self._drawn = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        drawn, now = self._drawn, time.monotonic()
        if drawn is not None and now < drawn[0] and drawn[1] == options.max_width:
            lines = drawn[2]  # rendered moments ago: the text that came since waits for the next redraw
        else:
            started = time.perf_counter()
            lines = self._lines(console, options)
            if self.crop:
                self._drawn = (now + (time.perf_counter() - started) / RENDER_SHARE, options.max_width, lines)
        if self.gap and lines:
            yield Segment.line()
        for line in lines:
            yield from line
            yield Segment.line()

    def _lines(self, console: Console, options: ConsoleOptions) -> list[list[Segment]]:
        source = self.source
        if not source.strip():
            return []
        if self.crop and _open_fence(source):  # a long open code block: highlight only the lines that will show
            first, _, code = source.partition("\n")
            source = first + "\n" + "\n".join(code.split("\n")[-console.size.height:])
        lines = console.render_lines(AnswerMarkdown(source, style=self.style), options, pad=False)
        while lines and _blank(lines[-1]):
            lines.pop()
        while lines and _blank(lines[0]):
            lines.pop(0)
        if self.crop:
            lines = lines[-max(1, console.size.height - 1 - self.gap):]
        return lines


def _open_fence(source: str) -> str | None:
    """The fence (```, ~~~) of a code block that `source` opens and has not closed yet."""
    head = source[:6].lstrip(" ")[:3]  # (a fence is indented 3 spaces at most: no copy of the whole source)
    fence = head if head in ("```", "~~~") else None
    return fence if fence is not None and source.find(fence, source.find("\n") + 1) < 0 else None


def _blank(line: list[Segment]) -> bool:
    """A line with nothing on it (a code block's padding, which has a background, is something)."""
    return all(not segment.text.strip() and not (segment.style and segment.style.bgcolor) for segment in line)


class MarkdownStream:
    """Takes answer text piece by piece; commits finished blocks to `console` and redraws the open one. `style`:
    the answer's own (its colour), under what Markdown adds. Committed blocks are rendered and printed by a thread of
    their own, in order: the decode loop hands them over and goes on (a slow or paused terminal holds up that thread,
    not the answer); until one is printed it is shown with the open block."""

    def __init__(self, console: Console, style: StyleType = "none"):
        self.console = console
        self.style = style
        self._pending = ""  # the source after the settled blocks
        self._unprinted: deque[str] = deque()  # settled blocks the printer has not printed yet, oldest first
        self._open = _Block(crop=True, style=style)
        self._live: Live | None = None
        self._committed = False  # a block is on the screen (the next one has a blank line above it)
        self._blocks: SimpleQueue[str | threading.Event] = SimpleQueue()  # to the printer: a block, or "tell me"
        self._printer: threading.Thread | None = None
        self._failure: BaseException | None = None  # what stopped the printer (stdout closed)

    def feed(self, text: str) -> None:
        self._raise_failure()
        self._pending += text
        settled: list[str] = []
        if "\n" in text and not _open_fence(self._pending):  # (nothing settles inside an open code block)
            settled, self._pending = settled_blocks(self._pending)
            self._unprinted.extend(settled)
            if settled:
                self._open.forget()
        self._show()
        if self._live is None and self._open.source.strip():
            # Redrawn by the printer's thread (not Live's own): one thread writes while the answer streams, so a
            # block printed above the open one and a redraw of it never interleave on the terminal.
            self._live = Live(self._open, console=self.console, auto_refresh=False, transient=True,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start(refresh=True)
        if self._printer is None and self._live is not None:
            self._printer = threading.Thread(target=self._print_blocks, name="markdown", daemon=True)
            self._printer.start()
        for block in settled:
            self._blocks.put(block)

    def pause(self) -> None:
        """Take the open block off the screen (something else is about to print), the committed blocks printed
        first; the next text draws it again."""
        self._drain()
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def close(self) -> None:
        """The answer is over: the open block is committed as it stands."""
        self.pause()
        if self._printer is not None:
            self._blocks.put(_STOP)
            self._printer.join()
            self._printer = None
        self._raise_failure()
        pending, self._pending = self._pending, ""
        self._open.source = ""
        self._open.forget()
        if pending.strip():
            self._print(pending)

    def _show(self) -> None:
        """What the open block shows: the blocks not printed yet, and the text after them."""
        unprinted = tuple(self._unprinted)
        self._open.source = "".join(unprinted) + self._pending if unprinted else self._pending
        self._open.gap = self._committed

    def _drain(self) -> None:
        if self._printer is not None and self._printer.is_alive():
            printed = threading.Event()
            self._blocks.put(printed)
            printed.wait()

    def _print_blocks(self) -> None:
        """The printer's loop: each block rendered and printed once, above the open one, which it redraws a few
        times a second in between."""
        while True:
            try:
                item = self._blocks.get(timeout=1 / REFRESHES_PER_SECOND)
            except Empty:
                live = self._live
                if live is not None and live.is_started and self._failure is None:
                    try:
                        live.refresh()
                    except BaseException as exc:  # stdout closed: the decode loop hears of it at its next piece
                        self._failure = exc
                continue
            if isinstance(item, threading.Event):
                item.set()
                if item is _STOP:
                    return
                continue
            try:
                self._print(item)
            except BaseException as exc:
                self._failure = exc
            self._unprinted.popleft()
            self._open.forget()
            self._show()

    def _print(self, source: str) -> None:
        if self._failure is None:
            self.console.print(_Block(source, gap=self._committed, style=self.style))
            self._committed = True

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure


_STOP = threading.Event()  # the printer's last item
