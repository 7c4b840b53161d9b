"""Sizes and counts as a person reads them: 1.2 GiB, 135M."""

from __future__ import annotations


def human_size(n_bytes: float) -> str:
    """`512 B`, `1.5 KiB`, `94.0 MiB`, `2.3 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return f"{n_bytes:.1f} GiB"


def human_count(n: int | None) -> str:
    """Parameter counts: `135M`, `1.10B`."""
    if not n:
        return ""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 reply`, `2 replies`, `0 exchanges`: a count with its noun in the right number."""
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{n} {plural}"
