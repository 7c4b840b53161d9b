"""Constrained answers: what --grammar, --grammar-file, --json-schema or --format json ask for, and the check
of the finished answer against it (a grammar cannot express everything a schema says, and an
answer cut off by -n or the context is not valid JSON).

Enforced while generating (the grammar): JSON syntax, object keys and required properties, types, enums
and constants, string lengths, integer bounds (`minimum`, `maximum` and their exclusive forms: see
schema_grammar.py). Checked afterwards (jsonschema): all of the schema (patterns, number bounds, array
lengths, formats, combinations the grammar approximates). An answer that fails the check carries the reason
(`Done.format_error`), and `llmcli run` exits 8.

Pure: the GBNF of a schema is made by llama.cpp's converter (llmcli/llama/schema_grammar.py `with_grammar`), for
a local model only; a server (--endpoint) is sent the schema itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.answer.grammar_limits import MAX_GRAMMAR_BYTES
from llmcli.errors import UsageError

MAX_SCHEMA_BYTES = 1 << 20  # a --json-schema file (a request's is bounded by serve's --max-body)


@dataclass(frozen=True)
class Constraint:
    grammar: str | None = None  # GBNF, root rule "root"
    origin: str = ""  # the flag it came from, for messages
    json: bool = False  # the answer must be one JSON value (--format json, --json-schema)
    schema: Mapping[str, Any] | None = None  # ... matching this schema (--json-schema)

    def problem(self, text: str, finish_reason: str) -> str | None:
        """Why the finished answer is not what was asked, or None."""
        if not self.json:
            return None
        cut = {"length": " (cut off by -n)", "context_full": " (cut off: the context is full)",
               "interrupted": " (interrupted)"}.get(finish_reason, "")
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"the answer is not valid JSON{cut}: {exc}"
        if self.schema is None:
            return None
        import jsonschema  # only when a schema is asked for

        validator = jsonschema.validators.validator_for(self.schema)(self.schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is None:
            return None
        where = "/".join(str(part) for part in error.absolute_path) or "the answer"
        return f"the answer does not match the {self.origin or '--json-schema'} at {where}: {error.message}"


GRAMMAR_FLAGS = ("--grammar", "--grammar-file")  # where a grammar given as GBNF comes from (its errors name it)


def build_constraint(
    gbnf: str | None = None,
    gbnf_file: Path | None = None,
    json_schema: str | None = None,
    json_format: bool = False,
) -> Constraint:
    """The constraint whichever of --grammar, --grammar-file, --json-schema, --format json asks for (the JSON ones
    without their grammar: `with_grammar` adds it for a local model). A schema is a JSON document or a path to one.
    """
    chosen = [flag for flag, value in (
        ("--grammar", gbnf), ("--grammar-file", gbnf_file), ("--json-schema", json_schema), ("--format json", json_format)
    ) if value]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)} cannot be combined: choose one way to constrain the answer")
    if not chosen:
        return Constraint()
    flag = chosen[0]
    if gbnf_file is not None:
        try:
            if gbnf_file.stat().st_size > MAX_GRAMMAR_BYTES:  # refused before it is read (grammar_limits.py)
                raise UsageError(f"--grammar-file {gbnf_file} is larger than a grammar may be ({MAX_GRAMMAR_BYTES} bytes)")
            return Constraint(gbnf_file.read_text(encoding="utf-8"), flag)
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --grammar-file {gbnf_file}: {exc}") from None
    if gbnf is not None:
        return Constraint(gbnf, flag)
    if json_format:
        return Constraint(None, flag, json=True)
    assert json_schema is not None
    return Constraint(None, flag, json=True, schema=_load_schema(json_schema))


def _load_schema(json_schema: str) -> dict[str, Any]:
    text = json_schema
    if not text.lstrip().startswith("{"):
        try:
            if Path(text).stat().st_size > MAX_SCHEMA_BYTES:
                raise UsageError(f"--json-schema {text} is larger than {MAX_SCHEMA_BYTES} bytes")
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--json-schema is neither a JSON object nor a readable file: {exc}") from None
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"--json-schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema must be a JSON object (a schema)")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise UsageError(f"--json-schema is not a valid JSON Schema: {exc.message}") from None
    except RecursionError:
        raise UsageError("--json-schema nests too deep to be checked") from None
    return schema

