"""Make variants of a real GGUF file for tests: metadata dropped or replaced, weights untouched."""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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


@dataclass(frozen=True)
class _Layout:
    """Where a GGUF file's parts lie: its key/value entries (bytes, by key), its tensor infos (bytes), the data."""

    entries: dict[str, bytes]
    n_tensors: int
    tensor_infos: bytes
    alignment: int
    data_offset: int


@functools.lru_cache(maxsize=8)
def _layout(src: Path, mtime_ns: int) -> _Layout:
    """Read once per file and process (gguf's reader takes ~2.4 s on SmolLM2's 49k-token vocabulary)."""
    reader = GGUFReader(src)
    with src.open("rb") as handle:
        head = handle.read(reader.data_offset)
    entries = {name: head[field.offset : field.offset + sum(part.nbytes for part in field.parts)]
               for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    first, last = reader.tensors[0].field, reader.tensors[-1].field
    infos = head[first.offset : last.offset + sum(part.nbytes for part in last.parts)]
    return _Layout(entries, len(reader.tensors), infos, reader.alignment, reader.data_offset)


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
