"""Images through llama.cpp's multimodal library (mtmd): a projector loaded beside the text model, an image turned
into its prompt tokens, and its embeddings encoded once and evaluated into a sequence.

An image becomes, in a prompt's token list, the text tokens the projector wraps it in (Gemma 3's `<start_of_image>`)
around a run of placeholder ids (llmcli/answer/images.py): the scheduler evaluates text as always and hands each run to
`evaluate`, which encodes the picture (or takes its embeddings from the cache: a second question about the same picture
does not encode it again) and decodes the embeddings at the run's positions.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from llmcli.answer.images import ImageInput, placeholder_ids
from llmcli.errors import IntegrityError, LlmcliError
from llmcli.llama.llama_log import llama_backend

CACHED_IMAGES = 24  # images whose chunk (the preprocessed picture) and embeddings are kept: an LRU (~10 MB each)
_IMAGE_CHUNK = 1  # MTMD_INPUT_CHUNK_TYPE_IMAGE
_NO_CALLBACK = mtmd.mtmd_helper_post_decode_callback()  # a NULL function pointer: no callback after each batch


@dataclass
class _Entry:
    chunk: Any  # mtmd_input_chunk *, owned (a copy)
    ids: list[int]  # its placeholder ids

    @property
    def n_tokens(self) -> int:
        return len(self.ids)
    embeddings: Any = None  # float[n_tokens * n_embd], once encoded


class Vision:
    """A projector for one loaded text model; `tokenize` and `evaluate` images; `encode_s` adds up encoding time."""

    def __init__(self, projector: Path, model: Any, n_threads: int, n_embd: int):
        log = llama_backend()
        log.route_multimodal()
        log.errors.clear()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.warmup = False
        params.n_threads = n_threads
        self._mtmd = mtmd.mtmd_init_from_file(str(projector).encode(), model, params)
        if not self._mtmd:
            raise IntegrityError(f"llama.cpp could not load the projector {projector}: {log.take_error() or 'unknown reason'}",
                                 hint="Check that it is the mmproj file published with this model.")
        if not mtmd.mtmd_support_vision(self._mtmd):
            self.close()
            raise IntegrityError(f"{projector.name} has no image encoder")
        self.path = projector
        self.n_embd = n_embd
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # first placeholder id -> the image
        self.encode_s = 0.0  # seconds spent encoding images (the stats' image_s)
        self.encoded = 0  # images encoded (not taken from the cache)
        # A server's requests tokenize on their own threads while its scheduler evaluates: one at a time in mtmd.
        self._lock = threading.Lock()

    def close(self) -> None:
        for entry in self._entries.values():
            mtmd.mtmd_input_chunk_free(entry.chunk)
        self._entries.clear()
        if getattr(self, "_mtmd", None):
            mtmd.mtmd_free(self._mtmd)
            self._mtmd = None

    def tokenize(self, image: ImageInput) -> list[int]:
        """The prompt tokens of `image`: the projector's own text around it, and its placeholder ids."""
        with self._lock:
            return self._tokenize(image)

    def _tokenize(self, image: ImageInput) -> list[int]:
        rgb = (ctypes.c_ubyte * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, rgb)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            part = mtmd.mtmd_input_part()
            part.bitmap = bitmap
            parts = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
            rc = mtmd.mtmd_tokenize_from_parts(self._mtmd, chunks, parts, 1, False)
            if rc != 0:
                raise LlmcliError(f"llama.cpp could not prepare the image {image.source} (code {rc}): "
                                  f"{llama_backend().take_error() or 'no reason given'}")
            tokens: list[int] = []
            for index in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, index)
                if mtmd.mtmd_input_chunk_get_type(chunk) == _IMAGE_CHUNK:
                    tokens += self._remember(image.key, chunk)
                else:
                    count = ctypes.c_size_t()
                    text = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                    tokens += list(text[: count.value])
            return tokens
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def _remember(self, key: str, chunk: Any) -> list[int]:
        n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        ids = placeholder_ids(key, n_tokens)
        if ids[0] in self._entries:
            self._entries.move_to_end(ids[0])
            return ids
        self._entries[ids[0]] = _Entry(mtmd.mtmd_input_chunk_copy(chunk), ids)
        while len(self._entries) > CACHED_IMAGES:
            _, old = self._entries.popitem(last=False)
            mtmd.mtmd_input_chunk_free(old.chunk)
        return ids

    def forget_embeddings(self) -> None:
        """Encode every image again when it is next evaluated (bench's cold rows)."""
        with self._lock:
            for entry in self._entries.values():
                entry.embeddings = None

    def run(self, token: int) -> list[int]:
        """The placeholder ids of the image whose run begins with `token` (empty: no image known here begins with it)."""
        with self._lock:
            entry = self._entries.get(token)
            return entry.ids if entry is not None else []

    def evaluate(self, ctx: Any, token: int, pos: int, seq: int, n_batch: int) -> int:
        """Encode the image whose run begins with `token` (unless its embeddings are cached) and decode them into
        sequence `seq` from position `pos`; llama.cpp's return code (0: done)."""
        with self._lock:
            return self._evaluate(ctx, token, pos, seq, n_batch)

    def _evaluate(self, ctx: Any, token: int, pos: int, seq: int, n_batch: int) -> int:
        entry = self._entries.get(token)
        if entry is None:
            raise LlmcliError("an image of the prompt is no longer prepared (more images in flight than are kept)")
        self._entries.move_to_end(token)
        if entry.embeddings is None:
            started = time.perf_counter()
            rc = mtmd.mtmd_encode_chunk(self._mtmd, entry.chunk)
            if rc != 0:
                raise LlmcliError(f"llama.cpp could not encode an image (code {rc}): "
                                  f"{llama_backend().take_error() or 'no reason given'}")
            output = mtmd.mtmd_get_output_embd(self._mtmd)
            size = entry.n_tokens * self.n_embd
            entry.embeddings = (ctypes.c_float * size)()
            ctypes.memmove(entry.embeddings, output, size * ctypes.sizeof(ctypes.c_float))
            self.encode_s += time.perf_counter() - started
            self.encoded += 1
        new_pos = llama_cpp.llama_pos(0)
        return int(mtmd.mtmd_helper_decode_image_chunk(self._mtmd, ctx, entry.chunk, entry.embeddings, pos, seq, n_batch,
                                                       ctypes.byref(new_pos), _NO_CALLBACK, None))
