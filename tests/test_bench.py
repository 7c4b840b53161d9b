"""`llmcli bench` output shapes on the real model (tiny settings: shapes, not speed)."""

from __future__ import annotations

import csv
import fcntl
import io
import json

import pytest
from conftest import run_cli, svg_panels
from PIL import Image

# The tests' one real smoke run (shapes, not speed): each thread count, depth and number of sequences at once.
SWEEP = ("-p", "16", "-n", "8", "-r", "1", "-t", "1,2", "--depth", "0,16", "--parallel", "1,2")


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory, worker_id) -> dict:
    """The smoke run's record, once a session: with two workers, the first to need it runs it and the other waits for
    its record (both running it at once spun their 2-thread rows against each other: 13 s became 88 s each)."""
    if worker_id == "master":  # (one process: its own base dir; the parent is shared by every session)
        shared = tmp_path_factory.getbasetemp() / "bench-smoke.json"
    else:
        shared = tmp_path_factory.getbasetemp().parent / "bench-smoke.json"
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.exists():
            result = run_cli("bench", *SWEEP, "--format", "json")
            assert result.code == 0, result.stderr
            shared.write_text(result.stdout)
    return json.loads(shared.read_text())


def test_json_has_environment_plan_and_every_test_at_each_thread_count_depth_and_number_of_sequences(bench_json):
    env = bench_json["environment"]
    for key in ("cpu", "physical_cores", "llama_cpp_python", "llama_cpp_system_info", "weight_buffers", "threads",
                "models"):
        assert key in env
    assert len(env["models"][0]["sha256"]) == 64 and env["threads"] == [1, 2]
    assert bench_json["plan"]["repetitions"] == 1 and bench_json["plan"]["depths"] == [0, 16]
    rows = {(r["test"], r["path"], r["threads"]): r for r in bench_json["results"]}
    for threads in (1, 2):
        for test, path in [("pp16", "raw"), ("tg8", "raw"), ("tg8", "raw, same prompt"), ("tg8", "llmcli"),
                           ("ttft", "llmcli"), ("overhead tg8", "ratio"), ("memory bandwidth", "roofline"),
                           ("roofline tg8", "roofline"), ("pp16 @ d16", "raw"), ("tg8 @ d16", "raw"),
                           ("tg8 x1", "parallel"), ("tg8 x2", "parallel")]:
            assert (test, path, threads) in rows, (test, path, threads)
        assert any(test.startswith("overhead pp") for test, _, at in rows if at == threads)
    for row in bench_json["results"]:
        assert row["mean"] > 0 and row["n"] == len(row["samples"]) and row["quant"] == "Q4_0"
        assert set(row) >= {"model", "size_bytes", "params", "quant", "threads", "unit", "sd"}
    assert rows[("tg8", "llmcli", 1)]["n"] == 1 and rows[("tg8", "llmcli", 1)]["unit"] == "t/s"


def _rows(record: dict) -> list:
    """A bench record's rows, as bench holds them (the smoke run's: real figures, shapes not speed)."""
    from llmcli.bench.rows import Row

    fields = ("model", "size_bytes", "params", "quant", "threads", "test", "path", "unit", "samples")
    return [Row(**{name: row[name] for name in fields}) for row in record["results"]]


def test_markdown_and_csv_show_every_row_with_the_machine(bench_json):
    from llmcli.bench.plan import BenchPlan
    from llmcli.bench.rows import format_rows

    rows, environment = _rows(bench_json), bench_json["environment"]
    lines = format_rows(rows, environment, BenchPlan(), "md").splitlines()
    assert lines[0] == "| model | size | params | quant | threads | test | path | t/s |"
    table = [line.split(" | ") for line in lines[2:] if line.startswith("| ")]
    assert len(table) == len(rows) and {row[5] for row in table} == {row.test for row in rows}
    assert lines[-1].startswith(environment["cpu"]) and "cores · llama-cpp-python" in lines[-1]
    records = list(csv.DictReader(io.StringIO(format_rows(rows, environment, BenchPlan(), "csv"))))
    assert list(records[0])[:11] == ["model", "size_bytes", "params", "quant", "threads", "test", "path", "unit", "mean",
                                     "sd", "n"]
    assert len(records) == len(rows) and records[0]["cpu"] and len(records[0]["model_sha256"]) == 64
    again = json.loads(format_rows(rows, environment, BenchPlan(repetitions=2), "json"))
    assert [r["mean"] for r in again["results"]] == [r["mean"] for r in bench_json["results"]]


