"""JSON Schema -> GBNF: llama-cpp-python's converter, taught the integer bounds it leaves out.

llama-cpp-python's `SchemaConverter` lags llama.cpp's C++ converter: `minimum`/`maximum` (and their
exclusive forms) of an integer are ignored, so a constrained answer could still break its schema.
Here an integer with bounds becomes an alternation of digit patterns that matches exactly the integers
in range, as llama.cpp's own converter writes them (the patterns are this module's own).

It also writes a bounded repetition (`maxLength`, `maxItems`, a pattern's `{m,n}`) as llama.cpp's own `{m,n}`, which
stays flat, instead of optional groups nested once per repeat (`maxLength: 30000` nested 30,000 deep and crashed
llama.cpp's recursive parser). A bound above MAX_REPEAT is left to the check of the finished answer (a repeat count
llama.cpp would make unbounded itself); a minimum above it is refused. Every grammar made here is measured against
llmcli/answer/grammar_limits.py before it is returned.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Any

from llama_cpp import llama_grammar

from llmcli.answer.constraint import Constraint
from llmcli.answer.grammar_limits import MAX_REPEAT
from llmcli.answer.sampling_config import SamplingConfig, check_grammar
from llmcli.answer.tool_calls import FORMATS, ToolSpec
from llmcli.errors import UsageError
from llmcli.llama.vocab import Vocabulary

DIGIT = "[0-9]"


def with_grammar(constraint: Constraint) -> Constraint:
    """The constraint with the grammar that enforces it while generating: JSON's for --format json, the schema's
    for --json-schema (a --grammar already is one)."""
    if constraint.grammar is not None or not constraint.json:
        return constraint
    if constraint.schema is None:
        return dataclasses.replace(constraint, grammar=llama_grammar.JSON_GBNF)
    try:
        gbnf_text = schema_to_gbnf(dict(constraint.schema))
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise UsageError(f"--json-schema cannot be turned into a grammar: {_reason(exc)}") from None
    # llama-cpp-python's converter lets raw control characters (a newline) into strings, which
    # is not JSON; llama.cpp's own converter excludes them. Exclude them here too.
    gbnf_text = gbnf_text.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)
    check_grammar(gbnf_text, "--json-schema")
    return dataclasses.replace(constraint, grammar=gbnf_text)


_LOOSE_JSON_CHAR = r'char ::= [^"\\] |'
_STRICT_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    resolved = converter.resolve_refs(schema, "schema")
    converter.visit(resolved, "")
    return str(converter.format_grammar())


def _flat_repetition(item_rule: str, min_items: int, max_items: int | None, separator_rule: str | None = None,
                     item_rule_is_literal: bool = False) -> str:
    """`item_rule` repeated min..max times (max None: no limit), `separator_rule` between two: llama.cpp's `{m,n}`,
    flat, where llama-cpp-python's `_build_repetition` nests an optional group per repeat (`item_rule` is one symbol: a
    rule's name or a literal)."""
    if not isinstance(min_items, int) or min_items < 0 or (max_items is not None and not isinstance(max_items, int)):
        raise ValueError(f"a repetition of {min_items}..{max_items} is not a count")
    if min_items > MAX_REPEAT:
        raise ValueError(f"at least {min_items} items or characters is more than a grammar requires "
                         f"(the most is {MAX_REPEAT})")
    if max_items is not None and max_items > MAX_REPEAT:
        max_items = None  # enforced by the check of the finished answer (and -n), not by the grammar
    if max_items is not None and max_items < min_items:
        raise ValueError(f"at most {max_items} is less than at least {min_items}")
    if max_items == 0:
        return '""'
    if not separator_rule:
        return _times(item_rule, min_items, max_items)
    rest = _times(f"({separator_rule} {item_rule})", max(min_items - 1, 0), None if max_items is None else max_items - 1)
    body = f"{item_rule} {rest}".rstrip()
    return body if min_items > 0 else f"({body})?"


def _times(symbol: str, low: int, high: int | None) -> str:
    if high is None:
        return f"{symbol}*" if low == 0 else f"{symbol}+" if low == 1 else f"{symbol}{{{low},}}"
    if low == high:
        return "" if low == 0 else symbol if low == 1 else f"{symbol}{{{low}}}"
    return f"{symbol}?" if (low, high) == (0, 1) else f"{symbol}{{{low},{high}}}"


# The converter builds every repetition through this module-level helper: it is the one private name of
# llama-cpp-python this module replaces (tests/test_hostile.py checks that a long maxLength stays flat).
llama_grammar._build_repetition = _flat_repetition


# What makes a schema say something about its value; a schema with none of these (`{"description": …}`, `true`) takes
# any JSON value, as JSON Schema says (llama-cpp-python's converter fails on one, or reads `{}` as an object).
_STRUCTURAL = frozenset({"type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "not", "properties", "items",
                         "prefixItems", "additionalProperties", "required", "pattern", "format", "minLength",
                         "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems",
                         "patternProperties", "propertyNames", "minProperties", "maxProperties", "if", "then", "else"})


