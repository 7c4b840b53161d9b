"""A context's default size, known without llama.cpp (a warm server's client checks that the model fits in memory
before it starts one, without loading llama_cpp)."""

from __future__ import annotations

DEFAULT_MAX_CTX = 4096  # llama-cpp-python's 512 is too small for chat; the training context is often too big


def default_context(n_ctx_train: int | None) -> int:
    """The model's training context, capped at DEFAULT_MAX_CTX."""
    return min(n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