def test_a_sweep_draws_a_panel_per_dimension(tmp_path):
    from llmcli.bench.plot import plot_rows
    from llmcli.bench.rows import Row

    def row(test: str, threads: int, *samples: float, path: str = "raw") -> Row:
        return Row("smollm2", 94_000_000, 135_000_000, "Q4_1", threads, test, path, "t/s", list(samples))

    rows = [row(test, threads, rate * threads, rate * threads * 1.02)
            for threads in (1, 2) for test, rate in (("pp16", 300.0), ("tg8", 80.0), ("pp16 @ d16", 280.0),
                                                   ("tg8 @ d16", 75.0))]
    rows += [row("tg8 x1", 2, 150.0, path="parallel"), row("tg8 x2", 2, 260.0, path="parallel")]
    picture = tmp_path / "sweep.svg"
    environment = {"cpu": "a CPU", "physical_cores": 2, "llama_cpp_python": "0.3.36", "models": []}
    assert plot_rows(rows, environment, picture) == 3
    panels, text = svg_panels(picture)  # threads, depth, sequences at once
    assert panels == 3 and "smollm2" in text and "cores" in text and "Rate against threads" in text
    assert "sequences" in text


def test_prompt_cache_and_kv_type_rows(tmp_path):
    picture = tmp_path / "cache.png"
    result = run_cli("bench", "-p", "32", "-n", "8", "-r", "1", "--prompt-cache", "160", "--kv-type", "f16,q8_0",
                     "-b", "16,32", "--format", "json", "--plot", str(picture))
    assert result.code == 0, result.stderr
    with Image.open(picture) as image:  # a PNG that decodes: batch sizes, cold vs warm TTFT, KV types
        assert image.format == "PNG" and image.width > 600 and image.height > 300
        image.verify()
    assert "(3 panels)" in result.stderr and oct(picture.stat().st_mode & 0o077) != "0o0"
    rows = {(r["test"], r["path"]): r for r in json.loads(result.stdout)["results"]}
    cold, warm = rows[("ttft cold p160", "prompt cache")], rows[("ttft warm p160", "prompt cache")]
    assert cold["unit"] == warm["unit"] == "s" and cold["mean"] > 0 and warm["mean"] > 0
    assert rows[("state save p160", "prompt cache")]["mean"] > 0 and rows[("state restore p160", "prompt cache")]["mean"] > 0
    per_token = rows[("state size p160", "prompt cache")]["mean"]
    assert 15 < per_token < 40  # SmolLM2: 30 layers x 3 KV heads x 64 x 2 (K and V) x 2 bytes = 22.5 KiB a token
    f16 = next(r for (test, _), r in rows.items() if test.startswith("kv cache") and test.endswith("kv f16"))
    q8 = next(r for (test, _), r in rows.items() if test.startswith("kv cache") and test.endswith("kv q8_0"))
    assert q8["mean"] == pytest.approx(f16["mean"] * 34 / 64) and f16["unit"] == "MiB"
    assert ("tg8 @ d32 kv q8_0", "raw") in rows and ("pp32 kv q8_0", "raw") in rows
    assert rows[("pp32 b16", "raw, batch size")]["mean"] > 0 and ("pp32 b32", "raw, batch size") in rows
    assert run_cli("bench", "--kv-type", "f32").code == 2


def test_speculation_rows(tmp_path):
    picture = tmp_path / "drafts.svg"
    result = run_cli("bench", "-p", "16", "-n", "16", "-r", "1", "--speculate", "--format", "json", "--plot",
                     str(picture))
    assert result.code == 0, result.stderr
    panels, text = svg_panels(picture)  # the cost of an n-token pass; decoding with and without drafts
    assert panels == 2 and "n-token pass" in text and "with and without drafts" in text
    rows = {(r["test"], r["path"]): r for r in json.loads(result.stdout)["results"]}
    for n in (2, 4, 8, 12, 16):  # shapes, not speed: the ratios themselves go to the closing notes
        cost = rows[(f"pass of {n} @ d256", "speculative")]
        assert cost["unit"] == "x" and cost["mean"] > 0 and cost["n"] == 1
    for mode in ("lookup", "auto"):
        assert rows[("tg16 grounded", f"speculate {mode}")]["mean"] > 0
        assert rows[("speed-up grounded", f"speculate {mode} / off")]["unit"] == "x"
    assert ("acceptance ungrounded", "speculate auto") in rows and ("tg16 ungrounded", "speculate off") in rows


def test_sampling_rows_time_choosing_a_token_plainly_with_logprobs_and_traced_for_each_chain():
    """`bench --sampling`: each chain's token chosen plainly, with --logprobs 5 and traced, a model pass between
    tokens; a row each in µs and trace / logprobs (shapes, not speed: the figures go to the closing notes)."""
    from llmcli.bench.sampling import CHAINS, MODES

    result = run_cli("bench", "-p", "16", "-n", "4", "-r", "1", "--sampling", "--format", "json")
    assert result.code == 0, result.stderr
    rows = {(r["test"], r["path"]): r for r in json.loads(result.stdout)["results"]}
    assert len(CHAINS) == 5 and MODES == ("plain", "logprobs 5", "trace 5")
    for name, _ in CHAINS:
        for mode in MODES:
            assert rows[(f"sample {name}", mode)]["unit"] == "µs" and rows[(f"sample {name}", mode)]["mean"] > 0
        ratio = rows[(f"sample {name}", "trace / logprobs")]
        assert ratio["mean"] == pytest.approx(rows[(f"sample {name}", "trace 5")]["mean"]
                                              / rows[(f"sample {name}", "logprobs 5")]["mean"])
    from llmcli.bench.rows import Row, shown

    assert shown(Row("m", 1, 1, "Q4_0", 2, "sample default", "trace 5", "µs", [250.0, 270.0])) == "260.0 ± 14.1 µs"


