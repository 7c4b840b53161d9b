"""Tool-calling items in the Berkeley Function Calling Leaderboard's format, and its AST rules (simplified).

An item file is JSON lines: `{"id", "question": [[{"role", "content"}, …]], "function": [{"name", "description",
"parameters"}, …]}`; its possible answers (another file, by id): `{"id", "ground_truth": [{NAME: {PARAM: [accepted
values]}}, …]}` — one entry a call the question asks for, in any order; `""` among a parameter's values means it may be
left out. An item of an `irrelevance` category has no answer: no call is right.

BFCL's data ships in the `bfcl-eval` package; its data alone is read here (its directory found without importing the
package, whose dependencies are heavy): `pip install --no-deps bfcl-eval` installs just that.

The rules, as BFCL's AST checker applies them (the parts that matter for one turn): the number of calls is the number
asked for; each asked call is matched by a distinct call of the same function; a call's parameters are the function's
(no unknown one, every required one); each value is among the accepted ones — an integer is accepted for a float,
strings compare without case, spaces and the punctuation ` ,./-_*^`, lists element by element and objects key by key.
Function names with a dot (`math.factorial`) are offered with `_` (OpenAI allows no dot) and read back.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.answer.batch_jsonl import read_json_line
from llmcli.errors import UsageError

# The categories `eval tools` knows by name: their item file in BFCL's data (answers under possible_answer/).
CATEGORIES = {
    "simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json", "parallel": "BFCL_v4_parallel.json",
    "parallel_multiple": "BFCL_v4_parallel_multiple.json", "irrelevance": "BFCL_v4_irrelevance.json",
    "live_simple": "BFCL_v4_live_simple.json", "live_multiple": "BFCL_v4_live_multiple.json",
    "live_parallel": "BFCL_v4_live_parallel.json", "live_irrelevance": "BFCL_v4_live_irrelevance.json",
}
DEFAULT_CATEGORIES = ("simple", "multiple", "parallel", "irrelevance")
CALIBRATION_CATEGORIES = ("live_simple", "live_multiple", "live_irrelevance")  # real users' questions
# BFCL's parameter types as JSON Schema's (its own OpenAI handler maps them the same way).
_TYPES = {"dict": "object", "float": "number", "double": "number", "tuple": "array", "list": "array", "bool": "boolean",
          "any": "string", "Any": "string", "String": "string", "char": "string", "byte": "integer",
          "short": "integer", "long": "integer", "Bigint": "integer", "ArrayList": "array", "Array": "array",
          "HashMap": "object", "Hashtable": "object", "Queue": "array", "Stack": "array"}
_STRIP = re.compile(r"[ ,./\-_*^]")


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    messages: tuple[Mapping[str, str], ...]  # the conversation; the last one is the question
    functions: tuple[Mapping[str, Any], ...]  # as BFCL writes them
    expected: tuple[Mapping[str, Mapping[str, list[Any]]], ...] | None  # None: no call is right (irrelevance)

    @property
    def irrelevant(self) -> bool:
        return self.expected is None

    def tools(self) -> list[dict[str, Any]]:
        """The functions as OpenAI tools (names without dots, types as JSON Schema's)."""
        return [{"type": "function", "function": {"name": offered_name(f["name"]), "description": f.get("description", ""),
                                                  "parameters": _schema(f.get("parameters") or {})}}
                for f in self.functions]


@dataclass(frozen=True)
class Call:
    name: str  # as the model called it (the offered name)
    arguments: Any  # the decoded JSON arguments (anything: checked here)


@dataclass
class Verdict:
    correct: bool
    reason: str = ""  # why not, in BFCL's terms
    calls: list[Call] = field(default_factory=list)


def offered_name(name: str) -> str:
    return name.replace(".", "_")


def data_dir() -> Path | None:
    """bfcl-eval's data directory, when the package is installed (found without importing it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / "data" / CATEGORIES["simple"]).is_file():
            return Path(location) / "data"
    return None


def category_files(names: Sequence[str]) -> list[tuple[str, Path, Path | None]]:
    """(category, items file, answers file) of BFCL's own categories by name."""
    root = data_dir()
    if root is None:
        raise UsageError("BFCL's items are not installed", hint="pip install --no-deps bfcl-eval (its data alone is "
                         "read), or give your own: --items FILE --answers FILE")
    found = []
    for name in names:
        if name not in CATEGORIES:
            raise UsageError(f"no BFCL category {name!r}", hint="Known: " + ", ".join(CATEGORIES))
        answers = root / "possible_answer" / CATEGORIES[name]
        found.append((name, root / CATEGORIES[name], None if "irrelevance" in name else answers))
    return found


def load(category: str, items_file: Path, answers_file: Path | None, limit: int | None = None) -> list[Item]:
    """The first `limit` items of a category (all: None); without an answers file every item is an irrelevance one."""
    answers: dict[str, Any] = {}
    if answers_file is not None:
        for _, record in _records(answers_file):
            answers[str(record.get("id"))] = record.get("ground_truth")
    items = []
    for line_number, record in _records(items_file):
        try:
            question = record["question"]
            turn = question[0] if question and isinstance(question[0], list) else question
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in turn)
            functions = tuple(record["function"])
            if not messages or not all(isinstance(f, Mapping) and isinstance(f.get("name"), str) for f in functions):
                raise ValueError("no question, or a function without a name")
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise UsageError(f"{items_file}:{line_number}: not a BFCL item ({type(exc).__name__}: {exc})") from None
        item_id = str(record.get("id", f"{category}_{line_number}"))
        truth = answers.get(item_id) if answers_file is not None else None
        if answers_file is not None and not isinstance(truth, list):
            raise UsageError(f"{answers_file}: no possible answer for {item_id}")
        items.append(Item(item_id, category, messages, functions, tuple(truth) if truth is not None else None))
        if limit is not None and len(items) >= limit:
            break
    return items


