"""`llmcli run --batch`: many prompts as parallel sequences in one context, JSONL out in input order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from conftest import ScoredAnswer, run_cli, scored, spawn_cli, where_greedy_answers_part

QUESTIONS = [
    "What is the capital of France?", "Name three fruits.", "Why is the sky blue?", "Write a haiku about winter.",
    "What is 12 times 12?", "Describe a cat in one sentence.", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
]


def batch(*args: str, input: str) -> tuple[list[dict], str, int]:
    result = run_cli("run", "--batch", "-", *args, input=input)
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr, result.code


def test_eight_prompts_in_parallel_match_sequential_runs_in_input_order():
    records, stderr, code = batch("-P", "8", "--temp", "0", "-n", "24", "--logprobs", "5",
                                  input="\n".join(QUESTIONS) + "\n")
    assert code == 0, stderr
    assert [r["index"] for r in records] == list(range(8))
    sequential = [json.loads(run_cli("run", "--json", "--temp", "0", "-n", "24", "--logprobs", "5", q).stdout)
                  for q in QUESTIONS]
    # llama.cpp is not batch-invariant: a batch's answer is the sequential one's, or parts from it at a near-tie
    parted = [where_greedy_answers_part(*(ScoredAnswer(r["text"], r["finish_reason"], tuple(scored(r["logprobs"])))
                                          for r in pair)) for pair in zip(sequential, records, strict=True)]
    assert parted == [None] * len(QUESTIONS), parted
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
    assert records[5]["id"] == "too-long" and "the context holds 512" in records[5]["error"]
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
    proc = spawn_cli("run", "--batch", str(source), "-P", "2", "-n", "100")
    first = proc.stdout.readline()  # the first answer is written as soon as it is done
    proc.send_signal(signal.SIGINT)
    # Read the rest through the same buffered reader: readline may already hold the next line (two answers
    # that end in the same step), which communicate() would skip by reading the pipe underneath.
    rest, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, err
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert [r["index"] for r in records] == list(range(12))  # one line per input, in order
    assert records[0].get("finish_reason") in ("stop", "length")
    assert any(r.get("finish_reason") == "interrupted" or "interrupted" in r.get("error", "") for r in records)
    assert b"interrupted" in err


def test_kv_cache_sized_to_the_batch_is_checked_before_it_is_allocated():
    result = run_cli("run", "--batch", "-", "-P", "64", "-c", "200000", "-n", "190000", input="hi\n" * 64)
    assert result.code == 6
    assert "KV cache" in result.stderr and "available" in result.stderr


def _peak_rss_kib(*args: str, input: str) -> tuple[int, str, str]:
    """Run `python -m llmcli ARGS` as its own process: (its peak RSS in KiB, stdout, stderr)."""
    import os
    import tempfile

    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write(input.encode())
        stdin.seek(0)
        proc = subprocess.Popen([sys.executable, "-m", "llmcli", *args], stdin=stdin, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read().decode()
        return usage.ru_maxrss, out.read().decode(), err.read().decode()


def test_parallel_slots_are_sized_to_the_work_and_share_the_prompt_prefix():
    prompts = "\n".join(QUESTIONS * 2) + "\n"  # 16 short prompts
    rss_1, out_1, _ = _peak_rss_kib("run", "--batch", "-", "-P", "1", "--temp", "0", "-n", "8", "-t", "1", input=prompts)
    rss_8, out_8, err_8 = _peak_rss_kib("run", "--batch", "-", "-P", "8", "--temp", "0", "-n", "8", "-t", "1",
                                        input=prompts)
    assert rss_8 <= rss_1 + 150 * 1024, (rss_1, rss_8)  # before: 8 full contexts (~930 MB against ~270 MB)
    records = [json.loads(line) for line in out_8.splitlines()]
    assert [r["text"] for r in records] == [json.loads(line)["text"] for line in out_1.splitlines()]
    shared = records[0]["usage"]["cached_tokens"]  # the template's head, shared by every prompt
    assert shared > 10 and all(r["usage"]["cached_tokens"] == shared for r in records)
    evaluated = shared + sum(r["usage"]["prompt_tokens"] - shared for r in records)  # the prefix once
    summary = err_8.strip().splitlines()[-1]
    assert f"({evaluated} evaluated, a shared prefix of {shared} once)" in summary


# A prompt of ~220 tokens and an answer of 80: more than a sequence's first cells (llama.cpp pads each to 256), with
# few tokens decoded one at a time (prefill is several times faster than decoding).
LONG_GRAMMAR = 'root ::= ([0-9] " "){40}'
LONG_PROMPTS = [" ".join([word] * 190) + "\nHow many words?" for word in ("apple", "river")]


def test_a_long_answer_grows_the_kv_cache_without_changing_any_answer():
    code = (
        "import json\n"
        "from llmcli.answer import batch_jsonl\n"
        "from llmcli.decode import batch_run\n"
        "from llmcli.interrupt import Cancellation\n"
        "from llmcli.pipeline import Request, Shape\n"
        "from llmcli.pipeline.local import open_pipeline\n"
        "p = open_pipeline(Request(settings={'temp': 0.0, 'max_tokens': None, 'prompt_cache': False, 'repetition_guard': False},\n"
        f"                           grammar={LONG_GRAMMAR!r}, shape=Shape(2, batch=True)))\n"
        "s = p.session\n"
        f"items = batch_jsonl.parse_items({LONG_PROMPTS!r})\n"
        "texts = {}\n"
        "for room in (4096, 1):\n"
        "    bp = batch_run.plan(items, lambda item: s.prepare_alone(item.prompt, p.generation), s.engine, p.generation, 2,\n"
        "                        answer_room=room)\n"
        "    s.engine.resize(bp.cells, bp.n_sequences)\n"
        "    out = {}\n"
        "    run = batch_run.BatchRun(s.engine, bp, p.generation, Cancellation(), lambda i, r: out.__setitem__(i, r['text']))\n"
        "    texts[room] = (out, run.run().grown)\n"
        "print(json.dumps({'same': texts[4096][0] == texts[1][0], 'grown': texts[1][1], 'big': texts[4096][1],\n"
        "                  'long': min(len(t) for t in texts[1][0].values())}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "LLMCLI_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"same": True, "grown": outcome["grown"], "big": 0, "long": 80} and outcome["grown"] >= 1


def test_batch_summary_counts_what_did_not_run():
    result = run_cli("run", "--batch", "-", "-n", "2", input="hi\n")
    assert result.code == 0, result.stderr
    assert "batch: 1 prompt (0 errors)" in result.stderr
