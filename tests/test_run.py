"""`llmcli run` end to end on the real SmolLM2 model, through a real process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from conftest import Forked, run_cli, run_in_terminal, spawn_cli

PROMPT = "Explain what a KV cache is in two sentences."


def greedy(*extra: str, prompt: str = PROMPT) -> str:
    result = run_cli("run", "--temp", "0", "-n", "40", "-q", *extra, prompt)
    assert result.code == 0, result.stderr
    return result.stdout


def answer_json(*args: str) -> dict:
    result = run_cli("run", "--json", *args)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, "--json prints exactly one object"
    return json.loads(lines[0])


def test_default_model_answers_and_prints_stats_on_stderr(cli):
    # sampled (the default), seeded so that the answer cannot end by itself before -n: "Say hello." sometimes did
    result = cli("run", "--seed", "1", "-n", "8", "Write a long story about a lighthouse keeper.")
    assert result.code == 0, result.stderr
    assert result.stdout.strip()
    stats = result.stderr.strip().splitlines()[-1]
    for part in ("load ", "prompt ", "TTFT ", "tok/s", "stop: max tokens"):
        assert part in stats


def test_greedy_output_is_identical_across_runs():
    first = greedy()
    assert first.strip()
    assert greedy() == first


def test_seed_makes_sampling_reproducible():
    args = ("--temp", "1.0", "--seed", "1234", "-n", "30", "Tell me a story.")
    first, second = answer_json(*args), answer_json(*args)
    assert first["text"] == second["text"]
    assert first["timings"]["seed"] == 1234


def test_json_record_is_complete_and_consistent():
    record = answer_json("--temp", "0", "-n", "20", PROMPT)
    assert record["model"] == "smollm2"
    assert record["text"] and record["finish_reason"] in ("stop", "length")
    usage, timings = record["usage"], record["timings"]
    assert usage["prompt_tokens"] > 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert timings["completion_tokens"] == usage["completion_tokens"]
    for key in ("load_s", "prompt_s", "prefill_s", "ttft_s", "decode_s", "total_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert timings[key] > 0, key
    assert timings["prefill_s"] < timings["ttft_s"] <= timings["total_s"]
    assert timings["prefill_tokens"] == usage["prompt_tokens"]
    # the text printed in plain mode is the text recorded in JSON
    assert greedy("-n", "20").rstrip("\n") == record["text"]


def test_max_tokens_stops_after_exactly_that_many():
    record = answer_json("--temp", "0", "-n", "5", PROMPT)
    assert record["finish_reason"] == "length"
    assert record["usage"]["completion_tokens"] == 5
    assert record["timings"]["decode_steps"] == 4


def test_end_of_generation_reports_stop():
    # The grammar ends the answer after "yes": the model's end-of-generation token is all it may write then.
    record = answer_json("--temp", "0", "-n", "200", "--grammar", 'root ::= "yes"', "Reply with just the word yes.")
    assert record["finish_reason"] == "stop" and record["text"] == "yes"
    assert record["usage"]["completion_tokens"] < 200


def test_stop_sequence_cuts_before_it_and_is_never_printed():
    full = greedy().rstrip("\n")
    words = full.split()
    stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])
    expected = full[: full.index(stop)]
    result = run_cli("run", "--temp", "0", "-n", "40", "--stop", stop, "--json", PROMPT)
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "stop_sequence"
    assert record["stop_sequence"] == stop
    assert record["text"] == expected
    plain = run_cli("run", "--temp", "0", "-n", "40", "-q", "--stop", stop, PROMPT)
    assert plain.stdout.rstrip("\n") == expected
    assert stop not in plain.stdout
    assert "stop sequence" in run_cli("run", "--temp", "0", "-n", "40", "--stop", stop, PROMPT).stderr


def test_piped_output_has_no_escape_codes(cli):
    result = cli("run", "--temp", "0", "-n", "20", PROMPT, env={"NO_COLOR": "", "FORCE_COLOR": ""})
    assert result.code == 0
    assert "\x1b" not in result.stdout


def test_terminal_output_is_coloured_and_no_color_turns_it_off():
    args = ["run", "--temp", "0", "-n", "12", "-q", "--answer-color", "cyan", PROMPT]
    coloured = run_in_terminal(args, {"NO_COLOR": "", "TERM": "xterm-256color", "COLORTERM": ""})
    assert re.search(rb"\x1b\[[0-9;]*(3[0-7]|38;5;[0-9]+)m", coloured)
    rendered = run_in_terminal(args, {"NO_COLOR": "1", "TERM": "xterm-256color"})  # Markdown, in no colour
    assert rendered.strip() and not re.search(rb"\x1b\[[0-9;]*(3[0-7]|38;5;[0-9]+)m", rendered)
    plain = run_in_terminal([*args, "--plain"], {"NO_COLOR": "1", "TERM": "xterm-256color"})
    assert b"\x1b[" not in plain
    assert plain.strip()


def test_stdin_and_prompt_combine_in_documented_order(cli):
    shown = cli("run", "--show-prompt", "Summarize:", input="NOTES FROM STDIN\n")
    assert shown.code == 0, shown.stderr
    assert "NOTES FROM STDIN\n\nSummarize:" in shown.stdout  # stdin first: the document is the cacheable prefix
    assert "tokens" in shown.stderr
    first = cli("run", "--show-prompt", "--prompt-first", "Summarize:", input="NOTES FROM STDIN\n")
    assert "Summarize:\n\nNOTES FROM STDIN" in first.stdout
    alone = cli("run", "--show-prompt", "-", input="ONLY STDIN")
    assert "ONLY STDIN" in alone.stdout and "Summarize" not in alone.stdout
    implicit = cli("run", "--show-prompt", input="ONLY STDIN")
    assert implicit.stdout == alone.stdout


def test_piped_stdin_answers(cli):
    result = cli("run", "--temp", "0", "-n", "10", "-q", "Summarize:", input="The cat sat on the mat all day.")
    assert result.code == 0, result.stderr
    assert result.stdout.strip()


def test_stdin_that_never_closes_is_ignored_with_a_prompt():
    """An inherited stdin that never sends anything must not hang a run that has a prompt."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "llmcli", "run", "--show-prompt", "Hello there"],
            stdin=read_end, capture_output=True, timeout=60, env={**os.environ, "LLMCLI_STDIN_WAIT": "0.2"},
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert proc.returncode == 0
    assert b"Hello there" in proc.stdout
    assert b"ignoring it" in proc.stderr