class _Converter(llama_grammar.SchemaConverter):
    def visit(self, schema: Any, name: str) -> Any:
        rule_name = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
        if schema is False:
            raise ValueError("a `false` schema allows no value")
        if schema is True or (isinstance(schema, dict) and not _STRUCTURAL & schema.keys()):
            return self._add_rule(rule_name, self._add_primitive("value", llama_grammar.PRIMITIVE_RULES["value"]))
        if not isinstance(schema, dict):
            raise ValueError(f"a schema is an object or true/false, not {type(schema).__name__}")
        bounds = integer_bounds(schema) if schema.get("type") == "integer" else None
        if bounds is None or bounds == (None, None):
            return super().visit(schema, name)
        return self._add_rule(rule_name, f"({integer_range(*bounds)}) space")


def _reason(exc: Exception) -> str:
    """What a user reads of a converter's failure: its own words for what it refuses, never a Python error's text."""
    if isinstance(exc, (ValueError, UsageError)) and not isinstance(exc, UnicodeError):
        return str(exc)
    return "it uses a construct the grammar converter does not take"


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integer a schema allows (None: unbounded)."""
    low = high = None
    if isinstance(schema.get("minimum"), (int, float)):
        low = math.ceil(schema["minimum"])
    if isinstance(schema.get("exclusiveMinimum"), (int, float)) and not isinstance(schema["exclusiveMinimum"], bool):
        low = max(low if low is not None else -math.inf, math.floor(schema["exclusiveMinimum"]) + 1)
    if isinstance(schema.get("maximum"), (int, float)):
        high = math.floor(schema["maximum"])
    if isinstance(schema.get("exclusiveMaximum"), (int, float)) and not isinstance(schema["exclusiveMaximum"], bool):
        high = min(high if high is not None else math.inf, math.ceil(schema["exclusiveMaximum"]) - 1)
    return (None if low is None else int(low)), (None if high is None else int(high))


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF alternation matching exactly the JSON integers in [low, high] (no leading zeros)."""
    alternatives: list[str] = []
    if low is None or low < 0:  # the negative part: "-" and the magnitudes
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        if top is None or bottom <= top:
            alternatives += [f'"-" {alt}' for alt in _naturals(bottom, top)]
    if high is None or high >= 0:
        alternatives += _naturals(max(low or 0, 0), high)
    if not alternatives:
        raise ValueError(f"no integer lies in [{low}, {high}]")
    return " | ".join(f"({alt})" for alt in alternatives)


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives for the integers in [low, high] (low >= 0; high None: unbounded), by digit count."""
    alternatives = []
    digits = len(str(low))
    last = len(str(high)) if high is not None else digits
    for length in range(digits, last + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = min(high, 10**length - 1) if high is not None else 10**length - 1
        if start <= end:
            alternatives += _same_length(str(start), str(end))
    if high is None:  # every longer number
        alternatives.append(" ".join(["[1-9]", *[DIGIT] * digits]) + f" {DIGIT}*")
    return alternatives


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives for the numbers between two digit strings of one length."""
    if low == high:
        return [f'"{low}"']
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [f'"{low[0]}" ({" | ".join(_same_length(low[1:], high[1:]))})']
    rest = len(low) - 1
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return [" ".join([f"[{low[0]}-{high[0]}]", *[DIGIT] * rest])]
    alternatives = [f'"{low[0]}" ({" | ".join(_same_length(low[1:], "9" * rest))})']
    if int(high[0]) - int(low[0]) > 1:
        alternatives.append(" ".join([f"[{int(low[0]) + 1}-{int(high[0]) - 1}]", *[DIGIT] * rest]))
    alternatives.append(f'"{high[0]}" ({" | ".join(_same_length("0" * rest, high[1:]))})')
    return alternatives


# -- tool calls ------------------------------------------------------------------------------------------------

_THINK = r'think ::= ([^<] | "<" [^/] | "</" [^t])* "</think>" space'


