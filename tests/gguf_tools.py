"""Make variants of a real GGUF file for tests: metadata dropped or replaced, weights untouched."""

from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFReader


def _string(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


class U32(int):
    """An int written as GGUF's uint32 (llama.cpp insists on it for some keys, e.g. `{arch}.pooling_type`)."""


def _value(value: str | float | int) -> bytes:
    if isinstance(value, U32):
        return struct.pack("<II", 4, value)
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


def split_gguf(src: Path, out_dir: Path, stem: str, parts: int) -> list[Path]:
    """Split `src` into `parts` shards named STEM-0000i-of-0000n.gguf, as llama.cpp's gguf-split does:
    shard 1 keeps all metadata, every shard carries split.no / split.count / split.tensors.count."""
    reader = GGUFReader(src)
    raw = src.read_bytes()
    alignment = reader.alignment
    tensors = list(reader.tensors)
    per_part = -(-len(tensors) // parts)
    kv_all = [
        raw[f.offset : f.offset + sum(p.nbytes for p in f.parts)]
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
    ]
    paths = []
    for index in range(parts):
        chunk = tensors[index * per_part : (index + 1) * per_part]
        split_kv = [
            _string("split.no") + struct.pack("<IH", 2, index),
            _string("split.count") + struct.pack("<IH", 2, parts),
            _string("split.tensors.count") + struct.pack("<Ii", 5, len(tensors)),
        ]
        kvs = (kv_all if index == 0 else []) + split_kv
        infos, data, offset = [], [], 0
        for tensor in chunk:
            field = tensor.field
            info = bytearray(raw[field.offset : field.offset + sum(p.nbytes for p in field.parts)])
            info[-8:] = struct.pack("<Q", offset)
            infos.append(bytes(info))
            blob = raw[tensor.data_offset : tensor.data_offset + tensor.n_bytes]  # data_offset is absolute
            padding = b"\0" * (-len(blob) % alignment)
            data.append(blob + padding)
            offset += len(blob) + len(padding)
        body = b"GGUF" + struct.pack("<IQQ", 3, len(chunk), len(kvs)) + b"".join(kvs) + b"".join(infos)
        body += b"\0" * (-len(body) % alignment)
        path = out_dir / f"{stem}-{index + 1:05d}-of-{parts:05d}.gguf"
        path.write_bytes(body + b"".join(data))
        paths.append(path)
    return paths