def test_no_prompt_is_a_usage_error(cli):
    result = cli("run")
    assert result.code == 2
    assert result.stderr.startswith("Error: no prompt given")


def test_system_prompt_and_raw_mode(cli):
    shown = cli("run", "--show-prompt", "-s", "You are terse.", "Hi")
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in shown.stdout
    raw = cli("run", "--show-prompt", "--raw", "Once upon a time")
    assert raw.stdout == "Once upon a time\n"


def test_model_without_template_warns_and_falls_back_to_raw(cli, no_template_model):
    result = cli("run", "-m", str(no_template_model), "--temp", "0", "-n", "6", "The capital of France is")
    assert result.code == 0, result.stderr
    assert "Warning: this model has no chat template" in result.stderr
    assert result.stdout.strip()


def test_chat_template_file_overrides_the_model(cli, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    shown = cli("run", "--show-prompt", "--chat-template-file", str(template), "Hi")
    assert shown.stdout == "[user] Hi\n[assistant]\n"


@pytest.mark.parametrize(
    "make, code, fragment",
    [
        (lambda p: p / "missing.gguf", 3, "model file not found"),
        (lambda p: (p / "notes.gguf").write_text("hello, I am not a model") and p / "notes.gguf", 5, "is not a GGUF file"),
        (lambda p: p, 2, "is a directory"),
    ],
)
def test_bad_model_files_give_one_error_line(cli, tmp_path, make, code, fragment):
    result = cli("run", "-m", str(make(tmp_path)), "hi")
    assert result.code == code
    assert result.stderr.startswith("Error: ") and fragment in result.stderr.splitlines()[0]
    assert "Traceback" not in result.stderr


def test_truncated_gguf_is_rejected_before_loading(cli, tmp_path, smollm2):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2.read_bytes()[: 5_000_000])
    result = cli("run", "-m", str(truncated), "hi")
    assert result.code == 5
    assert result.stderr.startswith("Error: ") and "is truncated" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_installed_model_names_the_fix():
    code = (
        "import llmcli.store.models as m; m.packaged_models = lambda: (); "
        "import sys; sys.argv = ['llmcli', 'run', 'hi']; from llmcli.cli import main; main()"
    )
    unset = {name: value for name, value in os.environ.items() if name != "LLMCLI_MODEL"}  # (the tests' default)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                          env=unset)
    assert proc.returncode == 3
    assert proc.stderr.splitlines()[0] == "Error: no model given and none installed"
    assert "pip install" in proc.stderr


