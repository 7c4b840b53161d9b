"""`llmcli bench --plot FILE.svg|.png`: the rows a benchmark produced, as pictures (matplotlib, the `plot` extra).

One panel per sweep the rows hold — rate against threads, KV depth, batch size, sequences at once, the cost of an
n-token pass; TTFT cold against warm; decoding with and without drafts; KV types — and, for `--tune`, each setting's
candidates with the one chosen. The machine and the models are in the title. The file is written whole or not at all.
Only the CLI's --plot imports this module (a contract says so), so matplotlib is loaded only then.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from llmcli.bench.rows import Row

FORMATS = (".svg", ".png")
Panel = Callable[[Axes], None]


def plot_rows(rows: Sequence[Row], environment: dict[str, Any], path: Path) -> int:
    """Draw the panels `rows` allow into `path`; how many."""
    return _save(_panels(rows), _title(environment, sorted({r.model for r in rows})), path)


def plot_tune(model: str, dimensions: Sequence[Any], environment: dict[str, Any], path: Path) -> int:
    """`bench --tune`'s search: per setting, each candidate's job time (mean ± sd), the chosen one filled."""
    panels = [_tune_panel(dimension) for dimension in dimensions if any(c.job_s for c in dimension.candidates)]
    return _save(panels, _title(environment, [model]) + " · bench --tune", path)


def plot_advice(advice: dict[str, Any], path: Path) -> int:
    """`quant advise --plot`: each measured candidate's mean KL divergence against its decode rate (the front joined,
    the pick ringed)."""
    rows = [r for r in advice["candidates"] if "decode_tokens_per_s" in r]

    def panel(axes: Axes) -> None:
        for row in rows:
            axes.scatter(row["decode_tokens_per_s"], row["kld_mean"], s=36,
                         color="tab:blue" if row["pareto"] else "tab:gray", zorder=3)
            axes.annotate(row["name"], (row["decode_tokens_per_s"], row["kld_mean"]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")
        front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["decode_tokens_per_s"])
        axes.plot([r["decode_tokens_per_s"] for r in front], [r["kld_mean"] for r in front], color="tab:blue",
                  alpha=0.5, label="the front")
        picked = [r for r in rows if r["name"] == advice.get("pick")]
        if picked:
            axes.scatter([picked[0]["decode_tokens_per_s"]], [picked[0]["kld_mean"]], s=160, facecolors="none",
                         edgecolors="tab:red", label=f"pick: {picked[0]['name']}", zorder=4)
        axes.set_xlabel("decode tok/s")
        axes.set_ylabel(f"mean KL divergence from {advice['reference']}")
        axes.set_title(f"{advice['model']}: quality against speed")
        axes.legend(fontsize=8)

    return _save([panel], _title(advice["machine"], [advice["model"]]) + " · quant advise", path)


def _title(environment: dict[str, Any], models: Sequence[str]) -> str:
    if environment.get("endpoint"):
        return f"{', '.join(models)} · {environment['endpoint']}"
    return (f"{', '.join(models)} · {environment.get('cpu') or 'CPU'} · {environment.get('physical_cores')} cores · "
            f"llama-cpp-python {environment.get('llama_cpp_python')}")


def _save(panels: list[Panel], title: str, path: Path) -> int:
    columns = 1 if len(panels) == 1 else 2
    lines = max(1, -(-len(panels) // columns))
    figure = Figure(figsize=(6.4 * columns, 4.2 * lines + 0.6), layout="constrained")
    figure.suptitle(title, fontsize=10)
    grid = figure.subplots(lines, columns, squeeze=False)
    for axes, panel in zip(grid.flat, panels, strict=False):
        panel(axes)
        axes.grid(True, alpha=0.3)
    for axes in list(grid.flat)[len(panels):]:
        axes.set_visible(False)
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(handle)
    try:
        metadata = {"Date": None} if path.suffix == ".svg" else {}  # the same rows draw the same file
        with rc_context({"svg.fonttype": "none"}):  # SVG text as text: searchable, and a tenth of the size
            figure.savefig(temporary, format=path.suffix[1:], metadata=metadata, dpi=120)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # (mkstemp's file is private; a picture is not)
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return len(panels)


# -- which panels the rows allow ----------------------------------------------------------------------------


def _panels(rows: Sequence[Row]) -> list[Panel]:
    models = sorted({r.model for r in rows})
    threads = sorted({r.threads for r in rows if r.threads is not None})
    panels: list[Panel] = []
    plain = [r for r in rows if r.path in ("raw", "llmcli") and r.unit == "t/s" and re.match(r"(pp|tg)\d+$", r.test)]
    if len(threads) > 1:
        panels.append(_lines("Rate against threads", "threads", "tokens/s",
                             _series(plain, lambda r: r.threads, lambda r: f"{r.test} {r.path}", models)))
    depth = [r for r in rows if r.path == "raw" and r.unit == "t/s" and re.match(r"(pp|tg)\d+( @ d\d+)?$", r.test)]
    if len({_depth(r.test) for r in depth}) > 1:
        panels.append(_lines("Rate against KV depth", "depth (tokens already in the cache)", "tokens/s",
                             _series(depth, lambda r: _depth(r.test), lambda r: f"{r.test.split()[0]} t{r.threads}",
                                     models)))
    batch = [r for r in rows if r.path == "raw, batch size"]
    if batch:
        panels.append(_lines("Prefill rate against batch size", "batch size (tokens per step)", "tokens/s",
                             _series(batch, lambda r: _number(r.test, r" b(\d+)"), lambda r: f"t{r.threads}", models)))
    parallel = [r for r in rows if r.path in ("parallel", "endpoint, aggregate")]
    if parallel:
        panels.append(_lines("Aggregate decode against sequences at once", "sequences", "tokens/s (all together)",
                             _series(parallel, lambda r: _number(r.test, r" x(\d+)"), lambda r: f"t{r.threads}", models)))
    passes = [r for r in rows if r.path == "speculative" and r.test.startswith("pass of")]
    if passes:
        panels.append(_lines("Cost of an n-token pass (speculative verification)", "tokens in one pass",
                             "× a 1-token pass", _series(passes, lambda r: _number(r.test, r"pass of (\d+)"),
                                                         lambda r: f"t{r.threads}", models), diagonal=True))
    cache = [r for r in rows if r.path == "prompt cache" and r.test.startswith("ttft ")]
    if cache:
        panels.append(_bars("TTFT cold against warm (prompt cache)", "seconds",
                            _groups(cache, lambda r: r.test.split()[2], lambda r: r.test.split()[1], models)))
    drafted = [r for r in rows if r.path.startswith("speculate ") and r.unit == "t/s"]
    if drafted:
        panels.append(_bars("Decoding with and without drafts", "tokens/s",
                            _groups(drafted, lambda r: r.test.split()[1], lambda r: r.path.removeprefix("speculate "),
                                    models)))
    kv = [r for r in rows if " kv " in r.test and r.unit == "t/s"]
    if kv:
        panels.append(_bars("KV cache types", "tokens/s", _groups(kv, lambda r: r.test.split(" kv ")[0],
                                                                  lambda r: "kv " + r.test.split(" kv ")[1], models)))
    if not panels:  # one thread count, nothing swept: the tests themselves
        tests = [r for r in rows if r.unit == "t/s"]
        panels.append(_bars("Prefill and decode", "tokens/s", _groups(tests, lambda r: r.test, lambda r: r.path,
                                                                      models)))
    return panels


def _depth(test: str) -> int:
    return _number(test, r"@ d(\d+)") if "@ d" in test else 0


def _number(text: str, pattern: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


def _series(rows: Sequence[Row], x: Callable[[Row], Any], label: Callable[[Row], str],
            models: Sequence[str]) -> dict[str, list[tuple[Any, float, float]]]:
    """label -> [(x, mean, sd)], sorted by x; the model in the label when there are several."""
    series: dict[str, list[tuple[Any, float, float]]] = defaultdict(list)
    for r in rows:
        name = label(r) if len(models) == 1 else f"{r.model} {label(r)}"
        series[name].append((x(r), r.mean, r.sd))
    return {name: sorted(points) for name, points in series.items()}


def _groups(rows: Sequence[Row], group: Callable[[Row], str], member: Callable[[Row], str],
            models: Sequence[str]) -> dict[str, dict[str, tuple[float, float]]]:
    """member -> {group: (mean, sd)}, groups in the order the rows first name them."""
    bars: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for r in rows:
        name = member(r) if len(models) == 1 else f"{r.model} {member(r)}"
        bars[name][group(r) + ("" if r.threads is None else f" t{r.threads}")] = (r.mean, r.sd)
    return bars


def _lines(title: str, x_label: str, y_label: str, series: dict[str, list[tuple[Any, float, float]]],
           diagonal: bool = False) -> Panel:
    def draw(axes: Axes) -> None:
        for name, points in series.items():
            xs, means, sds = zip(*points, strict=True)
            axes.errorbar(xs, means, yerr=sds, marker="o", capsize=3, label=name)
        xs_all = sorted({x for points in series.values() for x, _, _ in points})
        if diagonal:  # a pass of n costing n one-token passes: no gain from drafting at all
            axes.plot([1, xs_all[-1]], [1, xs_all[-1]], linestyle=":", color="grey", label="n × one pass")
        if len(xs_all) <= 8:
            axes.set_xticks(xs_all, [str(x) for x in xs_all])  # threads, batch sizes: the values measured
        else:
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set(title=title, xlabel=x_label, ylabel=y_label)
        axes.set_ylim(bottom=0)
        if series:
            axes.legend(fontsize=8)

    return draw


def _bars(title: str, y_label: str, bars: dict[str, dict[str, tuple[float, float]]]) -> Panel:
    def draw(axes: Axes) -> None:
        groups = list(dict.fromkeys(g for members in bars.values() for g in members))
        width = 0.8 / max(1, len(bars))
        for i, (name, values) in enumerate(bars.items()):
            xs = [groups.index(g) + i * width for g in values]
            axes.bar(xs, [m for m, _ in values.values()], width, yerr=[s for _, s in values.values()], capsize=3,
                     label=name)
        axes.set_xticks([g + width * (len(bars) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
        axes.set(title=title, ylabel=y_label)
        if bars:
            axes.legend(fontsize=8)

    return draw


def _tune_panel(dimension: Any) -> Panel:
    def draw(axes: Axes) -> None:
        measured = [c for c in dimension.candidates if c.job_s]
        names = [str(c.value) for c in measured]
        summaries = [c.summary() for c in measured]
        colours = ["tab:green" if c.value == dimension.winner else "tab:grey" for c in measured]
        axes.bar(names, [s["mean"] * 1000 for s in summaries], yerr=[s["sd"] * 1000 for s in summaries], capsize=3,
                 color=colours)
        axes.set(title=f"{dimension.setting}: {dimension.verdict}", ylabel="job time (ms), lower is better")
        axes.title.set_fontsize(9)

    return draw
