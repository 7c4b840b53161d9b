"""A model's vocabulary: text to tokens, tokens to bytes, special tokens."""

from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path
from typing import Any

import llama_cpp

from llmcli.errors import IntegrityError
from llmcli.llama.llama_log import llama_backend
from llmcli.llama.weights import kept_model
from llmcli.store.gguf_header import read_header

# `<start_of_image>`, `<end_of_image>`, `[multimodal]`, `<image_soft_token>`, `<|vision_start|>`, `<|audio_bos|>`, …
_MODALITY_MARKER = re.compile(rb"[<\[]\|?[A-Za-z_|]*(image|img|audio|video|vision|multimodal)[A-Za-z_|]*\|?[>\]]")


PIECES_KEPT = 1 << 16  # the most pieces a vocabulary keeps (~100 bytes each): the tokens an answer meets, and more


class Vocabulary:
    def __init__(self, vocab: Any):
        self.handle = vocab  # llama_vocab *, owned by the model
        self.n_tokens: int = llama_cpp.llama_vocab_n_tokens(vocab)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # (token << 1 | special) -> its piece: ~0.1 µs where llama.cpp's is ~1.5

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Text to tokens; special tokens written in the text (`<|im_start|>`) are parsed as such."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.handle, data, len(data), buf, capacity, add_special, True)
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (possibly part of a UTF-8 character); control tokens give b'' (with `special`,
        their text: `<|im_start|>`, as `tokenize` shows them)."""
        key = token << 1 | special
        found = self._pieces.get(key)
        if found is not None:
            return found
        n = llama_cpp.llama_token_to_piece(self.handle, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.handle, token, self._piece_buf, -n, 0, special)
        found = ctypes.string_at(self._piece_buf, n)
        if len(self._pieces) < PIECES_KEPT:
            self._pieces[key] = found
        return found

    def detokenize(self, tokens: list[int], special: bool = True) -> str:
        """Tokens to text (llama.cpp's own detokenizer: a leading space the tokenizer added is removed), control
        tokens written as their text with `special`; safe from any thread (a buffer of its own)."""
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        capacity = 16 * len(tokens) + 16
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_detokenize(self.handle, array, len(tokens), buf, capacity, False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            capacity = -n

    def answer_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token adds to an answer: control tokens and the markers of images, audio or video (which a
        text answer never holds: Gemma 3's `<start_of_image>` is a "user-defined" token, shown by llama.cpp) give
        b''; with `special` (--special) the text of both."""
        piece = self.piece(token, special)
        if not special and piece[:1] in (b"<", b"[") and _MODALITY_MARKER.fullmatch(piece):
            return b""
        return piece

    def is_control(self, token: int) -> bool:
        """A control token (`<|im_end|>`, `<bos>`): its text is not text the model writes."""
        return bool(llama_cpp.llama_vocab_is_control(self.handle, token))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.handle, token))

    def end_of_generation_tokens(self) -> tuple[int, ...]:
        return tuple(t for t in range(self.n_tokens) if llama_cpp.llama_vocab_is_eog(self.handle, t))

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return (llama_cpp.llama_vocab_get_text(self.handle, token) or b"").decode("utf-8", "replace")

    def special_tokens(self) -> dict[str, Any]:
        """The text of the BOS and EOS tokens (None: the model has none), and whether a prompt starts with the BOS."""
        bos, eos = llama_cpp.llama_vocab_bos(self.handle), llama_cpp.llama_vocab_eos(self.handle)
        return {"bos_token": self.token_text(bos) if bos >= 0 else None,
                "eos_token": self.token_text(eos) if eos >= 0 else None,
                "add_bos_token": bool(llama_cpp.llama_vocab_get_add_bos(self.handle))}

    @property
    def bos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_bos(self.handle))

    @property
    def eos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_eos(self.handle))


class VocabularyFile:
    """Only the vocabulary of a GGUF file (llama.cpp's `vocab_only`): no weights are read, so a large model's
    tokenizer is ready in milliseconds. For counting and showing tokens."""

    def __init__(self, path: Path):
        read_header(path)  # pre-flight: llama.cpp never sees a malformed file
        self._vision: Any = None
        self._owned = True
        if (kept := kept_model(path)) is not None:  # (weights this process keeps loaded hold the same vocabulary)
            self._model, self._owned, self.load_s = kept, False, 0.0
            self.vocab = Vocabulary(llama_cpp.llama_model_get_vocab(kept))
            return
        log = llama_backend()
        log.errors.clear()
        started = time.perf_counter()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise IntegrityError(f"llama.cpp could not read the vocabulary of {path}: {log.take_error() or 'unknown reason'}",
                                 hint="Check that the file is a complete GGUF model supported by this llama.cpp build.")
        self.vocab = Vocabulary(llama_cpp.llama_model_get_vocab(self._model))
        self.load_s = time.perf_counter() - started

    def vision(self, projector: Path) -> Any:
        """The vision projector at `projector` over this vocabulary (a `Vision`: its image tokens counted without the
        model's weights), loaded once."""
        from llmcli.llama.vision import Vision

        if self._vision is None:
            self._vision = Vision(projector, self._model, 1, llama_cpp.llama_model_n_embd(self._model))
        return self._vision

    def close(self) -> None:
        if getattr(self, "_vision", None) is not None:
            self._vision.close()
            self._vision = None
        if getattr(self, "_model", None):
            if getattr(self, "_owned", True):
                llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> VocabularyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
