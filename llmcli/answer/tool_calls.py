"""Tool calls: the tools a model may call (OpenAI function schemas), how a model writes a call (its format), and the
parser that turns a streamed answer into text and calls (llmcli/answer/tool_call_parser.py).

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


# Words too common to say what a question is about (English; a question in another language simply scores lower).
_COMMON = frozenset("""a an the of to for in on and or is are be by with from at as that this it its what which how do does
can could would should you me my i we our your please find get give tell show calculate compute given value number
about into than then there their them they he she his her was were will has have had not no yes any all some""".split())
_WORD = re.compile(r"[^\W\d_]{3,}")


def relevance(question: str, tools: tuple[Tool, ...]) -> float:
    """How much of a question is about what the tools do: the share of its content words found in their names,
    descriptions and parameter names (0: none of it, 1: all of it). A cheap prior for `auto` (--call-preference adds
    --call-gain times it): on BFCL's items a question a tool answers scores 0.18–1 (most ≥ 0.5), one no tool fits
    scores 0 for more than half of them."""
    asked = {w for w in _WORD.findall(question.lower()) if w not in _COMMON}
    if not asked:
        return 0.0
    offered: set[str] = set()
    for tool in tools:
        offered.update(_WORD.findall(f"{tool.name} {tool.description}".replace("_", " ").lower()))
        offered.update(_WORD.findall(" ".join(tool.parameters.get("properties") or {}).replace("_", " ").lower()))
    return len(asked & offered) / len(asked)
