"""The one list helper every reuse of cached tokens needs: how long a prefix two token lists share."""

from __future__ import annotations

from collections.abc import Sequence


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
