"""`llmcli bench --tune`: bounded by its budget, honest about the noise, and its profile usable with -p."""

from __future__ import annotations

import json

from conftest import run_cli, svg_panels

from llmcli import paths
from llmcli.bench.tune import Candidate, Dimension, thread_candidates
from llmcli.config import settings
from llmcli.config.config_file import save_profile


def test_tune_measures_within_its_budget_reports_the_rest_and_saves_a_usable_profile(isolated_env, tmp_path):
    picture = tmp_path / "tune.svg"
    result = run_cli("bench", "--tune", "-p", "32", "-n", "8", "--budget", "2s", "--save", "quick", "--format", "json",
                     "--plot", str(picture))
    assert result.code == 0, result.stderr
    panels, text = svg_panels(picture)  # one panel per setting measured, its verdict in the title
    assert panels >= 1 and "threads:" in text and "bench --tune" in text
    record = json.loads(result.stdout)
    dimensions = {d["setting"]: d for d in record["dimensions"]}
    assert list(dimensions) == ["threads", "batch_size", "flash_attn", "kv_type", "mmap"]
    threads = dimensions["threads"]
    assert all(c["job_s"]["n"] >= 2 for c in threads["candidates"])  # a dimension begun gets two rounds at least
    # what the budget left out comes last, keeps its default and says so (how much fits depends on the machine)
    measured = [d["verdict"] != "not measured (time budget)" for d in record["dimensions"]]
    assert measured == sorted(measured, reverse=True) and measured[0]
    assert all(d["chosen"] == d["default"] and all(c["job_s"]["n"] == 0 for c in d["candidates"])
               for d, done in zip(record["dimensions"], measured, strict=True) if not done)
    assert record["profile"] == {k: v for k, v in [("threads", threads["chosen"])] if v != threads["default"]}
    assert "saved [profiles.quick]" in result.stderr
    config = settings.load_config_file()
    assert config.profiles["quick"] == record["profile"]
    used = run_cli("run", "-p", "quick", "--temp", "0", "-n", "2", "hi")
    assert used.code == 0, used.stderr


def test_tune_table_and_usage_errors(tmp_path):
    from llmcli.bench.tune import Tuner
    from llmcli.cli.bench import _tune_table

    tuner = Tuner(tmp_path / "unused.gguf", 60, 64, 16)  # nothing is measured: the table of what was
    tuner.dimensions[0].candidates[0].job_s[:] = [1.0, 1.1]
    for candidate in tuner.dimensions[0].candidates:
        candidate.job_s[:], candidate.prefill_tps[:] = [1.0, 1.1], [100.0, 101.0]
        candidate.decode_tps[:], candidate.load_s[:] = [50.0, 51.0], [0.1, 0.1]
    tuner.dimensions[0].judge()
    table = _tune_table("smollm2", tuner)
    assert "| threads | 1 | 1050 ± 71 ms | 100.5 | 50.5 | 100 ms | 2 |" in table
    assert "the default is best" in table or "within the noise" in table
    assert "not measured (time budget)" in table
    assert run_cli("bench", "--tune", "--budget", "soon").code == 2
    assert run_cli("bench", "--save", "x").code == 2
    assert run_cli("bench", "--tune", "-m", "smollm2", "-m", "gemma3-270m").code == 2


def test_a_setting_with_one_value_is_not_measured_and_says_why(tmp_path):
    """A prompt shorter than every batch size but the default leaves one batch size: nothing to compare, so none of
    the budget goes to it (it was measured, then reported as not measured). (The tuner on fake jobs: milliseconds.)"""
    from llmcli.bench.tune import Tuner

    tuner = Tuner(tmp_path / "unused.gguf", 3600, 32, 8, rounds=2)
    measured: list[str] = []
    tuner._measure = lambda setting, candidate: (measured.append(setting), candidate.job_s.append(1.0))
    list(tuner.run())
    batch = tuner.dimensions[1]
    assert batch.setting == "batch_size" and [c.value for c in batch.candidates] == [512] and not batch.candidates[0].job_s
    assert batch.verdict == "one value applies: nothing to compare" and "batch_size" not in measured
    assert {"threads", "flash_attn", "kv_type", "mmap"} <= set(measured)


def test_a_difference_inside_the_noise_is_not_a_win():
    noisy = Dimension("threads", [Candidate(1, [1.00, 1.30, 0.90]), Candidate(2, [1.05, 1.10, 1.20])], 2)
    noisy.judge()
    assert noisy.winner == 2 and "within the noise" in noisy.verdict and not noisy.won
    clear = Dimension("threads", [Candidate(1, [0.50, 0.51, 0.49]), Candidate(2, [1.00, 1.01, 0.99])], 2)
    clear.judge()
    assert clear.winner == 1 and clear.won and "2.00× faster" in clear.verdict
    assert thread_candidates(16, 32) == [1, 2, 4, 8, 16, 32] and thread_candidates(2, 2) == [1, 2]


def test_saving_a_profile_keeps_the_rest_of_the_config_file():
    path = paths.config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('# my settings\ntemp = 0.3  # cooler\n\n[profiles.fast]\nthreads = 1\n\n[aliases]\nmine = "smollm2"\n')
    save_profile("fast", {"threads": 2, "kv_type": "q8_0"}, "tuned")
    text = path.read_text()
    assert "# my settings" in text and "temp = 0.3  # cooler" in text and 'mine = "smollm2"' in text
    config = settings.load_config_file()
    assert config.profiles["fast"] == {"threads": 2, "kv_type": "q8_0"} and config.settings["temp"] == 0.3
    save_profile("other", {}, "none won")
    assert settings.load_config_file().profiles["other"] == {}
