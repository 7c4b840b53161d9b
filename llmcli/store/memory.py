"""Will it fit? Memory for a model and its KV cache, checked before a download and before a load."""

from __future__ import annotations

from llmcli.errors import ResourceError
from llmcli.store.gguf_header import GGUFHeader
from llmcli.units import human_size

RUNTIME_OVERHEAD = 120 * 2**20  # Python, llama.cpp's compute buffers for small batches


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (page cache counts: a mapped model lives there), or None."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# Bytes per cached key or value element: llama.cpp's f16, q8_0 (34 bytes a block of 32), q4_0 (18 a block of 32).
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_cache_bytes(header: GGUFHeader, n_ctx: int, slots: int = 1, kv_type: str = "f16") -> int:
    """An upper bound on the KV cache for `n_ctx` tokens (sliding-window layers counted in full)."""
    meta, arch = header.metadata, header.architecture
    layers = meta.get(f"{arch}.block_count") or 0
    heads = meta.get(f"{arch}.attention.head_count") or 1
    heads = max(heads) if isinstance(heads, list) else heads
    kv_heads = meta.get(f"{arch}.attention.head_count_kv") or heads
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else kv_heads
    embedding = meta.get(f"{arch}.embedding_length") or 0
    key_len = meta.get(f"{arch}.attention.key_length") or embedding // max(heads, 1)
    value_len = meta.get(f"{arch}.attention.value_length") or key_len
    return int(int(layers) * int(kv_heads) * (int(key_len) + int(value_len)) * KV_ELEMENT_BYTES[kv_type] * n_ctx * slots)


def mapped_file_bytes(pid: int) -> int:
    """The file pages process `pid` has mapped and resident (RssFile: a loaded model's weights). MemAvailable counts
    them as reclaimable page cache, though the process holds them; 0 if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def check_memory(what: str, weights: int, kv_cache: int = 0, force: bool = False, held: int = 0) -> None:
    """Refuse, with the numbers, when weights + KV cache + overhead exceed the available memory. `held`: bytes that
    MemAvailable counts but other processes keep (warm servers' mapped models)."""
    available = available_memory()
    if available is not None and held:
        available = max(0, available - held)
    needed = weights + kv_cache + RUNTIME_OVERHEAD
    if force or available is None or needed <= available:
        return
    parts = f"model {human_size(weights)}" + (f" + KV cache {human_size(kv_cache)}" if kv_cache else "")
    parts += f" + {human_size(RUNTIME_OVERHEAD)} runtime"
    raise ResourceError(
        f"{what} needs about {human_size(needed)} of memory ({parts}); {human_size(available)} is available"
        + (f" ({human_size(held)} more is held by warm servers)" if held else ""),
        hint="Use a smaller model or quant, a smaller --ctx-size, or --force to try anyway"
        + ("; `llmcli stop` unloads the warm servers." if held else "."),
    )