def _records(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            record, problem = read_json_line(line)
            if problem is not None:  # (the items of a file are measured together: one bad line is the file's error)
                raise UsageError(f"{path}:{number}: not JSON ({problem})")
            if isinstance(record, dict):
                yield number, record


def _schema(value: Any) -> Any:
    """BFCL's parameter schema as JSON Schema: its types mapped, its own keys (`optional`) dropped."""
    if isinstance(value, list):
        return [_schema(v) for v in value]
    if not isinstance(value, dict):
        return value
    converted = {k: _schema(v) for k, v in value.items() if k not in ("optional",)}
    if isinstance(converted.get("type"), str):
        converted["type"] = _TYPES.get(converted["type"], converted["type"])
    if converted.get("type") == "array" and "items" not in converted:
        converted["items"] = {}
    return converted


def judge(item: Item, calls: Sequence[Call]) -> Verdict:
    """Whether `calls` (what the model called, in order) answer `item`, by the rules above."""
    if item.expected is None:
        return Verdict(not calls, "called a function where none fits" if calls else "", list(calls))
    if len(calls) != len(item.expected):
        return Verdict(False, f"{len(calls)} call{'s' if len(calls) != 1 else ''} where {len(item.expected)} "
                       f"{'was' if len(item.expected) == 1 else 'were'} asked for", list(calls))
    functions = {offered_name(f["name"]): f for f in item.functions}
    remaining = list(calls)
    reason = ""
    for expected in item.expected:
        ((name, accepted),) = expected.items()
        matched = None
        for call in remaining:
            problem = _check_call(call, offered_name(name), accepted, functions.get(offered_name(name), {}))
            if problem is None:
                matched = call
                break
            reason = reason or problem
        if matched is None:
            return Verdict(False, reason or f"no call of {name}", list(calls))
        remaining.remove(matched)
    return Verdict(True, "", list(calls))


def _check_call(call: Call, name: str, accepted: Mapping[str, list[Any]], function: Mapping[str, Any]) -> str | None:
    if call.name != name:
        return f"called {call.name} where {name} was asked for"
    if not isinstance(call.arguments, dict):
        return f"the arguments of {name} are not an object"
    parameters = (function.get("parameters") or {})
    known = parameters.get("properties") or {}
    for required in parameters.get("required") or ():
        if required not in call.arguments:
            return f"{name} lacks its required {required!r}"
    for key, value in call.arguments.items():
        if key not in accepted or (known and key not in known):
            return f"{name} has no parameter {key!r}"
        kind = (known.get(key) or {}).get("type")
        if not any(_same(value, candidate, kind) for candidate in accepted[key]):
            return f"{name}({key}={json.dumps(value)}) is none of {json.dumps(accepted[key])}"
    for key, values in accepted.items():
        if key not in call.arguments and "" not in values:
            return f"{name} lacks {key!r}"
    return None


def _same(value: Any, candidate: Any, kind: str | None = None) -> bool:
    """A value the model gave against one accepted value: an int for a float, strings standardized, lists and objects
    element by element (an object's accepted values are lists of candidates again, as BFCL nests them)."""
    if isinstance(candidate, str) and candidate == "" and value in ("", None):
        return True
    if isinstance(value, bool) or isinstance(candidate, bool):
        return value is candidate or value == candidate and type(value) is type(candidate)
    if isinstance(value, (int, float)) and isinstance(candidate, (int, float)):
        if isinstance(value, float) and isinstance(candidate, int) and kind not in ("float", "number"):
            return False  # (a float where an integer is asked for)
        return float(value) == float(candidate)
    if isinstance(value, str) and isinstance(candidate, str):
        return _standard(value) == _standard(candidate)
    if isinstance(value, list) and isinstance(candidate, list):
        return len(value) == len(candidate) and all(_same(v, c) for v, c in zip(value, candidate, strict=True))
    if isinstance(value, dict) and isinstance(candidate, dict):
        for key, options in candidate.items():
            choices = options if isinstance(options, list) else [options]
            if key not in value:
                if "" not in choices:
                    return False
            elif not any(_same(value[key], choice) for choice in choices):
                return False
        return all(key in candidate for key in value)
    return False


def _standard(text: str) -> str:
    return _STRIP.sub("", text).lower().replace("'", '"')
