"""What a grammar may cost before llama.cpp parses it: its size, rules, alternatives, nesting and repetitions.

llama.cpp's GBNF parser is recursive C++ with no depth limit of its own: a grammar whose groups are nested ~20,000 deep
overflows the stack (a segfault of the whole server, from a 130-byte JSON schema once llama-cpp-python's converter had
turned `maxLength: 30000` into nested optional groups), and a large one stalls every slot while the sampler walks it (a
575 KB GBNF of 60,000 alternatives: 43 s). Every grammar that reaches llama.cpp — `--grammar`, `--grammar-file`, the
grammar of a JSON schema or of the tools, a request's `grammar` — is measured here first, by a scanner that reads each
character once and builds nothing, and refused when it passes a limit (exit 2, or the protocol's 400 naming the field).

The limits (the README's "Grammar limits" says the same):
- MAX_GRAMMAR_BYTES of GBNF text;
- MAX_RULES rules, counting the ones llama.cpp writes for groups and `*`, `+`, `?`;
- MAX_ALTERNATIVES alternatives (`|`) in all;
- MAX_NESTING groups inside one another (llama.cpp's parser recurses once for each);
- a repetition `{m,n}` repeats at most MAX_REPEAT times (llama.cpp's own cap: it refuses a larger `m` and makes a larger
  `n` unbounded), and all of them together at most MAX_REPEATS times.

Pure: no llama.cpp here (llmcli/llama/schema_grammar.py writes bounded repetitions as `{m,n}`, which stays flat).
"""

from __future__ import annotations

import functools
import re

MAX_GRAMMAR_BYTES = 128 * 1024
MAX_RULES = 4_096  # rules and groups: a chain of 4,000 rules that may be empty takes llama.cpp 0.9 s to set up
MAX_ALTERNATIVES = 4_096  # 8,000 alternatives at one place: 1.4 s before the first token, then 2.7 tok/s (SmolLM2)
MAX_NESTING = 64
MAX_REPEAT = 2_000
MAX_REPEATS = 16_384  # the repeats of all `{m,n}` together (llama.cpp writes a rule for each)

_TOKENS = re.compile(r"""
    \#[^\n]*                                  # a comment
  | "(?:\\.|[^"\\])*"?                         # a literal (unterminated: llama.cpp says so)
  | \[(?:\\.|[^\]\\])*\]?                      # a character class
  | <[^>\s]*>                                 # a token (<think>, <[1234]>)
  | ::=                                       # a rule
  | \{\s*(\d*)\s*(,?)\s*(\d*)\s*\}?            # a repetition {m}, {m,}, {m,n}
  | [()|*+?]
""", re.VERBOSE)


def grammar_problem(gbnf: str) -> str | None:
    """Why this GBNF is too costly to hand to llama.cpp (one line), or None."""
    size = len(gbnf) if len(gbnf) > MAX_GRAMMAR_BYTES else len(gbnf.encode())  # (more characters: more bytes)
    return f"{size} bytes (the limit is {MAX_GRAMMAR_BYTES})" if size > MAX_GRAMMAR_BYTES else _problem(gbnf)


@functools.lru_cache(maxsize=128)  # a server's requests repeat their tools' and schemas' grammars
def _problem(gbnf: str) -> str | None:
    rules = alternatives = repeats = depth = deepest = 0
    for match in _TOKENS.finditer(gbnf):
        token = match.group()
        first = token[0]
        if first == "(":
            depth += 1
            rules += 1  # llama.cpp writes a rule for each group
            deepest = max(deepest, depth)
            if deepest > MAX_NESTING:
                return f"groups nested more than {MAX_NESTING} deep"
        elif first == ")":
            depth = max(depth - 1, 0)
        elif first == "|":
            alternatives += 1
        elif token == "::=":
            rules += 1
        elif first == "{":
            low, comma, high = match.group(1), match.group(2), match.group(3)
            if low and int(low) > MAX_REPEAT:
                return f"a repetition of at least {low} (the most is {MAX_REPEAT})"
            bounded = high if comma else low
            repeats += min(int(bounded), MAX_REPEAT) if bounded else 1  # a rule per optional repeat, as llama.cpp
            if repeats > MAX_REPEATS:
                return f"repetitions of more than {MAX_REPEATS} repeats in all"
        elif first in "*+?":
            rules += 1
        if alternatives > MAX_ALTERNATIVES:
            return f"more than {MAX_ALTERNATIVES} alternatives"
        if rules > MAX_RULES:
            return f"more than {MAX_RULES} rules (counting its groups and each *, + and ?)"
    return None


# -- what no answer can satisfy ----------------------------------------------------------------------------------
# llama.cpp's sampler aborts the process ("Unexpected empty grammar stack after accepting piece", SIGABRT) when the
# grammar allows no token: a NUL (no token's text holds one), a reversed or empty character class, or a class that
# only NUL matches. Seen here, before llama.cpp is given it (token ids beyond the vocabulary: llmcli/llama).

_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t"}
MAX_CODE_POINT = 0x10FFFF


def _characters(text: str) -> list[str]:
    """A literal's or class's text, its escapes read as llama.cpp reads them (one character each)."""
    found, at = [], 0
    for match in _ESCAPE.finditer(text):
        found += list(text[at:match.start()])
        code = match.group(1)
        found.append(chr(min(int(code[1:], 16), MAX_CODE_POINT)) if code[0] in "xuU" and len(code) > 1
                     else _SIMPLE.get(code, code))
        at = match.end()
    return found + list(text[at:])


def _class_problem(body: str) -> str | None:
    negated = body.startswith("^")
    chars = _characters(body[1:] if negated else body)
    ranges, index = [], 0
    while index < len(chars):
        low = high = chars[index]
        if index + 2 < len(chars) and chars[index + 1] == "-":
            high = chars[index + 2]
            index += 3
        else:
            index += 1
        if ord(high) < ord(low):
            return f"the character class [{body}] holds a reversed range"
        ranges.append((ord(low), ord(high)))
    if negated:
        reach = 1  # (NUL does not count: no token's text holds one)
        for first, last in sorted(ranges):
            if first > reach:
                return None
            reach = max(reach, last + 1)
        return None if reach <= MAX_CODE_POINT else f"the character class [{body}] excludes every character"
    if not ranges:
        return "an empty character class []"
    if all(high == 0 for _, high in ranges):
        return f"the character class [{body}] matches only NUL, which no token holds"
    return None


@functools.lru_cache(maxsize=128)
def dead_end(gbnf: str) -> str | None:
    """Why no answer can follow this GBNF, where that is plain from its text (one line), or None: llama.cpp would
    abort the process on it."""
    for match in _TOKENS.finditer(gbnf):
        token = match.group()
        if token[0] == '"' and len(token) > 1:
            if "\0" in _characters(token[1:-1]):
                return "a literal holds NUL, which no token holds"
        elif token[0] == "[":
            problem = _class_problem(token[1:-1] if token.endswith("]") else token[1:])
            if problem:
                return problem
    return None
