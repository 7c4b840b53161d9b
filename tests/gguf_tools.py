"""Make variants of a real GGUF file for tests: metadata dropped or replaced, weights untouched."""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


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


@dataclass(frozen=True)
class _Layout:
    """Where a GGUF file's parts lie: its key/value entries (bytes, by key), its tensor infos (bytes, in order), each
    tensor's data (offset from the data section, bytes to the next tensor's or to the end), the data section."""

    entries: dict[str, bytes]
    tensors: list[tuple[bytes, int, int]]  # (info, data offset, data bytes)
    alignment: int
    data_offset: int

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    @property
    def tensor_infos(self) -> bytes:
        return b"".join(info for info, _, _ in self.tensors)


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF's scalar types: bytes each
_STRING, _ARRAY = 8, 9


def _past(buf: bytes, pos: int, type_id: int) -> int:
    """Where the value of type `type_id` at `pos` ends (a test's own walk of the format: files here are trusted)."""
    if type_id in _FIXED:
        return pos + _FIXED[type_id]
    if type_id == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if type_id == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _FIXED:
            return pos + count * _FIXED[item]
        for _ in range(count):
            pos = _past(buf, pos, item)
        return pos
    raise ValueError(f"GGUF value type {type_id}")


@functools.lru_cache(maxsize=8)
def _layout(src: Path, mtime_ns: int) -> _Layout:
    """Read once per file and process (a walk of the header: ~0.1 s on SmolLM2's 49k-token vocabulary, where gguf's
    numpy reader took ~2.4 s)."""
    with src.open("rb") as handle:
        buf = handle.read(64 << 20)  # (the header: the metadata and tensor infos, well under 64 MiB here)
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, entries, alignment = 24, {}, 32
    for _ in range(n_kv):
        start, length = pos, struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8 : pos + 8 + length].decode()
        type_id = struct.unpack_from("<I", buf, pos + 8 + length)[0]
        pos = _past(buf, pos + 12 + length, type_id)
        entries[key] = buf[start:pos]
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, pos - 4)[0]
    infos = []
    for _ in range(n_tensors):
        start = pos
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        pos += 4 + 8 * n_dims + 4 + 8
        infos.append((buf[start:pos], struct.unpack_from("<Q", buf, pos - 8)[0]))
    data_offset = pos + (-pos % alignment)
    offsets = sorted(offset for _, offset in infos)
    end = dict(zip(offsets, [*offsets[1:], src.stat().st_size - data_offset], strict=True))  # the next tensor's start
    return _Layout(entries, [(info, offset, end[offset] - offset) for info, offset in infos], alignment, data_offset)


def rewrite_metadata(
    src: Path, dst: Path, drop: tuple[str, ...] = (), strings: dict[str, str | float | int] | None = None
) -> Path:
    """Copy `src` to `dst` without the keys in `drop` and with keys set from `strings` (str, float or int)."""
    strings = strings or {}
    layout = _layout(src, src.stat().st_mtime_ns)
    kv_entries = [entry for name, entry in layout.entries.items() if name not in drop and name not in strings]
    for key, value in strings.items():
        kv_entries.append(_string(key) + _value(value))
    header = b"GGUF" + struct.pack("<IQQ", 3, layout.n_tensors, len(kv_entries))
    body = header + b"".join(kv_entries) + layout.tensor_infos
    body += b"\0" * (-len(body) % layout.alignment)
    with src.open("rb") as source, dst.open("wb") as out:
        out.write(body)
        copy_range(source, out, layout.data_offset, src.stat().st_size, out.tell())  # the tensors
    return dst


def copy_range(source: BinaryIO, target: BinaryIO, begin: int, end: int, at: int) -> None:
    """Bytes [begin, end) of `source` written at `at` in `target`, copied by the kernel (a model's ~94 MB of tensors
    never pass through Python)."""
    copied = begin
    while copied < end and (done := os.copy_file_range(source.fileno(), target.fileno(), end - copied, copied,
                                                       at + copied - begin)):
        copied += done


