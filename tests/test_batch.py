"""`llmcli run --batch`: many prompts as parallel sequences in one context, JSONL out in input order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from conftest import run_cli

QUESTIONS = [
    "What is the capital of France?", "Name three fruits.", "Why is the sky blue?", "Write a haiku about winter.",
    "What is 12 times 12?", "Describe a cat in one sentence.", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
]


def batch(*args: str, input: str) -> tuple[list[dict], str, int]:
    result = run_cli("run", "--batch", "-", *args, input=input)
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr, result.code


def test_eight_prompts_in_parallel_match_sequential_runs_in_input_order():
    records, stderr, code = batch("-P", "8", "--temp", "0", "-n", "24", input="\n".join(QUESTIONS) + "\n")
    assert code == 0, stderr
    assert [r["index"] for r in records] == list(range(8))
    sequential = [run_cli("run", "--json", "--temp", "0", "-n", "24", q) for q in QUESTIONS]
    same = sum(json.loads(s.stdout)["text"] == r["text"] for s, r in zip(sequential, records, strict=True))
    # llama.cpp is not batch-invariant in general; on this build all 8 match (see the closing note)
    assert same >= 7, f"only {same} of 8 batched answers equal the sequential ones"
    for record in records:
        assert record["finish_reason"] in ("stop", "length")
        assert record["usage"]["completion_tokens"] <= 24 and record["timings"]["ttft_s"] > 0
    summary = stderr.strip().splitlines()[-1]
    assert summary.startswith("batch: 8 prompts (0 errors)") and "aggregate decode" in summary and "8 parallel" in summary


def test_jsonl_fields_are_carried_through_and_bad_lines_are_error_records():
    lines = [
        json.dumps({"prompt": "Say hi.", "id": "a-1", "meta": {"k": 1}}),
        "",
        "{not json",
        json.dumps({"id": "no-prompt"}),
        "plain text prompt",
        json.dumps({"prompt": "word " * 3000, "id": "too-long"}),
        json.dumps({"prompt": "Say bye.", "id": "last"}),
    ]
    records, stderr, code = batch("-P", "3", "-c", "512", "--temp", "0", "-n", "8", input="\n".join(lines) + "\n")
    assert code == 0, stderr
    assert [r["index"] for r in records] == list(range(7))
    assert records[0]["id"] == "a-1" and records[0]["meta"] == {"k": 1} and records[0]["text"]
    assert records[1]["error"] == "empty line"
    assert records[2]["error"].startswith("malformed JSON")
    assert records[3] == {"id": "no-prompt", "index": 3, "error": 'no "prompt" string in the object'}
    assert records[4]["text"]
    assert records[5]["id"] == "too-long" and "do not fit the context window of 512 tokens" in records[5]["error"]
    assert records[6]["id"] == "last" and records[6]["text"]
    assert "(4 errors)" in stderr


def test_controls_apply_per_prompt_and_seeded_answers_ignore_their_neighbours():
    same = "Write a short poem about the sea."
    lines = [same, "Name a color.", same, "Count to five.", same]
    records, stderr, code = batch("-P", "2", "--temp", "0.9", "--seed", "42", "-n", "24", "--stop", "\n\n",
                                  "-s", "Answer briefly.", input="\n".join(lines) + "\n")
    assert code == 0, stderr
    assert records[0]["text"] == records[2]["text"] == records[4]["text"]
    assert all(r["timings"]["seed"] == 42 for r in records)
    assert all("\n\n" not in r["text"] for r in records)
    alone = json.loads(run_cli("run", "--json", "--temp", "0.9", "--seed", "42", "-n", "24", "--stop", "\n\n",
                               "-s", "Answer briefly.", same).stdout)
    assert alone["text"] == records[0]["text"]


def test_batch_from_a_file_and_a_prompt_argument_is_refused(tmp_path):
    source = tmp_path / "questions.txt"
    source.write_text("What is 2+2?\nName a planet.\n")
    result = run_cli("run", "--batch", str(source), "--temp", "0", "-n", "8", "-q")
    assert result.code == 0 and len(result.stdout.splitlines()) == 2
    assert run_cli("run", "--batch", str(source), "extra prompt").code == 2
    assert run_cli("run", "--batch", str(tmp_path / "missing.txt")).code == 2


def test_ctrl_c_leaves_valid_jsonl_with_interrupted_records(tmp_path):
    source = tmp_path / "many.txt"
    source.write_text("\n".join(f"Write a long story about the number {n}." for n in range(12)) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "llmcli", "run", "--batch", str(source), "-P", "2", "-n", "100"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()  # the first answer is written as soon as it is done
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert [r["index"] for r in records] == list(range(12))  # one line per input, in order
    assert records[0].get("finish_reason") in ("stop", "length")
    assert any(r.get("finish_reason") == "interrupted" or "interrupted" in r.get("error", "") for r in records)
    assert b"interrupted" in err


def test_kv_cache_for_all_slots_is_checked_before_loading():
    result = run_cli("run", "--batch", "-", "-P", "64", "-c", "200000", input="hi\n")
    assert result.code == 6
    assert "KV cache" in result.stderr and "available" in result.stderr
