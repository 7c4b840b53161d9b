"""Step 6, why an answer stops: stop sequences (with their escapes, from a flag, the environment or /set), the
repetition guard (and DRY and XTC beside it), -n and the context's room (-n -1, a cut inside a character, overflow
hints), through the real CLI on SmolLM2; loops and cuts are forced by grammars, so any CPU gives them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import run_cli

POEM = "Write a short poem with two stanzas about the sea."


def test_stop_newline_escape_matches_from_flag_env_and_chat():
    free = run_cli("run", "--temp", "0", "-n", "40", "--json", POEM)
    text = json.loads(free.stdout)["text"]
    first_line = text[: text.index("\n")]  # a poem has lines when nothing stops it
    for args, env in ((["--stop", "\\n"], {}), ([], {"LLMCLI_STOP": "\\n"})):  # a backslash and an n, as a shell passes them
        result = run_cli("run", "--temp", "0", "-n", "40", "--json", *args, POEM, env=env)
        record = json.loads(result.stdout)
        assert record["finish_reason"] == "stop_sequence" and record["stop_sequence"] == "\n", (args, env)
        assert record["text"] == first_line
    chat = run_cli("chat", "--no-save", "--temp", "0", "-n", "40", "--json", "-q", input=f"/set stop \\n\n{POEM}\n")
    reply = json.loads(chat.stdout)
    assert reply["finish_reason"] == "stop_sequence" and reply["text"] == first_line

LOOP_LINE = "A place where the sea sways."
LOOP_GRAMMAR = f'root ::= ("{LOOP_LINE}\\n")+'  # forces the loop on any CPU: only the tokenization is the model's


def test_an_answer_caught_in_a_loop_stops_with_finish_reason_repetition():
    looping = ("run", "--json", "--temp", "0", "-n", "120", "--grammar", LOOP_GRAMMAR, POEM)
    guarded = run_cli(*looping)
    record = json.loads(guarded.stdout)
    assert guarded.code == 0 and record["finish_reason"] == "repetition"
    assert record["usage"]["completion_tokens"] < 120 and "repeating itself" in guarded.stderr
    free = json.loads(run_cli(*looping, "--no-repetition-guard").stdout)
    assert free["finish_reason"] == "length" and free["text"].startswith(record["text"])
    assert free["text"].count(LOOP_LINE) > 5
    plain, dry = (json.loads(run_cli("run", "--json", "--temp", "0", "-n", "48", "--no-repetition-guard", *extra,
                                     POEM).stdout) for extra in ((), ("--dry-multiplier", "0.8")))
    assert dry["finish_reason"] in ("stop", "length")  # DRY penalises extending what was said before
    assert dry["text"] != plain["text"]  # ... so greedy decoding takes another path (the same machine, two runs)
    sampled = ("--temp", "1", "--seed", "4", "-n", "40", "--json", "--no-repetition-guard", POEM)
    plain, xtc = (json.loads(run_cli("run", *extra, *sampled).stdout)["text"] for extra in ((), ("--xtc-probability", "1")))
    assert plain != xtc  # XTC excluded the likeliest tokens


def test_the_loop_detector_needs_an_exact_repeat_over_a_long_enough_span():
    from llmcli.answer.generation import LOOP_SPAN, looping

    line = list(range(100, 120))  # a 20-token "line"
    assert looping([1, 2, 3] + line * 4)  # 80 tokens of one line repeated
    assert not looping([1, 2, 3] + line * 2)  # twice is not a loop (a refrain)
    assert not looping(list(range(500)))  # no repeat
    assert looping([7] * LOOP_SPAN) and not looping([7] * (LOOP_SPAN - 1))
    almost = (line * 4)[:-1] + [999]  # the last token breaks the repeat
    assert not looping(almost)


def test_the_repetition_guard_never_cuts_a_tool_call_into_invalid_json():
    """Issue 60: a forced call asked to write "la" 300 times ended `stop` (`end_turn`) with an unterminated string: the
    guard cut it. Inside a call it leaves the call to its grammar and -n (a limit cut is said as one: `length`);
    outside one it still stops a loop."""
    from llmcli.answer.generation import Answer, GenerationOptions
    from llmcli.answer.sampling_config import SamplingConfig
    from llmcli.answer.tool_calls import Tool, ToolSpec

    tools = ToolSpec((Tool("write", "Write a text.", '{"type": "object", "properties": {"text": {"type": "string"}}}'),))
    looped = {}
    for opening in ('<tool_call>{"name": "write", "arguments": {"text": "', "Sure: "):
        answer = Answer(GenerationOptions(SamplingConfig(), max_tokens=400, tools=tools), 10, 4096)
        pieces = [opening.encode()] + [b"la "] * 399
        for token, piece in enumerate(pieces):
            answer.add(1000 if token else 1, False, piece)  # (the same token over and over after the opening)
            if answer.finish is not None:
                break
        looped[opening[:5]] = (answer.finish, answer.n_out)
    assert looped["<tool"] == ("length", 400)  # the call runs on to -n: cut, and said so (never a parsed "stop")
    assert looped["Sure:"][0] == "repetition" and looped["Sure:"][1] < 120


def test_n_minus_one_means_until_the_context_is_full():
    full = json.loads(run_cli("run", "-c", "64", "-n", "-1", "--no-repetition-guard", "--temp", "0", "--json", "--grammar", 'root ::= ("a "){400}',
                              "hi").stdout)
    assert full["finish_reason"] == "context_full"
    zero = run_cli("run", "-n", "0", "hi")
    assert zero.code == 2 and "or -1, or no -n" in zero.stderr
    chat = run_cli("chat", "--no-save", "-n", "5", input="/set max_tokens -1\n/show\n")
    assert chat.code == 0 and "--max-tokens = none" in chat.stderr and "max_tokens=none" in chat.stderr


def test_an_answer_cut_mid_character_ends_without_a_replacement_character():
    grammar = 'root ::= "克斯的猫很可爱"'  # forced (any CPU): byte tokens, so -n cuts inside a character
    seen = set()
    for n in (1, 2, 3, 4):
        result = run_cli("run", "--temp", "0", "-n", str(n), "--grammar", grammar, "写一句话")
        assert result.code == 0, result.stderr
        assert "\ufffd" not in result.stdout
        record = json.loads(run_cli("run", "--temp", "0", "-n", str(n), "--json", "--grammar", grammar, "写一句话").stdout)
        assert "\ufffd" not in record["text"] and "克斯的猫很可爱".startswith(record["text"])
        seen.add(record["text"])
    assert "" in seen and "克" in seen  # a cut inside the first character, and one after it


def _hint(result) -> str:
    assert result.code == 6, result.stderr
    return result.stderr


def test_overflow_hints_name_the_cause_and_a_fix_that_works():
    huge = _hint(run_cli("run", "-q", input="word " * 20000))  # more than the model was trained on
    assert "reads at most 8192" in huge and "--on-overflow truncate" in huge
    assert all(int(n) <= 8192 for n in re.findall(r"--ctx-size (\d+)", huge)), huge
    long = _hint(run_cli("run", "-q", "-c", "256", input="word " * 600))  # fits a larger context
    assert "--ctx-size 1024 (the model was trained on 8192)" in long and "--on-overflow truncate" in long
    too_many = _hint(run_cli("run", "-q", "-c", "256", "-n", "100000", "--on-overflow", "truncate", "hi"))
    assert "-n 100000 does not fit" in too_many and "--on-overflow" not in too_many, too_many  # -n is the cause
    assert "even an empty message" not in too_many and "-n 2" in too_many  # "-n 2xx or less"
    capped = run_cli("run", "-c", "256", "-n", "100000", "--json", "--logit-bias", "2=-inf",  # (2: SmolLM2's end)
                     "word " * 200)  # (a long prompt: little room left to decode)
    assert capped.code == 0, capped.stderr  # -n past the room left: capped to it, with a notice (not an error)
    room = int(re.search(r"-n 100000 is more than the context has left after the prompt: the answer stops at (\d+) "
                         "tokens", capped.stderr).group(1))
    record = json.loads(capped.stdout)
    assert record["usage"]["prompt_tokens"] + room == 256 and record["usage"]["completion_tokens"] <= room
    cut = run_cli("run", "-q", "-c", "256", "-n", "4", "--on-overflow", "truncate", input="word " * 200000)
    assert cut.code == 0 and "input truncated" in cut.stderr, cut.stderr  # 1 MB: cut before the template sees it


def test_a_context_beyond_the_training_context_warns(smollm2: Path):
    result = run_cli("run", "-c", "9000", "-n", "1", "hi")  # SmolLM2 was trained on 8192
    assert result.code == 0, result.stderr
    assert "exceeds the 8192 this model was trained on" in result.stderr