def split_gguf(src: Path, out_dir: Path, stem: str, parts: int) -> list[Path]:
    """Split `src` into `parts` shards named STEM-0000i-of-0000n.gguf, as llama.cpp's gguf-split does:
    shard 1 keeps all metadata, every shard carries split.no / split.count / split.tensors.count."""
    layout = _layout(src, src.stat().st_mtime_ns)
    tensors = layout.tensors
    per_part = -(-len(tensors) // parts)
    paths = []
    with src.open("rb") as source:
        for index in range(parts):
            chunk = tensors[index * per_part : (index + 1) * per_part]
            split_kv = [
                _string("split.no") + struct.pack("<IH", 2, index),
                _string("split.count") + struct.pack("<IH", 2, parts),
                _string("split.tensors.count") + struct.pack("<Ii", 5, len(tensors)),
            ]
            kvs = (list(layout.entries.values()) if index == 0 else []) + split_kv
            infos, spans, offset = [], [], 0
            for info, begin, n_bytes in chunk:  # each tensor's data (and its padding) at its offset in this shard
                infos.append(info[:-8] + struct.pack("<Q", offset))
                spans.append((layout.data_offset + begin, n_bytes, offset))
                offset += n_bytes + (-n_bytes % layout.alignment)
            body = b"GGUF" + struct.pack("<IQQ", 3, len(chunk), len(kvs)) + b"".join(kvs) + b"".join(infos)
            body += b"\0" * (-len(body) % layout.alignment)
            path = out_dir / f"{stem}-{index + 1:05d}-of-{parts:05d}.gguf"
            with path.open("wb") as out:
                out.write(body)
                for begin, n_bytes, at in spans:
                    copy_range(source, out, begin, begin + n_bytes, len(body) + at)
                out.truncate(len(body) + offset)  # (the last tensor's padding, as zeros)
            paths.append(path)
    return paths


def write_projector(path: Path, n_embd_text: int, kind: str = "mlp", width: int = 64, layers: int = 2,
                    image_size: int = 56, patch: int = 14, heads: int = 4, ffn: int | None = None,
                    scale_factor: int = 2, seed: int = 0, out_scale: float = 0.5, f16: bool = False) -> Path:
    """A random-weight vision projector (mmproj) that llama.cpp's mtmd loads: SigLIP-shaped blocks of `width`, then a
    `kind` projection (gemma3: average pool by `scale_factor`, RMS norm, one matrix; mlp: LLaVA's two layers) into
    `n_embd_text`. Kilobytes at the defaults, encoded in milliseconds; its answers mean nothing. `out_scale`: the
    projection's weights (large enough that a picture changes the answer). `f16`: matrices in f16, as published
    projectors hold them (for realistic sizes)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    ffn = ffn or 4 * width
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", kind)
    for key, value in (("image_size", image_size), ("patch_size", patch), ("embedding_length", width),
                       ("feed_forward_length", ffn), ("block_count", layers), ("attention.head_count", heads),
                       ("projection_dim", n_embd_text)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if kind == "gemma3":
        writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)

    def tensor(name: str, *shape: int, scale: float = 0.02, ones: bool = False) -> None:
        data = np.ones(shape, np.float32) if ones else (rng.standard_normal(shape, np.float32) * scale)
        writer.add_tensor(name, data.astype(np.float16) if f16 and len(shape) > 1 and "position" not in name else data)

    tensor("v.patch_embd.weight", width, 3, patch, patch)
    tensor("v.patch_embd.bias", width)
    tensor("v.position_embd.weight", (image_size // patch) ** 2, width)
    for i in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"v.blk.{i}.{part}.weight", width, width)
            tensor(f"v.blk.{i}.{part}.bias", width)
        tensor(f"v.blk.{i}.ffn_up.weight", ffn, width)
        tensor(f"v.blk.{i}.ffn_up.bias", ffn)
        tensor(f"v.blk.{i}.ffn_down.weight", width, ffn)
        tensor(f"v.blk.{i}.ffn_down.bias", width)
        for norm in ("ln1", "ln2"):
            tensor(f"v.blk.{i}.{norm}.weight", width, ones=True)
            tensor(f"v.blk.{i}.{norm}.bias", width)
    tensor("v.post_ln.weight", width, ones=True)
    tensor("v.post_ln.bias", width)
    if kind == "gemma3":
        tensor("mm.soft_emb_norm.weight", width, ones=True)
        tensor("mm.input_projection.weight", width, n_embd_text, scale=out_scale)
    else:
        tensor("mm.0.weight", n_embd_text, width, scale=out_scale)
        tensor("mm.0.bias", n_embd_text)
        tensor("mm.2.weight", n_embd_text, n_embd_text, scale=out_scale / 10)
        tensor("mm.2.bias", n_embd_text)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