def test_compare_reports_ratio_and_significance(tmp_path, bench_json):
    before = tmp_path / "a.json"
    after = tmp_path / "b.json"
    steady = json.loads(json.dumps(bench_json))
    for row in steady["results"]:  # a smoke run's one sample: fix the noise at 1 % over 3 (the statistics have their own test)
        row["sd"], row["n"] = row["mean"] * 0.01, 3
    before.write_text(json.dumps(steady))
    slower = json.loads(json.dumps(steady))
    for row in slower["results"]:
        row["mean"] /= 2
        row["sd"] /= 2
        row["samples"] = [s / 2 for s in row["samples"]]
    after.write_text(json.dumps(slower))
    result = run_cli("bench", "compare", str(before), str(after))
    assert result.code == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "| tg8 | llmcli |" in line]
    assert lines and "| 0.500 | worse |" in lines[0]  # a rate that halved
    same = run_cli("bench", "compare", str(before), str(before))
    assert "within noise" in same.stdout and "better" not in same.stdout and "worse" not in same.stdout


@pytest.mark.parametrize("before, after, verdict", [
    ({"mean": 100.0, "sd": 1.0, "n": 2}, {"mean": 102.0, "sd": 1.0, "n": 2}, "within noise"),  # 2 % at -r 2: noise
    ({"mean": 100.0, "sd": 1.0, "n": 10}, {"mean": 103.0, "sd": 1.0, "n": 10}, "better"),
    ({"mean": 100.0, "sd": 1.0, "n": 10}, {"mean": 97.0, "sd": 1.0, "n": 10}, "worse"),
])
def test_compare_needs_the_t_distribution_and_says_which_way(before, after, verdict):
    from llmcli.bench.compare import compare

    row = {"model": "m", "threads": 2, "test": "tg128", "path": "llmcli", "unit": "t/s"}
    assert compare([{**row, **before}], [{**row, **after}])[0].verdict == verdict
    ttft = {**row, "test": "ttft", "unit": "s"}  # for a time, lower is better
    if verdict != "within noise":
        assert compare([{**ttft, **before}], [{**ttft, **after}])[0].verdict == {"better": "worse", "worse": "better"}[verdict]


def test_bad_bench_arguments_are_usage_errors(tmp_path):
    assert run_cli("bench", "-t", "one").code == 2
    for picture, says in ((tmp_path / "x.pdf", "an .svg or a .png"), (tmp_path / "no" / "x.svg", "no folder")):
        refused = run_cli("bench", "--plot", str(picture))  # at once, before anything is measured
        assert refused.code == 2 and says in refused.stderr and not picture.exists()
    assert run_cli("bench", "--format", "xml").code == 2
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    result = run_cli("bench", "compare", str(bad), str(bad))
    assert result.code == 2 and result.stderr.startswith("Error: ")


def test_an_endpoint_bench_or_no_sweep_still_draws_without_a_warning(tmp_path):
    import warnings

    from llmcli.bench.plot import plot_rows
    from llmcli.bench.rows import Row

    def row(test: str, path: str, unit: str, *samples: float) -> Row:
        return Row("served", None, None, "", None, test, path, unit, list(samples))

    rows = [row("ttft", "endpoint", "s", 0.2, 0.3), row("tg64", "endpoint", "t/s", 50.0, 52.0),
            row("tg64 x4", "endpoint, aggregate", "t/s", 120.0, 125.0)]
    environment = {"endpoint": "http://127.0.0.1:8080/v1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (matplotlib warns, on stderr, of a legend with nothing in it)
        warnings.simplefilter("ignore", ResourceWarning)  # (not matplotlib's: an object of an earlier test collected now)
        assert plot_rows(rows, environment, tmp_path / "served.svg") == 1  # sequences at once
        assert plot_rows(rows[:2], environment, tmp_path / "one.svg") == 1  # nothing swept: the rates themselves
        assert plot_rows([], environment, tmp_path / "none.png") == 1
    panels, text = svg_panels(tmp_path / "served.svg")
    assert panels == 1 and "http://127.0.0.1:8080/v1" in text and "sequences" in text
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["none.png", "one.svg", "served.svg"]  # only


def test_usage_lines_say_that_bench_and_logs_run_without_a_command():
    assert run_cli("bench", "--help").stdout.startswith("Usage: llmcli bench [OPTIONS] [compare BEFORE AFTER]\n")
    assert run_cli("logs", "--help").stdout.startswith("Usage: llmcli logs [OPTIONS] [path|status|on|off|rm …]\n")
