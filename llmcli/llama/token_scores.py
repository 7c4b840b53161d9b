"""What a model thinks of a text, position by position: log-probabilities over the whole vocabulary.

`eval quality` scores a text as llama.cpp's `llama-perplexity` does: the text's tokens in chunks of the context's
length, each chunk evaluated alone in an empty KV cache (its first token the BOS where the model adds one), and the
positions of its second half scored, so that every scored token has at least half a context before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from llmcli.llama.batch import Batch
from llmcli.llama.engine import Engine
from llmcli.llama.vocab import Vocabulary


@dataclass(frozen=True)
class TextTokens:
    tokens: list[int]  # the whole text's, as llama-perplexity tokenizes it (with the BOS the model adds)
    bos: int | None  # the token each chunk starts with, where the model adds one


def text_tokens(vocab: Vocabulary, text: str) -> TextTokens:
    """A model's vocabulary (an engine's, or a vocabulary-only load's) reads the text."""
    adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab.handle))
    return TextTokens(vocab.tokenize(text, add_special=True),
                      int(llama_cpp.llama_vocab_bos(vocab.handle)) if adds_bos else None)


def chunk_log_probs(engine: Engine, tokens: Sequence[int], first: int, bos: int | None) -> np.ndarray | None:
    """The log-softmax of the logits at positions first … len(tokens) - 2 of one chunk evaluated alone (each row
    predicts the token after it), float32 [rows, n_vocab]; None when Ctrl-C stopped the pass."""
    engine.kv.clear()
    n = len(tokens)
    with Batch(n) as batch:
        for i, token in enumerate(tokens):
            batch.add(bos if i == 0 and bos is not None else token, i, 0, first <= i < n - 1)
        if engine.decode(batch, "scoring a chunk of the text", abortable=True) != "ok":
            return None
    n_vocab = engine.vocab.n_tokens
    rows = n - 1 - first
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(engine.llama_context), shape=(rows, n_vocab))
    return log_softmax(logits)


ROWS_AT_ONCE = 32  # rows exponentiated together (a 262k vocabulary: 64 MiB of float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax with float64 sums, kept as float32 (a copy: llama.cpp's buffer is reused)."""
    out = np.array(logits, dtype=np.float32)
    out -= out.max(axis=1, keepdims=True)
    for start in range(0, len(out), ROWS_AT_ONCE):
        block = out[start : start + ROWS_AT_ONCE]
        block -= np.log(np.exp(block, dtype=np.float64).sum(axis=1, keepdims=True)).astype(np.float32)
    return out
