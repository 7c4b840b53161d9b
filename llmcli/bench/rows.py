"""One result row of `llmcli bench`: a test on one model at one thread count, with its samples."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    model: str
    size_bytes: int | None  # None: not known here (a server's model)
    params: int | None
    quant: str
    threads: int | None
    test: str  # pp512, tg128, pp512 @ d512, ttft, overhead tg128, roofline tg128, ...
    path: str  # raw | llmcli | ratio | roofline
    unit: str  # t/s, s, x, %
    samples: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def sd(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "mean": self.mean, "sd": self.sd, "n": len(self.samples)}
