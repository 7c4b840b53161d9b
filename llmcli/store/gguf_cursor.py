"""Bounds-checked reads of a GGUF file's bytes (the `Cursor`): every count and length is checked against the bytes
that remain before anything is read or allocated, and every failure is an IntegrityError that names the byte offset.
Long arrays (a vocabulary) are summarised, not kept. llmcli/store/gguf_header.py reads headers with it."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import IntegrityError

_U64 = struct.Struct("<Q")
MAXARRAY_DEPTH = 2
KEPTARRAY_LEN = 64  # longer arrays are summarised (type and length), not kept

# GGUF metadata value types: id -> (struct format, size); 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class ArraySummary:
    """A metadata array too long to keep (e.g. the vocabulary): its type, length and where its items start."""

    item_type: int
    length: int
    offset: int = 0


class Cursor:
    """Bounds-checked reads from a buffer; every failure is an IntegrityError."""

    def __init__(self, buf: Any, size: int, path: Path):
        self.buf, self.size, self.pos, self.path = buf, size, 0, path

    def fail(self, what: str) -> IntegrityError:
        return IntegrityError(
            f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos})",
            hint="Re-download the model; the file is corrupt or truncated.",
        )

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes < 0 or self.pos + n_bytes > self.size:
            raise self.fail(f"{what} runs past the end of the file")

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", 8, what))

    def string(self, what: str) -> str:
        start, length = self._string_span(what)
        try:
            return bytes(self.buf[start : start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def strings(self, count: int, what: str, keep: bool) -> list[bytes]:
        """Past the next `count` strings (a vocabulary, merges: ~100k of them) in one tight loop, each
        bounds-checked; their bytes if `keep`."""
        unpack, buf, size, pos = _U64.unpack_from, self.buf, self.size, self.pos
        kept: list[bytes] = []
        append = kept.append if keep else None
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"{what} length runs past the end of the file")
            start = pos + 8
            pos = start + unpack(buf, pos)[0]
            if pos > size:
                self.pos = start
                raise self.fail(f"{what} runs past the end of the file")
            if append is not None:
                append(buf[start:pos])
        self.pos = pos
        return kept

    def vocabulary(self, what: str) -> Any:
        """`tokenizer.ggml.tokens`: read like any value, and a long one checked for repeated tokens on the way
        (llama.cpp aborts the whole process, GGML_ASSERT, on a vocabulary with a repeated token)."""
        saved = self.pos
        item_type, length = self.u32(f"{what} item type"), self.u64(f"{what} length")
        if item_type != STRING or length <= KEPTARRAY_LEN:
            self.pos = saved
            return self.value(ARRAY, what)
        start = self.pos
        self.need(length * 8, what)
        _check_unique(self, self.strings(length, "token", keep=True), start)
        return ArraySummary(STRING, length, start)

    def _string_span(self, what: str) -> tuple[int, int]:
        length = self.u64(f"{what} length")
        self.need(length, what)
        start = self.pos
        self.pos += length
        return start, length

    def value(self, type_id: int, what: str, depth: int = 0) -> Any:
        if type_id in _SCALARS:
            fmt, size = _SCALARS[type_id]
            return self.unpack(fmt, size, what)
        if type_id == STRING:
            return self.string(what)
        if type_id == ARRAY and depth < MAXARRAY_DEPTH:
            item_type = self.u32(f"{what} item type")
            length = self.u64(f"{what} length")
            start = self.pos
            if item_type in _SCALARS:
                self.need(length * _SCALARS[item_type][1], what)
                if length > KEPTARRAY_LEN:
                    self.pos += length * _SCALARS[item_type][1]
                    return ArraySummary(item_type, length, start)
            elif item_type in (STRING, ARRAY):
                self.need(length * 8, what)  # each item is at least a u64 length
            else:
                raise self.fail(f"{what} has unknown item type {item_type}")
            if length > KEPTARRAY_LEN:
                if item_type == STRING:
                    self.strings(length, what, keep=False)
                else:
                    for _ in range(length):
                        self.skip_value(item_type, what, depth + 1)
                return ArraySummary(item_type, length, start)
            return [self.value(item_type, what, depth + 1) for _ in range(length)]
        raise self.fail(f"{what} has unknown value type {type_id}")

    def skip_value(self, type_id: int, what: str, depth: int) -> None:
        if type_id == STRING:
            self._string_span(what)
        else:
            self.value(type_id, what, depth)


def _check_unique(cur: Cursor, texts: list[bytes], offset: int) -> None:
    """No token repeats an earlier one, compared as llama.cpp reads them: as C strings (a NUL byte ends one)."""
    if b"\0" in b"".join(texts):
        texts = [text.split(b"\0", 1)[0] for text in texts]
    if len(set(texts)) < len(texts):
        first: dict[bytes, int] = {}
        index = next(i for i, text in enumerate(texts) if first.setdefault(text, i) != i)
        cur.pos = offset
        raise cur.fail(f"token {index} repeats an earlier token of the vocabulary")
