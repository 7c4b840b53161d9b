"""Grammars for constrained answers: GBNF text from --grammar, --grammar-file, --json-schema or --format json."""

from __future__ import annotations

import json
from pathlib import Path

from llmcli.errors import UsageError


def build_grammar(
    gbnf: str | None = None,
    gbnf_file: Path | None = None,
    json_schema: str | None = None,
    json_format: bool = False,
) -> tuple[str | None, str]:
    """GBNF text from whichever of --grammar, --grammar-file, --json-schema, --format json is set.

    Returns (grammar or None, the flag it came from). A schema is a JSON document or a path to one.
    """
    chosen = [flag for flag, value in (
        ("--grammar", gbnf), ("--grammar-file", gbnf_file), ("--json-schema", json_schema), ("--format json", json_format)
    ) if value]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)} cannot be combined: choose one way to constrain the answer")
    if not chosen:
        return None, ""
    flag = chosen[0]
    if gbnf_file is not None:
        try:
            return gbnf_file.read_text(encoding="utf-8"), flag
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --grammar-file {gbnf_file}: {exc}") from None
    if gbnf is not None:
        return gbnf, flag
    from llama_cpp import llama_grammar  # pure Python: the GBNF converter that ships with llama-cpp-python

    if json_format:
        return llama_grammar.JSON_GBNF, flag
    assert json_schema is not None
    text = json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--json-schema is neither a JSON object nor a readable file: {exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema must be a JSON object (a schema)")
    try:
        gbnf_text = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise UsageError(f"--json-schema cannot be turned into a grammar: {exc}") from None
    # llama-cpp-python's converter lets raw control characters (a newline) into strings, which
    # is not JSON; llama.cpp's own converter excludes them. Exclude them here too.
    return gbnf_text.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR), flag


_LOOSE_JSON_CHAR = r'char ::= [^"\\] |'
_STRICT_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'
