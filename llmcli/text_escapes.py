"""Backslash escapes in text a user types (a flag, an environment value, chat's /set): `--stop "\\n"` is a newline,
as llama.cpp's tools read it; and the other way, control characters in text from elsewhere (a model, a tool, a
server's stderr) made visible, so that it cannot drive the terminal it is shown on."""

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


# C0 and C1 control characters except tab and newline, in caret notation (ESC is ^[, CSI \x9b).
NEUTRALISE = {c: f"^{chr(c + 64)}" for c in range(32) if chr(c) not in "\t\n"}
NEUTRALISE.update({0x7F: "^?", **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)}})


def neutralised(text: str) -> str:
    """`text` with its control characters (but tab and newline) shown, not obeyed."""
    return text.translate(NEUTRALISE)
