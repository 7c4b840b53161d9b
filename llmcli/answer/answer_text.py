"""Turning token pieces into safe-to-print text: UTF-8 assembly and stop-sequence hold-back.

Both are pure and streaming: they see the answer a piece at a time, as the decode
loop produces it, and never emit anything they might have to take back.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from llmcli.answer.reasoning import ReasoningSplitter
from llmcli.answer.tool_call_parser import CallEvent, ToolCallParser


class Utf8Assembler:
    """Bytes of token pieces in, complete characters out.

    A multi-byte character split across tokens is held until its last byte
    arrives; bytes that can never form a character become U+FFFD. An answer cut
    mid-character (-n, a stop, Ctrl-C) drops its incomplete last bytes: they are
    not text yet, and U+FFFD would print a character the model never wrote.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def finish(self) -> str:
        self._decoder.reset()  # the bytes held are the start of a character that never came
        return ""


class StopMatcher:
    """Holds text back while it could still become a stop sequence.

    `feed` returns the text that is safe to print and, once a stop sequence is
    complete, which one. The text of a stop sequence is never returned, not even
    its first characters. The cut is at the earliest position where any stop
    sequence occurs in the whole answer, exactly as `cut_at_first_stop` does.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(sorted({s for s in stops if s}, key=len, reverse=True))
        self._longest = len(self.stops[0]) if self.stops else 0
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        buf = self._pending + text
        match_at, stop = _first_stop(buf, self.stops)
        limit = len(buf) if stop is None else match_at
        hold_from = self._first_partial(buf, limit)
        if stop is not None and hold_from == limit:
            self._pending = ""
            return buf[:match_at], stop
        self._pending = buf[hold_from:]
        return buf[:hold_from], None

    def finish(self) -> tuple[str, str | None]:
        """No more text is coming: release what was held, cut at a stop if one completed."""
        buf, self._pending = self._pending, ""
        match_at, stop = _first_stop(buf, self.stops)
        return (buf, None) if stop is None else (buf[:match_at], stop)

    def _first_partial(self, buf: str, limit: int) -> int:
        """Earliest index before `limit` where a stop sequence may still begin."""
        for start in range(max(0, len(buf) - self._longest + 1), limit):
            tail = buf[start:]
            if any(s.startswith(tail) for s in self.stops):
                return start
        return limit


class AnswerText:
    """Token bytes in, printable answer text out: UTF-8 assembly, the reasoning told apart (with a splitter),
    then stop-sequence hold-back on the answer (a stop sequence is not looked for in the reasoning).

    `stop` names the stop sequence once one has matched; nothing after it is returned. `reasoning` holds
    the reasoning text the last `feed` or `finish` completed.
    """

    def __init__(self, stops: Iterable[str], splitter: ReasoningSplitter | None = None,
                 tools: ToolCallParser | None = None):
        self._utf8 = Utf8Assembler()
        self._stops = StopMatcher(stops)
        self._splitter = splitter
        self._tools = tools  # the calls are taken out of the answer's text before stop sequences are looked for
        self.stop: str | None = None
        self.reasoning = ""
        self.call_events: list[CallEvent] = []  # what the last `feed` or `finish` decoded of tool calls

    def feed(self, piece: bytes) -> str:
        text = self._utf8.feed(piece)
        if not text or self.stop is not None:
            return ""
        splitter = self._splitter
        if splitter is not None:
            self.reasoning, text = splitter.feed(text)
            if splitter.answering:
                self._splitter = None  # the answer has begun: the rest is answer, no need to look
        if self._tools is not None and text:
            text, events = self._tools.feed(text)
            self.call_events += events
        text, self.stop = self._stops.feed(text)
        return text

    def finish(self) -> str:
        """The answer is over: release what was held back (cut at a stop sequence that completes now)."""
        self.reasoning = ""
        if self.stop is not None:
            return ""
        text = self._utf8.finish()
        if self._splitter is not None:
            reasoning, text = self._splitter.feed(text)
            held_reasoning, held = self._splitter.finish()
            self.reasoning, text = reasoning + held_reasoning, text + held
        if self._tools is not None:
            text, events = self._tools.feed(text)
            tail, more = self._tools.finish()
            text += tail
            self.call_events += events + more
        text, self.stop = self._stops.feed(text)
        if self.stop is None:
            tail, self.stop = self._stops.finish()
            text += tail
        return text


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    best_at, best = len(text), None
    for stop in stops:  # longest first, so of two stops at one index the longer is named
        at = text.find(stop)
        if at != -1 and (best is None or at < best_at):
            best_at, best = at, stop
    return best_at, best


def cut_at_first_stop(text: str, stops: Iterable[str]) -> tuple[str, str | None]:
    """Reference semantics for StopMatcher: the whole answer, cut before its first stop sequence."""
    at, stop = _first_stop(text, tuple(sorted({s for s in stops if s}, key=len, reverse=True)))
    return (text, None) if stop is None else (text[:at], stop)
