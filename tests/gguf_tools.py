"""Make variants of a real GGUF file for tests: metadata dropped or replaced, weights untouched."""

from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFReader


def _string(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(value: str | float | int) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    return struct.pack("<Ii", 5, value)


def rewrite_metadata(
    src: Path, dst: Path, drop: tuple[str, ...] = (), strings: dict[str, str | float | int] | None = None
) -> Path:
    """Copy `src` to `dst` without the keys in `drop` and with keys set from `strings` (str, float or int)."""
    strings = strings or {}
    reader = GGUFReader(src)
    raw = src.read_bytes()
    kv_entries = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in drop or name in strings:
            continue
        end = field.offset + sum(part.nbytes for part in field.parts)
        kv_entries.append(raw[field.offset : end])
    for key, value in strings.items():
        kv_entries.append(_string(key) + _value(value))
    first, last = reader.tensors[0].field, reader.tensors[-1].field
    tensor_infos = raw[first.offset : last.offset + sum(part.nbytes for part in last.parts)]
    header = b"GGUF" + struct.pack("<IQQ", 3, len(reader.tensors), len(kv_entries))
    body = header + b"".join(kv_entries) + tensor_infos
    alignment = reader.alignment
    body += b"\0" * (-len(body) % alignment)
    with dst.open("wb") as out:
        out.write(body)
        out.write(memoryview(raw)[reader.data_offset :])
    return dst
