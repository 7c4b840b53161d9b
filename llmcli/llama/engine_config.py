"""What an engine is loaded with (`EngineConfig`) and the llama.cpp values its settings name: the context's default
size and padding, the KV cache types, pooling and flash attention."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp

from llmcli.config.settings import default


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int | None = None  # per sequence; None: the model's training context, capped at DEFAULT_MAX_CTX
    n_threads: int | None = None  # None: one per physical core, shared with other generating llmcli processes
    n_batch: int = default("batch_size")  # prompt tokens evaluated per llama_decode call
    verbose: bool = False  # llama.cpp's own log lines on stderr
    mmap: bool = default("mmap")  # map the file instead of reading it into memory
    mlock: bool = default("mlock")  # keep the weights in RAM (no swapping)
    n_seq_max: int = 1  # parallel sequences (slots), each with n_ctx tokens of its own
    kv_type: str = default("kv_type")  # f16, q8_0 or q4_0: the type of the cached keys and values
    flash_attn: str = default("flash_attn")  # auto, on or off (on whenever the KV cache is quantized)
    kv_later: bool = False  # a small KV cache now (SIZED_START cells), sized to the work later: `grow_to`, `resize`
    pooling: str | None = None  # embeddings (mean, cls, last) instead of logits; the sequences share n_ctx cells


CELL_PADDING = 256  # llama.cpp rounds a context's cells up to a multiple of this
SIZED_START = 2 * CELL_PADDING  # the cells a cache sized to its work starts with: a short prompt and -n's default room


def padded_cells(n_cells: int) -> int:
    """`n_cells` rounded up as llama.cpp pads a context's cells."""
    return -(-n_cells // CELL_PADDING) * CELL_PADDING

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}