def _start(*args: str) -> subprocess.Popen | Forked:
    return spawn_cli("run", *args)


def _wait_for_output(proc: subprocess.Popen | Forked) -> bytes:
    first = proc.stdout.read(8)  # blocks until the answer has started streaming
    assert first
    return first


def test_ctrl_c_while_decoding_keeps_the_partial_answer():
    proc = _start("--temp", "0.8", "--seed", "7", "Write a very long story about a dragon.")
    first = _wait_for_output(proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert (first + out).strip()
    assert b"stop: interrupted" in err
    assert b"Traceback" not in err


@pytest.mark.in_process  # (llama.cpp's log, -v, says when the prefill starts: this process's)
def test_ctrl_c_during_a_long_prefill_stops_at_once(tmp_path):
    long_input = tmp_path / "long.txt"
    long_input.write_text("The quick brown fox jumps over the lazy dog. " * 400)  # ~4000 tokens
    # -b 1: one token per decode, so the prefill takes tens of seconds; -v: llama.cpp's log says when the context
    # exists (the last thing before the prefill starts)
    proc = spawn_cli("run", "-v", "-b", "1", "-c", "8192", "--json", "Summarize:", "--stdin", input=long_input.read_bytes())
    log = b""
    while b"llama_context:" not in log:
        line = proc.stderr.readline()
        assert line, log.decode(errors="replace")
        log += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    record = json.loads(out)  # still one valid object
    assert record["finish_reason"] == "interrupted"
    assert record["usage"]["completion_tokens"] == 0
    assert record["timings"]["prefill_tokens"] < record["usage"]["prompt_tokens"]
    stats = next(line for line in err.decode().splitlines() if "stop: interrupted" in line)  # issue 23: what is known
    assert f"of {record['usage']['prompt_tokens'] - record['usage']['cached_tokens']} evaluated)" in stats, stats
    assert "TTFT" not in stats and ") (" not in stats and "stop: interrupted" in stats


def test_sigterm_ends_generation_gracefully():
    proc = _start("--temp", "0.8", "--seed", "7", "Write a very long story about a dragon.")
    _wait_for_output(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert b"stop: interrupted" in err


def test_closed_stdout_exits_quietly():
    shell = (f"{sys.executable} -m llmcli run --temp 0.8 --seed 7 'Write a long story about a dragon.' | head -c 20; "
             "exit ${PIPESTATUS[0]}")
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert len(proc.stdout) == 20
    assert proc.returncode == 141
    assert b"Traceback" not in proc.stderr and b"Exception ignored" not in proc.stderr


def test_gemma_base_model_from_its_chunk_packages(cli, isolated_env):
    """The second real model: Gemma-3-270M (base, Q4_K_M), assembled into the cache on first use."""
    first = cli("run", "-m", "gemma3-270m", "--raw", "--temp", "0", "-n", "12", "--json", "The capital of France is")
    assert first.code == 0, first.stderr
    record = json.loads(first.stdout)
    assert record["model"] == "gemma3-270m" and record["finish_reason"] == "length"
    assert record["usage"]["completion_tokens"] == 12 and record["text"].strip()
    assert (isolated_env / "cache" / "packages" / "gemma3-270m.gguf").is_file()
    again = cli("run", "-m", "gemma3-270m", "--raw", "--temp", "0", "-n", "12", "--json", "The capital of France is")
    assert json.loads(again.stdout)["text"] == record["text"]
    listed = json.loads(cli("list", "--json").stdout)
    assert any(e["name"] == "gemma3-270m" and e["quant"] == "Q4_K_M" for e in listed)


def test_words_of_an_unquoted_prompt_are_one_prompt():
    joined = run_cli("run", "--show-prompt", "hello", "big", "world")
    quoted = run_cli("run", "--show-prompt", "hello big world")
    assert joined.code == 0 and joined.stdout == quoted.stdout and "hello big world" in joined.stdout


def test_kept_weights_serve_the_later_engines_and_outlive_them(smollm2):
    """`keep_loaded` (what the suite's forked runs inherit): an engine made after it uses the process's weights, and
    closing it leaves them loaded for the next one; another load mode loads its own. The same greedy tokens."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from llmcli.llama.engine import Engine\n"
        "from llmcli.llama.engine_config import EngineConfig\n"
        "from llmcli.llama.weights import keep_loaded\n"
        "path = Path(sys.argv[1])\n"
        "def greedy(config):\n"
        "    engine = Engine(path, config)\n"
        "    engine.prefill(engine.vocab.tokenize('The capital of France is'))\n"
        "    found = (engine.greedy_token(), engine._weights.owned, engine.load_s)\n"
        "    engine.close()\n"
        "    return found\n"
        "config = EngineConfig(n_threads=1, n_ctx=256)\n"
        "alone = greedy(config)\n"
        "keep_loaded(path)\n"
        "kept, again = greedy(config), greedy(config)\n"
        "other = greedy(EngineConfig(n_threads=1, n_ctx=256, mmap=False))\n"
        "print(json.dumps({'alone': alone, 'kept': kept, 'again': again, 'other': other}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(smollm2)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["alone"][1] is True and found["kept"][1] is False and found["again"][1] is False
    assert found["other"][1] is True  # (read into memory, not mapped: its own weights)
    assert found["alone"][0] == found["kept"][0] == found["again"][0] == found["other"][0]


def test_prefill_progress_shows_on_a_terminal_and_is_gone_before_the_answer():
    document = " ".join(f"item{i}" for i in range(150))  # ~470 tokens in chunks of 64: some seconds on one thread
    args = ["run", "--no-prompt-cache", "-t", "1", "-b", "64", "--temp", "0", "-n", "4", "--grammar", 'root ::= "DONE"',
            "Summarise."]
    shown = run_in_terminal(args, {"NO_COLOR": "1"}, stdin=document, stderr=True).decode()
    assert "evaluating the prompt · " in shown and " tokens · " in shown and "tok/s" in shown, shown[-2000:]
    assert shown.rindex("evaluating the prompt") < shown.index("DONE")  # erased before the first token
    assert "evaluating" not in shown[shown.index("DONE"):]
    piped = run_cli(*args, input=document)
    assert piped.code == 0 and piped.stdout == "DONE\n" and "evaluating" not in piped.stderr
    runtime = tempfile.mkdtemp(prefix="llmcli-rt-", dir="/tmp")  # the default path, warm (issue 57: no progress)
    warm = {"NO_COLOR": "1", "LLMCLI_KEEP_ALIVE": "", "LLMCLI_RUNTIME_DIR": runtime}
    try:
        shown = run_in_terminal(args, warm, stdin=document, stderr=True).decode()
        assert "evaluating the prompt · " in shown and shown.rindex("evaluating the prompt") < shown.index("DONE"), shown
    finally:
        run_cli("stop", env=warm)
        shutil.rmtree(runtime, ignore_errors=True)
