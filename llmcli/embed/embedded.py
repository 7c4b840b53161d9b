"""One text's embedding result, as the local embedder and the warm server's client both give it (no llama.cpp here:
the warm client imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Embedded:
    """One text's result: its vector, or why it has none."""

    vector: list[float] | None
    tokens: int
    error: str | None = None
    too_long: bool = False  # the error is that it does not fit (a resource, not bad input)
