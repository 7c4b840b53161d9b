"""`llmcli bench compare`: two result files, test by test, with a significance test against the noise."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Result = dict[str, Any]  # one row of `llmcli bench --format json`'s "results"


@dataclass(frozen=True)
class Comparison:
    key: tuple[str, ...]
    unit: str
    before: float
    after: float
    ratio: float
    significant: bool


def _key(row: Result) -> tuple[str, ...]:
    return (row["model"], str(row["threads"]), row["test"], row["path"])


def compare(before: Sequence[Result], after: Sequence[Result]) -> list[Comparison]:
    """Match rows by (model, threads, test, path); ratio after/before; Welch's t > 2 counts as significant."""
    earlier = {_key(r): r for r in before}
    result = []
    for row_b in after:
        row_a = earlier.get(_key(row_b))
        if row_a is None or not row_a["mean"]:
            continue
        spread = math.sqrt(row_a["sd"] ** 2 / max(row_a["n"], 1) + row_b["sd"] ** 2 / max(row_b["n"], 1))
        diff = row_b["mean"] - row_a["mean"]
        significant = spread > 0 and abs(diff) / spread > 2 and row_a["n"] > 1 and row_b["n"] > 1
        ratio = row_b["mean"] / row_a["mean"]
        result.append(Comparison(_key(row_b), row_b["unit"], row_a["mean"], row_b["mean"], ratio, significant))
    return result
