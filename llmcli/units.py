"""Sizes, counts and durations as a person reads and writes them: 1.2 GiB, 135M, 5m."""

from __future__ import annotations

import re
from typing import Any


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


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds a model stays loaded after its last request: a number of seconds, "10s", "5m", "1h", 0 (unload at
    once) or a negative value (never); None: forever. ValueError if it is none of these."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value < 0 else float(value)
    found = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if found is None:
        raise ValueError(f"keep_alive {value!r}: a duration such as 30s, 5m, 1h, 0 or -1")
    number = float(found.group(1))
    return None if number < 0 else number * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[found.group(2)]


DEFAULT_KEEP_ALIVE = "5m"  # run, chat, --batch and embed: how long a model stays loaded after an answer (as Ollama)


def is_duration(value: Any) -> bool:
    """A keep-alive as parse_keep_alive reads it: a duration, 0 or a negative number."""
    try:
        parse_keep_alive(value)
    except ValueError:
        return False
    return True


def keeps_loaded(value: Any) -> bool:
    """A keep-alive that keeps the model loaded (in a warm server): given, and not 0."""
    return value is not None and is_duration(value) and parse_keep_alive(value) != 0


def parse_size(text: str) -> int:
    """`8G`, `512MiB`, `1.5 GB`, `2000000` (bytes) -> bytes (binary multiples: K, M, G, T are 1024-based)."""
    import re

    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if found is None:
        raise ValueError(f"not a size: {text!r} (e.g. 8G, 512M)")
    return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2).upper() or " "))
