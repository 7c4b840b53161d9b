"""The one parser of a streamed answer with tool calls: text in, piece by piece; text and call events out, so a
call's markup never reaches the answer text and its name and arguments come out as they are decoded. The formats it
reads are defined in llmcli/answer/tool_calls.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmcli.answer.reasoning import partial_suffix
from llmcli.answer.tool_calls import FORMATS, ToolCall, ToolSpec, new_call_id


@dataclass(frozen=True)
class CallStarted:
    """A call begins: its place among this answer's calls, its id and the tool's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of a call's arguments (the pieces of one call join into its `arguments`)."""

    index: int
    text: str


CallEvent = CallStarted | CallArguments


class _CallScanner:
    """One call's JSON object, a character at a time: the name once its string closes (when it comes before the
    arguments, as the grammar orders them), then the arguments' text as it grows; `done` when the object closes."""

    def __init__(self, args_key: str):
        self.args_key = args_key
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.key: str | None = None  # the key at depth 1 whose value is being read
        self.expect_key = False
        self.string_start = 0
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.done = False

    def feed(self, chars: str) -> int:
        """Take characters until the object closes; how many were taken."""
        for taken, char in enumerate(chars, 1):
            self._char(char)
            if self.done:
                return taken
        return len(chars)

    def _char(self, char: str) -> None:
        position = len(self.text)
        self.text += char
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                self._string_closed(self.text[self.string_start : position + 1])
            return
        if char == '"':
            self.in_string, self.string_start = True, position
            self._value_starts(position)
        elif char in "{[":
            self._value_starts(position)
            self.depth += 1
            if self.depth == 1:
                self.expect_key = True
        elif char in "}]":
            if self.depth == 1 and self.args_start is not None and self.args_end is None:
                self.args_end = position  # a primitive value of the arguments ends here
            self.depth -= 1
            if self.depth == 1 and self.key == self.args_key and self.args_end is None:
                self.args_end = position + 1
            if self.depth == 0:
                self.done = True
        elif char == "," and self.depth == 1:
            if self.key == self.args_key and self.args_end is None and self.args_start is not None:
                self.args_end = position
            self.expect_key, self.key = True, None
        elif char == ":" and self.depth == 1:
            self.expect_key = False
        elif not char.isspace():
            self._value_starts(position)

    def _value_starts(self, position: int) -> None:
        if self.depth == 1 and not self.expect_key and self.key == self.args_key and self.args_start is None:
            self.args_start = position

    def _string_closed(self, literal: str) -> None:
        if self.depth != 1:
            return
        if self.expect_key:
            try:
                self.key = json.loads(literal)
            except ValueError:
                self.key = None
            return
        if self.key == "name" and self.name is None:
            try:
                self.name = json.loads(literal)
            except ValueError:
                self.name = None

    def arguments_so_far(self) -> str:
        if self.args_start is None:
            return ""
        return self.text[self.args_start : self.args_end if self.args_end is not None else len(self.text)]


