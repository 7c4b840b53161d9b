"""`--functions`: Python functions the user names, offered to the model as tools (as `llm --functions` does).

A file (`tools.py`) or a string of code is run once, in a namespace of its own; each public function it defines
becomes a tool: its name, its docstring's first paragraph as the description, its parameters' type hints as the
JSON Schema of its arguments (a parameter with a default is optional). Only code the user named runs; what a
function returns is data for the model (text, or JSON for anything else), and what it raises goes back to the model
as an error result, never a traceback to the user.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.answer.tool_calls import Tool, ToolCall, ToolResult
from llmcli.errors import UsageError

_MODULE = "llmcli_functions"
_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                               dict: "object", tuple: "array"}
MAX_RESULT_CHARS = 32_000  # a result longer than this is cut (and says so): the context is the limit


@dataclass(frozen=True)
class Functions:
    tools: tuple[Tool, ...]
    callables: dict[str, Callable[..., Any]]

    def run(self, call: ToolCall) -> ToolResult:
        """Call the function `call` names with its arguments; an invalid call or an exception is an error result."""
        if call.error is not None:
            return ToolResult(call.id, call.name, f"Error: the call is not valid: {call.error}", error=True)
        function = self.callables.get(call.name)
        if function is None:
            return ToolResult(call.id, call.name, f"Error: no tool is called {call.name!r}", error=True)
        arguments = call.arguments_value()
        try:
            value = function(**arguments) if isinstance(arguments, dict) else function(arguments)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the tool's own failure: the model reads it and may try again
            return ToolResult(call.id, call.name, f"Error: {type(exc).__name__}: {exc}", error=True)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if len(text) > MAX_RESULT_CHARS:
            text = text[:MAX_RESULT_CHARS] + f"… (cut: {len(text)} characters in all)"
        return ToolResult(call.id, call.name, text)


def load_functions(sources: Sequence[str]) -> Functions:
    """The public functions of each source: a .py file's path, or Python code itself."""
    tools: list[Tool] = []
    callables: dict[str, Callable[..., Any]] = {}
    for index, source in enumerate(sources):
        path = Path(source).expanduser()
        if source.endswith(".py") or (path.is_file() and "\n" not in source):
            try:
                code, origin = path.read_text(encoding="utf-8"), str(path)
            except OSError as exc:
                raise UsageError(f"--functions {source}: {exc.strerror or exc}") from None
        else:
            code, origin = source, f"<--functions {index + 1}>"
        module = types.ModuleType(_MODULE)
        try:
            exec(compile(code, origin, "exec"), module.__dict__)  # the user's own code, named on the command line
        except SyntaxError as exc:
            raise UsageError(f"--functions {origin}:{exc.lineno}: {exc.msg}") from None
        except Exception as exc:
            raise UsageError(f"--functions {origin} failed when loaded: {type(exc).__name__}: {exc}") from None
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == _MODULE and not name.startswith("_"):
                if name in callables:
                    raise UsageError(f"--functions: two functions are called {name}")
                tools.append(tool_of(value))
                callables[name] = value
    if not tools:
        raise UsageError("--functions defines no public function", hint="def multiply(a: int, b: int) -> int: ...")
    return Functions(tuple(tools), callables)


def tool_of(function: Callable[..., Any]) -> Tool:
    """A function's tool: the JSON Schema of its parameters from their type hints, its docstring's description."""
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # a hint that cannot be resolved: that parameter takes any JSON value
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[parameter.name] = _schema_of(hints.get(parameter.name))
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    doc = inspect.getdoc(function) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    schema = {"type": "object", "properties": properties, "required": required}
    return Tool(function.__name__, description, json.dumps(schema))


def _schema_of(hint: Any) -> dict[str, Any]:
    if hint is None or hint is Any:
        return {}
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _schema_of(options[0]) if len(options) == 1 else {"anyOf": [_schema_of(a) for a in options]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        items = typing.get_args(hint)
        return {"type": "array", **({"items": _schema_of(items[0])} if items else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    kind = _JSON_TYPES.get(hint)
    return {"type": kind} if kind else {}
