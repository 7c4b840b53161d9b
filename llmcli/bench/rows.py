"""One result row of `llmcli bench`: a test on one model at one thread count, with its samples; the rows as bench
prints them (Markdown, CSV, JSON)."""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llmcli.units import human_count, human_size


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


def shown(row: Row) -> str:
    """A row's result as the Markdown table shows it."""
    if row.unit == "x":
        return f"{row.mean:.3f}×"
    if row.unit == "s":
        return f"{row.mean * 1000:.1f} ± {row.sd * 1000:.1f} ms"
    if row.unit == "%":
        return f"{row.mean:.0f} %"
    if row.unit.startswith("%"):
        return f"{row.mean:.1f} {row.unit}"
    if row.unit == "µs":
        return f"{row.mean:.1f} ± {row.sd:.1f} µs"
    if row.unit in ("GB/s", "MiB", "KiB/token"):
        return f"{row.mean:.1f} {row.unit}"
    return f"{row.mean:.2f} ± {row.sd:.2f}"


def format_rows(rows: Sequence[Row], environment: dict[str, Any], plan: Any, fmt: str) -> str:
    """The rows as `llmcli bench` prints them: `json` (environment, plan, results), `csv` (a row each, with the
    environment's columns) or `md` (a Markdown table and the machine it ran on)."""

    if fmt == "json":
        whole = {"environment": environment, "plan": asdict(plan), "results": [r.to_dict() for r in rows]}
        return json.dumps(whole, indent=2) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        fields = ["model", "size_bytes", "params", "quant", "threads", "test", "path", "unit", "mean", "sd", "n",
                  "cpu", "physical_cores", "llama_cpp_python", "model_sha256"]
        writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        sha = {m["name"]: m["sha256"] for m in environment["models"]}
        for r in rows:
            record = {k: v for k, v in r.to_dict().items() if k in fields}
            record.update(cpu=environment["cpu"], physical_cores=environment["physical_cores"],
                          llama_cpp_python=environment["llama_cpp_python"], model_sha256=sha.get(r.model, ""))
            writer.writerow(record)
        return buffer.getvalue()
    lines = [
        "| model | size | params | quant | threads | test | path | t/s |",
        "| --- | ---: | ---: | --- | ---: | --- | --- | ---: |",
    ]
    unknown = "?"  # a server's model: its size, parameters, quant and threads are not known from here
    for r in rows:
        lines.append(f"| {r.model} | {unknown if r.size_bytes is None else human_size(r.size_bytes)} "
                     f"| {unknown if r.params is None else human_count(r.params)} | {r.quant or unknown} "
                     f"| {unknown if r.threads is None else r.threads} | {r.test} | {r.path} | {shown(r)} |")
    lines.append("")
    if environment.get("endpoint"):
        lines.append(f"measured from here against {environment['endpoint']} (TTFT and rates include the network; "
                     "the server's hardware and model file are not known here)")
    else:
        lines.append(f"{environment['cpu']} · {environment['physical_cores']} cores · "
                     f"llama-cpp-python {environment['llama_cpp_python']}")
    return "\n".join(lines) + "\n"
