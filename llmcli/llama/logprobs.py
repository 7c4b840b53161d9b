"""Token logprobs from llama.cpp's logits: the model's own distribution at one position (before any sampler —
temperature, top-k, a grammar — changed it), as OpenAI, llama-server and Ollama report it."""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import TokenLogprob
from llmcli.llama.vocab import Vocabulary


def token_logprob(ctx: Any, vocab: Vocabulary, index: int, token: int, n_top: int) -> TokenLogprob:
    """`token`'s logprob at batch `index` of the last decode (-1: its last logits), and the `n_top` most likely."""
    pointer = llama_cpp.llama_get_logits_ith(ctx, index)
    logits = np.ctypeslib.as_array(pointer, shape=(vocab.n_tokens,))
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum()))
    top: tuple[tuple[int, bytes, float], ...] = ()
    if n_top > 0:
        best = np.argpartition(-logits, n_top - 1)[:n_top]
        best = best[np.argsort(-logits[best], kind="stable")]
        top = tuple((int(t), vocab.piece(int(t)), float(logits[t]) - log_total) for t in best)
    return TokenLogprob(token, vocab.piece(token), float(logits[token]) - log_total, top)
