"""Tool calls: the tools a model may call (OpenAI function schemas), how a model writes a call (its format), and the
one parser that turns a streamed answer into text and calls — incrementally, so a call's markup never reaches the
answer text and its name and arguments come out as they are decoded.

Formats, recognised from the chat template (as llama-server does) or named with --tool-format:

    hermes   <tool_call>{"name": N, "arguments": {…}}</tool_call>    Hermes, Qwen 2.5/3, and most templates that read `tools`
    generic  the same markup, for a template that knows no tools: llmcli describes them in the system prompt
    mistral  [TOOL_CALLS] [{"name": N, "arguments": {…}}, …]
    llama3   {"name": N, "parameters": {…}}   (the whole answer; several separated by `;`)

Pure: the grammar that makes every call parse is built from these definitions in llmcli/llama/schema_grammar.py.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmcli.errors import UsageError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, what it does, and its arguments' JSON Schema (kept as JSON
    text, so a tool set is hashable and its grammar built once)."""

    name: str
    description: str = ""
    parameters_json: str = '{"type": "object", "properties": {}}'

    @property
    def parameters(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `tools` list (and the chat templates that read `tools`) hold it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @classmethod
    def from_openai(cls, value: Any, where: str = "tools") -> Tool:
        """`{"type": "function", "function": {"name", "description", "parameters"}}` (or the inner object), checked:
        a name OpenAI allows, and `parameters` a valid JSON Schema of an object."""
        function = value.get("function", value) if isinstance(value, dict) else None
        if not isinstance(function, dict) or (isinstance(value, dict) and value.get("type", "function") != "function"):
            raise UsageError(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{\"name\": …}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise UsageError(f"{where}: a tool's name is 1-64 letters, digits, _ or - (got {name!r})")
        description = function.get("description") or ""
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(description, str):
            raise UsageError(f"{where}: the description of {name} must be a string")
        check_schema(parameters, f"{where}: the parameters of {name}")
        return cls(name, description, json.dumps(parameters, sort_keys=False))


def check_schema(schema: Any, what: str) -> None:
    """A tool's parameters: a JSON Schema (draft of its own `$schema`, else the newest) describing an object."""
    import jsonschema

    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise UsageError(f"{what} must be a JSON Schema of an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise UsageError(f"{what} is not a valid JSON Schema: {exc.message}") from None


@dataclass(frozen=True)
class ToolCall:
    """A call as the model wrote it: a unique id, the tool's name, its arguments as JSON text (exactly the text
    streamed), and why it is not a valid call (None when it is)."""

    id: str
    name: str
    arguments: str
    error: str | None = None

    def arguments_value(self) -> Any:
        try:
            return json.loads(self.arguments)
        except ValueError:
            return {}

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolResult:
    """What running a call gave back, as the model will read it."""

    call_id: str
    name: str
    content: str
    error: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """`auto` (the model decides), `none` (no call), `required` (at least one call), or one named tool."""

    mode: str = "auto"
    name: str | None = None

    @classmethod
    def parse(cls, value: Any, tools: Sequence[Tool], where: str = "tool_choice") -> ToolChoice:
        if value is None:
            return cls()
        if isinstance(value, dict):
            function = value.get("function") if value.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise UsageError(f'{where}: a named choice is {{"type": "function", "function": {{"name": …}}}}')
            value = name
        if not isinstance(value, str):
            raise UsageError(f"{where} must be auto, none, required or a tool's name")
        if value in ("auto", "none", "required"):
            return cls(value)
        if value not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "no tools given"
            raise UsageError(f"{where} names {value!r}, which is not a given tool ({known})")
        return cls("function", value)


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: the text that opens the calls, what closes each one, the key of the arguments,
    and whether the calls are a JSON list (Mistral) or one object each."""

    name: str
    start: str  # opens the calls ("" for llama3: the answer is the call)
    end: str = ""  # closes each call (hermes); "" when the JSON itself ends it
    args_key: str = "arguments"
    listed: bool = False  # [TOOL_CALLS] [{…}, {…}]
    separator: str = ""  # between calls of an unlisted, unmarked format (llama3: ";")


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>"),
    "generic": ToolFormat("generic", "<tool_call>", "</tool_call>"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", listed=True),
    "llama3": ToolFormat("llama3", "", args_key="parameters", separator=";"),
}


def detect_format(template_source: str | None) -> str:
    """The format a chat template renders tools in; `generic` when it renders none."""
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("ipython" in source and "tools" in source):
        return "llama3"
    return "generic"


def template_reads_tools(template_source: str | None) -> bool:
    return detect_format(template_source) != "generic"


@dataclass(frozen=True)
class ToolSpec:
    """What one answer may call, and how: the tools, the choice, the format, several calls or one."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = field(default_factory=ToolChoice)
    format: str = "generic"
    parallel: bool = True
    think_first: bool = False  # a reasoning model (its template knows <think>) may think before a forced call

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the grammar allows: the named one, else all."""
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools

    def check(self, name: str, arguments: str) -> str | None:
        """Why a call is not valid against these tools (None when it is): its name, its JSON, its schema."""
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            return f"no tool is called {name!r}"
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            return f"the arguments of {name} are not valid JSON: {exc}"
        if not isinstance(value, dict):
            return f"the arguments of {name} are not a JSON object"
        import jsonschema

        schema = tool.parameters
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "the arguments"
        return f"the arguments of {name} do not match its schema at {where}: {error.message}"


def describe_tools(tools: Iterable[Tool], format_name: str = "generic") -> str:
    """The system prompt of a template that knows no tools: the tools, and how to call one in `format_name`."""
    listed = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
    example = call_markup(ToolCall("", "TOOL", '{"ARGUMENT": "VALUE"}'), format_name)
    return ("You can call these tools (JSON Schema of their arguments):\n" + listed + "\n\nTo call one, answer with "
            f"{example} and nothing else; the results come back in <tool_response> blocks. Answer in plain text when "
            "no tool is needed.")


# -- the streamed answer: text and calls ---------------------------------------------------------------------


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
            hold = _partial_suffix(buffer, fmt.start)
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

    def _stream(self, events: list[CallEvent]) -> None:
        scanner = self._scanner
        assert scanner is not None
        index = len(self.calls)
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
        if not self._started:
            self._started = True
            events.append(CallStarted(index, self._id, name or ""))
        if len(arguments) > self._sent:
            events.append(CallArguments(index, arguments[self._sent:]))
        self.calls.append(ToolCall(self._id, name or "", arguments, error))


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_calls(text: str, spec: ToolSpec) -> tuple[str, list[ToolCall]]:
    """A whole answer: its text and its calls (what the streamed parser gives, in one piece)."""
    parser = ToolCallParser(spec)
    shown, _ = parser.feed(text)
    tail, _ = parser.finish()
    return shown + tail, parser.calls


def call_markup(call: ToolCall, format_name: str) -> str:
    """A call as the model writes it in `format_name` (a history rendered for a template that knows no tools)."""
    fmt = FORMATS[format_name]
    body = '{"name": ' + json.dumps(call.name) + f', "{fmt.args_key}": ' + (call.arguments or "{}") + "}"
    if fmt.listed:
        return f"{fmt.start} [{body}]"
    return f"{fmt.start}\n{body}\n{fmt.end}" if fmt.start else body


def tool_spec(tools: Sequence[Mapping[str, Any]] | Sequence[Tool], choice: Any = None, format_name: str = "generic",
              parallel: bool = True) -> ToolSpec:
    """Tools (OpenAI objects or Tools) and a choice, checked, as one spec."""
    parsed = tuple(t if isinstance(t, Tool) else Tool.from_openai(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise UsageError("tools: two tools have the same name")
    return ToolSpec(parsed, ToolChoice.parse(choice, parsed), format_name, parallel)
