"""`llmcli bench compare`: two result files, test by test: the ratio, whether it is better or worse, and
whether the change is larger than the noise (Welch's t-test at 95 %, with its own degrees of freedom)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Result = dict[str, Any]  # one row of `llmcli bench --format json`'s "results"

# Two-sided 95 % critical values of Student's t for 1..30 degrees of freedom; 1.96 beyond.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
LOWER_IS_BETTER = ("s",)  # units where a smaller number is the better one (TTFT); rates and ratios: higher


@dataclass(frozen=True)
class Comparison:
    key: tuple[str, ...]
    unit: str
    before: float
    after: float
    ratio: float
    significant: bool

    @property
    def verdict(self) -> str:
        """`better`, `worse` (beyond the noise) or `within noise`."""
        if not self.significant:
            return "within noise"
        improved = (self.after < self.before) if self.unit in LOWER_IS_BETTER else (self.after > self.before)
        return "better" if improved else "worse"


def _key(row: Result) -> tuple[str, ...]:
    return (row["model"], str(row["threads"]), row["test"], row["path"])


def welch_significant(a: Result, b: Result) -> bool:
    """Whether the means of two rows differ beyond their noise (two-sided Welch's t-test, 95 %)."""
    n_a, n_b = a["n"], b["n"]
    if n_a < 2 or n_b < 2:
        return False
    var_a, var_b = a["sd"] ** 2 / n_a, b["sd"] ** 2 / n_b
    spread = math.sqrt(var_a + var_b)
    if spread == 0:
        return bool(a["mean"] != b["mean"])
    dof = (var_a + var_b) ** 2 / (var_a**2 / (n_a - 1) + var_b**2 / (n_b - 1)) if var_a or var_b else n_a + n_b - 2
    critical = _T95[max(1, math.floor(dof)) - 1] if dof < len(_T95) + 1 else 1.96
    return bool(abs(b["mean"] - a["mean"]) / spread > critical)


def compare(before: Sequence[Result], after: Sequence[Result]) -> list[Comparison]:
    """Match rows by (model, threads, test, path); ratio after/before, and whether it is beyond the noise."""
    earlier = {_key(r): r for r in before}
    result = []
    for row_b in after:
        row_a = earlier.get(_key(row_b))
        if row_a is None or not row_a["mean"]:
            continue
        ratio = row_b["mean"] / row_a["mean"]
        result.append(Comparison(_key(row_b), row_b["unit"], row_a["mean"], row_b["mean"], ratio,
                                 welch_significant(row_a, row_b)))
    return result
