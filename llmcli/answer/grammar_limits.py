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
