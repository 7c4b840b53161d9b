"""Backslash escapes in text a user types (a flag, an environment value, chat's /set): `--stop "\\n"` is a newline,
as llama.cpp's tools read it."""

from __future__ import annotations

import re

_ESCAPE = r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[ntr0\\\"'])"  # compiled on first use (re caches it)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}


def unescape(text: str) -> str:
    r"""`\n`, `\t`, `\r`, `\0`, `\\`, `\"`, `\'`, `\xHH`, `\uHHHH` as the characters they name, as llama.cpp's
    tools read them; any other backslash stays as it is."""

    def replace(match: re.Match[str]) -> str:
        code = match.group(1)
        return chr(int(code[1:], 16)) if code[0] in "ux" else _SIMPLE_ESCAPES[code]

    return re.sub(_ESCAPE, replace, text)
