"""Speculative decoding (issue 14) through the real CLI, and its parts on their own.

One llama.cpp thread (`-t 1`) where outputs are compared: with more threads llama.cpp evaluates a single
token's attention in another order of additions than a pass of several tokens (once the context passes 256
cells), so a near-tie can resolve differently (see the README)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
from conftest import run_cli

from llmcli.decode.speculative import CostModel, LookupDrafter

TEXT = ("The keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in the log: wind from the west, "
        "light rain, three ships passing close to the rocks.")


def _chat(mode: str, lines: list[str], *args: str) -> list[dict]:
    result = run_cli("chat", "--json", "--no-save", "-t", "1", "--speculate", mode, *args, input="\n".join(lines) + "\n")
    assert result.code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _turns() -> list[str]:
    """8 varied prompts (4 of them copies, where drafts are right); between them /clear (each answers alone) and
    settings that end answers in drafts."""
    prompts = [f"Repeat this sentence exactly: {TEXT}", "Name three planets.", "Repeat exactly: one two three four five six",
               f"Copy this text: {TEXT}", "What is 12 times 12?", "Say 'the cat sat on the mat' three times.",
               f"Summarize in one line: {TEXT}", f"Repeat twice: {TEXT[:60]}"]
    lines = []
    for i, prompt in enumerate(prompts):
        lines += ["/clear", prompt]
        if i == 3:
            lines += ["/clear", "/set stop rain", f"Repeat this sentence exactly: {TEXT}", "/set stop none"]
        if i == 7:
            lines += ["/clear", "/set max_tokens 13", f"Repeat this sentence exactly: {TEXT}", "/set max_tokens 48"]
    return lines


def test_greedy_answers_are_identical_with_and_without_drafts():
    lines = _turns()
    plain = _chat("off", lines, "--temp", "0", "-n", "48")
    drafted = _chat("lookup", lines, "--temp", "0", "-n", "48")
    assert len(plain) == len(drafted) == 10
    assert [r["text"] for r in drafted] == [r["text"] for r in plain]
    assert [r["finish_reason"] for r in drafted] == [r["finish_reason"] for r in plain]
    timings = [r["timings"] for r in drafted]
    assert sum(t["accepted_tokens"] for t in timings) > 50  # drafts were made and right, many tokens a pass
    stopped = next(r for r in drafted if r["finish_reason"] == "stop_sequence")
    assert stopped["timings"]["accepted_tokens"] > 0 and "rain" not in stopped["text"]  # a stop inside a draft
    cut = next(r for r in drafted if r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 13)
    assert cut["timings"]["accepted_tokens"] > 0  # -n reached inside a draft
    assert all(r["timings"]["draft_tokens"] == 0 for r in plain)


def test_sampled_answers_follow_the_seed_with_drafts_as_without():
    lines = []
    for seed in range(16):
        lines += ["/clear", f"/set seed {seed}", f"Repeat this sentence exactly: {TEXT}"]
    args = ("--temp", "0.9", "-n", "12")
    plain = _chat("off", lines, *args)
    drafted = _chat("lookup", lines, *args)
    again = _chat("lookup", lines[:9], *args)
    assert [r["text"] for r in again] == [r["text"] for r in drafted[:3]]  # reproducible with a seed
    assert sum(r["timings"]["accepted_tokens"] for r in drafted) > 20
    # The sampler chain sees every token in order and draws one random number per token, drafted or not, so each
    # seed gives the answer plain sampling gives (the same distribution, and more: the same draws).
    assert [r["text"] for r in drafted] == [r["text"] for r in plain]
    answers = Counter(r["text"] for r in drafted)
    assert len(answers) >= 3  # really sampled: the seeds give different answers


def test_batch_drafts_per_sequence_with_the_answers_of_plain_decoding(tmp_path, smollm2):
    questions = tmp_path / "q.txt"
    questions.write_text("\n".join([f"Repeat this sentence exactly: {TEXT}", "Name three planets.",
                                     f"Copy this text: {TEXT}", "Count from one to twelve in words."]) + "\n")
    runs = {mode: run_cli("run", "--batch", str(questions), "-P", "2", "-t", "1", "--temp", "0", "-n", "40",
                          "--speculate", mode) for mode in ("off", "lookup")}
    records = {mode: [json.loads(line) for line in r.stdout.splitlines()] for mode, r in runs.items()}
    assert [r["text"] for r in records["lookup"]] == [r["text"] for r in records["off"]]
    assert [r["finish_reason"] for r in records["lookup"]] == [r["finish_reason"] for r in records["off"]]
    accepted = [r["timings"]["accepted_tokens"] for r in records["lookup"]]
    assert accepted[0] > 10 and accepted[2] > 10  # the copying answers: many tokens a pass
    assert "drafted accepted" in runs["lookup"].stderr and "drafted accepted" not in runs["off"].stderr
    refused = run_cli("run", "--batch", str(questions), "--draft-model", str(smollm2))
    assert refused.code == 2 and "not with --draft-model" in refused.stderr


def test_draft_model_must_share_the_vocabulary_and_agrees_with_itself(smollm2, gemma3, tmp_path):
    refused = run_cli("run", "-m", str(smollm2), "--draft-model", str(gemma3), "hi")
    assert refused.code == 2 and "cannot draft for this model" in refused.stderr and "262144" in refused.stderr
    needs = run_cli("run", "--speculate", "draft", "hi")
    assert needs.code == 2 and "--draft-model" in needs.stderr
    draft = tmp_path / "draft.gguf"
    shutil.copyfile(smollm2, draft)
    same = run_cli("run", "-t", "1", "--json", "--temp", "0", "-n", "24", "--speculate", "draft",
                   "--draft-model", str(draft), "Name three planets.")
    assert same.code == 0, same.stderr
    timings = json.loads(same.stdout)["timings"]
    assert timings["draft_tokens"] > 0 and timings["accepted_tokens"] == timings["draft_tokens"]  # 100 %
    plain = run_cli("run", "-t", "1", "--json", "--temp", "0", "-n", "24", "--speculate", "off", "Name three planets.")
    assert json.loads(plain.stdout)["text"] == json.loads(same.stdout)["text"]
    assert "drafted accepted, 100%" in same.stderr
    # the draft file rewritten where it was (a new quantize of it): the warm server that loaded the old one is not
    # the one that answers (it was found by the file's name, and kept the old weights)
    written = draft.stat().st_mtime_ns + 10**9
    os.utime(draft, ns=(written, written))
    again = run_cli("run", "-t", "1", "-n", "2", "--speculate", "draft", "--draft-model", str(draft), "hi")
    assert again.code == 0, again.stderr
    listed = run_cli("ps", "--json")
    assert len(listed.stdout.splitlines()) == 3, listed.stdout  # (with the one --speculate off answered in)


def test_gemma_copies_with_drafts_identically(gemma3):
    text = (TEXT + " ") * 3 + "\n\nThe same text, copied again word for word:\n\n"
    copy = f'root ::= "{TEXT}"'  # the copy itself, forced: drafts from the prompt are right on any CPU
    runs = {mode: run_cli("run", "-m", str(gemma3), "-t", "1", "--json", "--temp", "0", "-n", "60", "--speculate", mode,
                          "--grammar", copy, "-", input=text) for mode in ("off", "lookup")}
    records = {mode: json.loads(r.stdout) for mode, r in runs.items()}
    assert records["lookup"]["text"] == records["off"]["text"] == TEXT
    assert records["lookup"]["timings"]["accepted_tokens"] > 0 and records["off"]["timings"]["draft_tokens"] == 0


# -- the parts on their own ------------------------------------------------------------------------

def test_lookup_drafts_what_followed_the_latest_longest_match():
    drafter = LookupDrafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    draft, n = drafter.draft(4)
    assert draft == [4, 5, 6, 7] and n == 3  # the last 3 tokens occurred before: what followed them
    drafter.append(4)
    assert drafter.draft(2) == ([5, 6], 3)  # the longest size that matches (3: [2, 3, 4])
    assert LookupDrafter([1, 2, 3, 4]).draft(4) == ([], 0)  # nothing repeats: no draft


def test_the_cost_model_drafts_only_when_it_pays():
    cost = CostModel()
    assert cost.best_k(16, 2)[0] == 0  # a 2-gram match is a weak guess: no draft at 35 % acceptance
    k, gain = cost.best_k(16, 12)
    assert k >= 2 and gain > 1.05  # a 12-gram match is a good one
    for _ in range(20):
        cost.observe_acceptance(12, 8, 8)
    assert cost.best_k(16, 12)[0] > k  # always right: longer drafts
    for _ in range(40):
        cost.observe_acceptance(12, 4, 0)
    assert cost.best_k(16, 12)[0] == 0  # always wrong: stop drafting
    cost.observe_pass(1, 0.010)
    cost.observe_pass(9, 0.080)  # a 9-token pass as dear as 8 single ones: drafting cannot pay
    assert cost.pass_cost(9) == pytest.approx(8.0)
    assert cost.gain(8, 12) == pytest.approx((1 + cost.extra_tokens(8, 12)) / 8.0)  # the measured cost is used
    batch = CostModel()
    batch.observe_pass(1, 0.010)
    batch.observe_pass(8, 0.045)  # a step of 8 sequences, one token each
    for _ in range(10):
        batch.observe_acceptance(12, 8, 8)
    alone, in_step = batch.best_k(16, 12), batch.best_step_k(8, 8, 16, 12)
    assert alone[0] > 0 and in_step[1] < alone[1]  # a draft adds less to a step that already carries 8 tokens


def test_drafts_fit_a_small_batch_size(tmp_path):
    """A draft and its pending token go in one llama_decode: with -b 4 a draft is at most 3 tokens (llama.cpp
    aborted the process on a larger pass before)."""
    single = run_cli("run", "-b", "4", "-t", "1", "--json", "--temp", "0", "-n", "24", "--speculate", "lookup",
                     f"Repeat this sentence exactly: {TEXT}")
    assert single.code == 0, single.stderr
    assert json.loads(single.stdout)["timings"]["accepted_tokens"] > 0
    questions = tmp_path / "q.txt"
    questions.write_text(f"Repeat this sentence exactly: {TEXT}\nCopy this text: {TEXT}\n")
    batch = run_cli("run", "--batch", str(questions), "-P", "2", "-b", "4", "-t", "1", "--temp", "0", "-n", "24",
                    "--speculate", "lookup")
    assert batch.code == 0, batch.stderr
    assert sum(json.loads(line)["timings"]["accepted_tokens"] for line in batch.stdout.splitlines()) > 0
