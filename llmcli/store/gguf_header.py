"""A small, bounded reader for GGUF headers: metadata and tensor table, never weights.

It is the pre-flight check run before llama.cpp sees a file, and the source of
`show`/`list` metadata. The bytes are read through llmcli/store/gguf_cursor.py's bounded Cursor; this module says
what a header holds and checks what llama.cpp would trust. Every count and length is checked against the bytes that
remain before anything is allocated, so a hostile or truncated file fails in
milliseconds with `IntegrityError` instead of spinning or exhausting memory (the
`gguf` package's reader is not a validator).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmcli.errors import IntegrityError
from llmcli.store.gguf_cursor import ARRAY, STRING, ArraySummary, Cursor

MAGIC = b"GGUF"
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


# ggml tensor types: id -> (name, elements per block, bytes per block).
TENSOR_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# general.file_type (llama_ftype) -> the quant name users know.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # relative to the start of the data section
    n_bytes: int

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "unknown"))

    @property
    def name(self) -> str | None:
        value = self.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def context_length(self) -> int | None:
        value = self.get(f"{self.architecture}.context_length")
        return value if isinstance(value, int) else None

    @property
    def chat_template(self) -> str | None:
        value = self.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def quant(self) -> str:
        """The file type users know (Q4_K_M, ...), else the most common tensor type."""
        file_type = self.get("general.file_type")
        if isinstance(file_type, int) and file_type in FILE_TYPES:
            return FILE_TYPES[file_type]
        by_bytes: dict[str, int] = {}
        for tensor in self.tensors:
            type_name = TENSOR_TYPES[tensor.type_id][0]
            by_bytes[type_name] = by_bytes.get(type_name, 0) + tensor.n_bytes
        return max(by_bytes, key=by_bytes.__getitem__) if by_bytes else "unknown"


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse and validate the header of the GGUF file at `path` (remembered while the file is unchanged)."""
    path = Path(path)
    stat = path.stat()
    return _read_header(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    with _mapped(path, size) as buf:
        return _parse(Cursor(buf, size, path))


@contextmanager
def _mapped(path: Path, size: int) -> Iterator[mmap.mmap]:
    """The GGUF file at `path` mapped for reading, once its size and magic say it is one (an empty file cannot even be
    mapped)."""
    if size < 24:
        raise IntegrityError(f"{path} is not a GGUF file ({size} bytes)", hint="Pass a .gguf model file.")
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise IntegrityError(
                f"{path} is not a GGUF file (it does not start with 'GGUF')",
                hint="Pass a .gguf model file; other formats (safetensors, GGML, PyTorch) are not supported.",
            )
        yield buf


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of the GGUF file at `path` (its sampling defaults, its architecture), bounds-checked as every read
    is but without what only a load needs: the vocabulary is skipped, not checked for repeats, and the tensors are not
    read (~5× faster on a 49k vocabulary: a warm run reads this, its server the whole header)."""
    path = Path(path)
    stat = path.stat()
    return _read_metadata(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_metadata(path: Path, size: int, mtime_ns: int) -> dict[str, Any]:
    with _mapped(path, size) as buf:
        return _metadata(Cursor(buf, size, path), vocabulary=False)[1]


def _metadata(cur: Cursor, vocabulary: bool) -> tuple[int, dict[str, Any], int]:
    """(tensor count, the metadata, version); `vocabulary`: the tokens checked for repeats on the way."""
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version}")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise cur.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key = cur.string(f"metadata key #{index}")
        type_id = cur.u32(f"type of {key!r}")
        if vocabulary and key == "tokenizer.ggml.tokens" and type_id == ARRAY:
            metadata[key] = cur.vocabulary(f"value of {key!r}")
        else:
            metadata[key] = cur.value(type_id, f"value of {key!r}")
    return n_tensors, metadata, version


def _parse(cur: Cursor) -> GGUFHeader:
    n_tensors, metadata, version = _metadata(cur, vocabulary=True)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")

    tensors = []
    for index in range(n_tensors):
        name = cur.string(f"tensor name #{index}")
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cur.u64(f"shape of {name!r}") for _ in range(n_dims))
        type_id = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"offset of {name!r}")
        if type_id not in TENSOR_TYPES:
            raise cur.fail(f"tensor {name!r} has unknown type {type_id}")
        _, block, block_bytes = TENSOR_TYPES[type_id]
        n_elements = 1
        for dim in shape:
            if dim == 0 or dim > cur.size * block:  # no dimension can exceed what the file holds
                raise cur.fail(f"tensor {name!r} has dimension {dim}")
            n_elements *= dim
        if shape[0] % block:
            raise cur.fail(f"tensor {name!r} row of {shape[0]} is not a multiple of its block {block}")
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        tensors.append(TensorInfo(name, shape, type_id, offset, n_elements // block * block_bytes))

    data_offset = -(-cur.pos // alignment) * alignment
    end = data_offset
    for tensor in sorted(tensors, key=lambda t: t.offset):
        if data_offset + tensor.offset < end:
            raise cur.fail(f"tensor {tensor.name!r} overlaps the tensor before it")
        end = data_offset + tensor.offset + tensor.n_bytes
    if end > cur.size:
        raise IntegrityError(
            f"{cur.path} is truncated: its tensors need {end} bytes but the file has {cur.size}",
            hint="The download was probably interrupted; fetch the model again.",
        )
    header = GGUFHeader(cur.path, version, metadata, tuple(tensors), data_offset, cur.size)
    _check_values(header, cur)
    return header


# Keys whose values size llama.cpp's allocations and loops: positive and bounded.
_BOUNDED_COUNTS = {
    "block_count": 4096, "embedding_length": 1 << 20, "feed_forward_length": 1 << 22,
    "attention.head_count": 1 << 14, "attention.head_count_kv": 1 << 14, "context_length": 1 << 24,
    "vocab_size": 1 << 24,
}


def _check_values(header: GGUFHeader, cur: Cursor) -> None:
    """What llama.cpp trusts without checking (it may assert and abort): counts, token ids, vocab arrays."""
    meta = header.metadata
    if meta.get("split.no", 0) != 0:
        return  # a later shard of a split model carries tensors only
    if not isinstance(meta.get("general.architecture"), str):
        raise cur.fail("general.architecture is missing or not a string")
    arch = header.architecture
    for key, limit in _BOUNDED_COUNTS.items():
        value = meta.get(f"{arch}.{key}")
        if value is None or isinstance(value, list):  # absent, or per-layer arrays (checked by llama.cpp)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
            raise cur.fail(f"{arch}.{key} = {value!r} is out of range")
    for key, value in meta.items():  # epsilons, rope bases and scales: llama.cpp asserts on a NaN (abort, exit 134)
        if key.startswith(f"{arch}.") and isinstance(value, float):
            if not math.isfinite(value) or ("epsilon" in key and value <= 0):
                raise cur.fail(f"{key} = {value!r} is not a usable number")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = tokens.length if isinstance(tokens, ArraySummary) else len(tokens) if isinstance(tokens, list) else None
    if n_vocab is None:
        return
    if isinstance(tokens, ArraySummary) and tokens.item_type != STRING:
        raise cur.fail("tokenizer.ggml.tokens is not an array of strings")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        other = meta.get(key)
        length = other.length if isinstance(other, ArraySummary) else len(other) if isinstance(other, list) else n_vocab
        if length != n_vocab:
            raise cur.fail(f"{key} has {length} entries for a vocabulary of {n_vocab}")
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < n_vocab:
                raise cur.fail(f"{key} = {value!r} is outside the vocabulary of {n_vocab}")


def string_items(header: GGUFHeader, key: str, indices: set[int]) -> dict[int, str]:
    """Items of a long string array (e.g. token texts of the BOS/EOS ids), read again from the file."""
    summary = header.get(key)
    if isinstance(summary, list):
        return {i: summary[i] for i in indices if 0 <= i < len(summary) and isinstance(summary[i], str)}
    if not isinstance(summary, ArraySummary) or summary.item_type != STRING:
        return {}
    wanted = {i for i in indices if 0 <= i < summary.length}
    found: dict[int, str] = {}
    with header.path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = Cursor(buf, header.file_size, header.path)
        cur.pos = summary.offset
        for index in range(max(wanted, default=-1) + 1):
            if index in wanted:
                found[index] = cur.string(f"{key}[{index}]")
            else:
                cur.strings(1, f"{key}[{index}]", keep=False)
    return found
