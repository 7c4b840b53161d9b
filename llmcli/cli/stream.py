"""The streamed answer on stdout: written raw (never parsed as rich markup), flushed piece by piece,
coloured only on a terminal, with control characters neutralised there so model text cannot drive
the terminal. Piped, it is byte-clean UTF-8 with no escape codes. With --json, one record instead.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from rich.console import COLOR_SYSTEMS, Console
from rich.style import Style

from llmcli.errors import StdoutClosed
from llmcli.inference.events import Done, Token, answer_record

ANSWER_STYLE = Style(color="cyan")

# C0 and C1 control characters except tab and newline, shown in caret notation on a terminal.
_NEUTRALISE = {c: f"^{chr(c + 64)}" for c in range(32) if chr(c) not in "\t\n"}
_NEUTRALISE.update({0x7F: "^?", **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)}})


class AnswerSink:
    """Streams answer text to stdout; collects it for --json."""

    def __init__(self, stream: IO[str] | None = None, as_json: bool = False, extra: dict[str, Any] | None = None):
        self.stream = stream or sys.stdout
        self.as_json = as_json
        self.extra = extra or {}
        self.parts: list[str] = []
        self.notices: list[str] = []
        console = Console(file=self.stream)
        self.terminal = console.is_terminal and not as_json  # neutralise control characters there
        self._open, self._close = "", ""
        color_system = COLOR_SYSTEMS.get(console.color_system or "") if self.terminal and not console.no_color else None
        if color_system is not None:
            rendered = ANSWER_STYLE.render("\0", color_system=color_system)
            self._open, _, self._close = rendered.partition("\0")
        self._binary = getattr(self.stream, "buffer", None)

    def handle(self, event: Token | Done) -> None:
        if isinstance(event, Token):
            self.parts.append(event.text)
            if not self.as_json:
                self._write(event.text.translate(_NEUTRALISE) if self.terminal else event.text)
        elif self.as_json:
            self._write(json.dumps(self.record(event), ensure_ascii=False) + "\n")
        elif self.parts and not self.parts[-1].endswith("\n"):
            self._write("\n")  # end the answer's last line, so the shell prompt does not follow it

    def record(self, done: Done) -> dict[str, Any]:
        return {**self.extra, **answer_record("".join(self.parts), done, self.notices)}

    def _write(self, text: str) -> None:
        try:
            if self._binary is not None:
                self._binary.write(f"{self._open}{text}{self._close}".encode("utf-8", "replace"))
                self._binary.flush()
            else:
                self.stream.write(f"{self._open}{text}{self._close}")
                self.stream.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None


def write_json_line(record: Any) -> None:
    """One JSON object per line on stdout (--batch, chat --json), flushed."""
    try:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None