@functools.lru_cache(maxsize=64)
def tool_grammar(spec: ToolSpec, thinking_open: bool = False) -> tuple[str, tuple[str, ...]]:
    """The GBNF that makes every call of `spec` parse — one of the offered tools' names, then arguments that match
    its `parameters` — and the trigger patterns that start it: none for `required` or a named tool (the answer is
    the calls, from its first token; a reasoning model may think first: close the think block its template opened,
    or write one when its template knows <think>), the format's opening
    for `auto` (free text until the model opens a call: a lazy grammar)."""
    fmt = FORMATS[spec.format]
    try:
        alternatives = [{"type": "object", "properties": {"name": {"const": t.name},
                                                          fmt.args_key: _arguments_schema(t.parameters)},
                         "required": ["name", fmt.args_key], "additionalProperties": False} for t in spec.offered]
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        converter = _Converter(prop_order={"name": 0, fmt.args_key: 1}, allow_fetch=False, dotall=False,
                               raw_pattern=False)
        converter.visit(converter.resolve_refs(schema, "tools"), "call")
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise UsageError(f"the tools' parameters cannot be turned into a grammar: {_reason(exc)}") from None
    rules = str(converter.format_grammar()).replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)
    parallel = spec.parallel and spec.choice.mode != "function"  # a named tool is called once, as OpenAI does
    one = f"{_literal(fmt.start)} space call space {_literal(fmt.end)}" if fmt.end else "call"
    if fmt.listed:
        more = '(space "," space call)*' if parallel else ""
        calls = f'{_literal(fmt.start)} space "[" space call {more} space "]"'
    elif fmt.separator:
        more = f"(space {_literal(fmt.separator)}? space call)*" if parallel else ""
        calls = f"call {more}"
    else:
        calls = "one (space one)*" if parallel else "one"
    lazy = spec.choice.mode == "auto"
    prefix = "" if lazy else "think " if thinking_open else '("<think>" think)? ' if spec.think_first else ""
    root = f"root ::= {prefix}calls\ncalls ::= {calls}\none ::= {one}\n" + (_THINK + "\n" if prefix else "")
    triggers: tuple[str, ...] = ()
    if lazy:
        opening = re.escape(fmt.start) if fmt.start else r"\{"
        triggers = (r"[\s\S]*?(" + opening + r")[\s\S]*",) if fmt.start else (r"\s*(" + opening + r")[\s\S]*",)
    check_grammar(root + rules, "the tools")
    return root + rules, triggers


def _arguments_schema(parameters: dict[str, Any]) -> Any:
    """A tool's parameters as the schema of its call's arguments: always an object (a schema that says nothing of its
    value would take any JSON value), its local refs inlined."""
    inlined = _inline_refs(parameters, parameters)
    return inlined if _STRUCTURAL & inlined.keys() else {**inlined, "type": "object"}


def _inline_refs(value: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """A tool's schema with its local `$ref`s (`#/$defs/…`, `#/definitions/…`) replaced by what they name: each tool
    becomes one alternative of the calls' schema, where its own refs would no longer resolve. A recursive schema is
    refused (no grammar holds it)."""
    if depth > 32:
        raise UsageError("a recursive $ref cannot be turned into a grammar")
    if isinstance(value, dict):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target: Any = root
            for part in ref[2:].split("/"):
                target = target[part.replace("~1", "/").replace("~0", "~")]
            return _inline_refs(target, root, depth + 1)
        return {k: _inline_refs(v, root, depth + 1) for k, v in value.items() if k not in ("$defs", "definitions")}
    if isinstance(value, list):
        return [_inline_refs(v, root, depth + 1) for v in value]
    return value


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'


def with_tool_grammar(sampling: SamplingConfig, spec: ToolSpec | None, thinking_open: bool = False,
                      preference: float = 0.0, vocab: Vocabulary | None = None) -> SamplingConfig:
    """The sampling of an answer that may call tools: its grammar is the tools' (a --grammar and tools cannot be
    combined: the request is refused before this). Under `auto`, with a `preference` and the model's `vocab`: the
    first token of the call's opening gets that much more logit at the answer's first token, and an answer that begins
    with it is held to the call's grammar from there (a small model rarely opens a call by itself: the decision stays
    the model's, on its own probabilities, shifted by a preference the user sets)."""
    if spec is None or not spec.active:
        return sampling
    grammar, triggers = tool_grammar(spec, thinking_open)
    sampling = dataclasses.replace(sampling, grammar=grammar, grammar_triggers=triggers, grammar_origin="the tools")
    if spec.choice.mode != "auto" or preference <= 0 or vocab is None or thinking_open:
        return sampling
    fmt = FORMATS[spec.format]
    opening = fmt.start or '{"name": "'
    tokens = vocab.tokenize(opening, add_special=False)
    if not tokens:
        return sampling
    piece = vocab.piece(tokens[0], special=True).decode("utf-8", "replace").strip()
    if not piece or not opening.startswith(piece):
        return sampling  # (a first token that is not the opening's own first characters: nothing to anchor on)
    # The answer so far is that first token alone (a full match: an answer that merely begins with the same character,
    # as an end-of-generation token's text `<|im_end|>` does, never holds to the call's grammar): the grammar from there.
    anchored = r"^\s*(" + re.escape(piece) + r")$"  # (^…$: llama.cpp looks for a pattern anywhere in the answer)
    return dataclasses.replace(sampling, grammar_triggers=(*triggers, anchored),
                               first_token_bias=((tokens[0], preference),))