class ToolCallParser:
    """Answer text in, (text, call events) out, piece by piece; `finish()` gives the calls. The markup of a call
    never comes out as text: a piece of text that could be the start of the format's opening is held back, as a
    stop sequence is. Calls are checked against the tools (`ToolSpec.check`); an invalid one keeps its error."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.format = FORMATS[spec.format]
        self.calls: list[ToolCall] = []
        self._pending = ""  # text held back: it may still become the opening
        self._state = "text"  # text -> opened (after the start marker) -> call -> between -> …
        self._scanner: _CallScanner | None = None
        self._started = False  # CallStarted sent for the current call
        self._sent = 0  # characters of the current call's arguments sent
        self._id = ""
        self._seen_text = False  # llama3: only an answer that begins with "{" is a call
        self.repeated = False  # the model wrote a call it had already made (the answer ends there; it is dropped)
        self.cut = False  # the answer ended inside a new call (it is kept, invalid: it must not run)

    @property
    def in_call(self) -> bool:
        """Inside a call's markup or arguments (the repetition guard leaves it to its grammar and -n)."""
        return self._state in ("opened", "call")

    @property
    def ended_after_calls(self) -> bool:
        """The calls are the whole answer, and whatever came after them was no new call: spaces, an opening that
        nothing followed, or a copy of a call already made (whole, or cut off by -n). A limit that cut the answer
        there cut nothing of it."""
        return bool(self.calls) and not self.cut and (self.repeated or self._state in ("between", "opened"))

    def feed(self, text: str) -> tuple[str, list[CallEvent]]:
        events: list[CallEvent] = []
        shown: list[str] = []
        buffer, self._pending = self._pending + text, ""
        while buffer:
            buffer = self._step(buffer, shown, events)
        return "".join(shown), events

    def finish(self) -> tuple[str, list[CallEvent]]:
        """No more text: what was held back is text after all; a call cut off is an invalid call."""
        events: list[CallEvent] = []
        held, self._pending = self._pending, ""
        if self._state == "call" and self._scanner is not None:
            if self._repeating(self._scanner):  # cut off while repeating a call: it goes, as a whole repeat would
                self.repeated, self._state, self._scanner = True, "done", None
            else:
                self.cut = True
                self._close_call(events, cut=True)
        if self._state == "text":
            return held, events
        return "", events

    def _step(self, buffer: str, shown: list[str], events: list[CallEvent]) -> str:
        fmt = self.format
        if self._state == "text":
            if not fmt.start:  # llama3: a call is the whole answer, from its first "{"
                stripped = buffer.lstrip()
                if not self._seen_text and not stripped:
                    self._pending = buffer
                    return ""
                if not self._seen_text and stripped.startswith("{"):
                    self._state = "call"
                    return stripped
                self._seen_text = True
                shown.append(buffer)
                return ""
            at = buffer.find(fmt.start)
            if at >= 0:
                shown.append(buffer[:at])
                self._state = "opened"
                return buffer[at + len(fmt.start):]
            hold = partial_suffix(buffer, fmt.start)
            shown.append(buffer[: len(buffer) - hold])
            self._pending = buffer[len(buffer) - hold:]
            return ""
        if self._state in ("opened", "between"):
            stripped = buffer.lstrip()
            if not stripped:
                return ""
            if fmt.listed and stripped[0] in "[,":
                return stripped[1:]
            if fmt.listed and stripped[0] == "]":
                self._state = "done"
                return stripped[1:]
            if fmt.end and stripped.startswith(fmt.end):
                return stripped[len(fmt.end):]
            if fmt.end and fmt.end.startswith(stripped):
                self._pending = buffer  # part of the closing tag
                return ""
            if fmt.separator and stripped[0] == fmt.separator:
                return stripped[1:]
            if stripped[0] == "{":
                self._state = "call"
                return stripped
            if fmt.start and stripped.startswith(fmt.start):  # the next call's own opening
                return stripped[len(fmt.start):]
            if fmt.start and fmt.start.startswith(stripped):
                self._pending = buffer
                return ""
            self._state = "done"  # anything else after the calls: kept out of the answer with them
            return stripped
        if self._state == "call":
            if self._scanner is None:
                self._scanner = _CallScanner(fmt.args_key)
                self._started, self._sent, self._id = False, 0, new_call_id()
            taken = self._scanner.feed(buffer)
            self._stream(events)
            if self._scanner.done:
                self._close_call(events)
            return buffer[taken:]
        return ""  # done: the rest is not the answer's text

    def _repeating(self, scanner: _CallScanner) -> bool:
        """A later call cut off where it is still a copy of an earlier one: its name, and its arguments so far the
        start of that call's (a small model repeats its call until -n cuts the copy: the whole calls before it stand)."""
        arguments = scanner.arguments_so_far()
        return scanner.name is not None and any(c.name == scanner.name and c.error is None
                                                and c.arguments.startswith(arguments) for c in self.calls)

    def _stream(self, events: list[CallEvent]) -> None:
        scanner = self._scanner
        assert scanner is not None
        index = len(self.calls)
        if index > 0:  # a later call comes out whole, once it is known not to repeat an earlier one
            return
        if not self._started and scanner.name is not None:
            self._started = True
            events.append(CallStarted(index, self._id, scanner.name))
        if self._started:
            arguments = scanner.arguments_so_far()
            if len(arguments) > self._sent:
                events.append(CallArguments(index, arguments[self._sent:]))
                self._sent = len(arguments)

    def _close_call(self, events: list[CallEvent], cut: bool = False) -> None:
        scanner = self._scanner
        assert scanner is not None
        self._scanner, self._state = None, "between"
        index = len(self.calls)
        name, arguments = scanner.name, scanner.arguments_so_far()
        error = None
        if cut:
            error = "the call was cut off before it ended"
        else:
            try:
                whole = json.loads(scanner.text)
            except ValueError as exc:
                whole, error = None, f"the call is not valid JSON: {exc}"
            if isinstance(whole, dict):
                name = whole.get("name") if isinstance(whole.get("name"), str) else name
                if self.format.args_key not in whole:
                    error = f"the call has no {self.format.args_key!r}"
            elif error is None:
                error = "the call is not a JSON object"
        if name is None:
            error = error or "the call names no tool"
        if error is None:
            error = self.spec.check(name or "", arguments)
        if error is None and index > 0 and any(c.name == name and _same_arguments(c.arguments, arguments)
                                               for c in self.calls):
            self.repeated, self._state = True, "done"  # a small model repeats one call until its limit: it goes,
            return  # and whatever follows it
        if not self._started:
            self._started = True
            events.append(CallStarted(index, self._id, name or ""))
        if len(arguments) > self._sent:
            events.append(CallArguments(index, arguments[self._sent:]))
        self.calls.append(ToolCall(self._id, name or "", arguments, error))


def _same_arguments(first: str, second: str) -> bool:
    try:
        return bool(json.loads(first) == json.loads(second))
    except ValueError:
        return first == second


def parse_calls(text: str, spec: ToolSpec) -> tuple[str, list[ToolCall]]:
    """A whole answer: its text and its calls (what the streamed parser gives, in one piece)."""
    parser = ToolCallParser(spec)
    shown, _ = parser.feed(text)
    tail, _ = parser.finish()
    return shown + tail, parser.calls
