"""Reasoning models' `<think>` blocks: told apart from the answer as it streams, and routed by --reasoning.

No reasoning model is small enough for the suite, so SmolLM2's output is forced into the shapes reasoning
models produce with a grammar, and a chat template opens the think block itself as Qwen3-style templates do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HTTP, run_cli, run_in_terminal, start_server, stop_server
from hypothesis import given
from hypothesis import strategies as st

from llmcli.answer.reasoning import ReasoningSplitter, opens_thinking

THINK_THEN_ANSWER = 'root ::= "<think>" [a-z ]{5,30} "</think>" [A-Z .!]{3,30}'  # thinking in lower, answer in upper case
GREEDY = ("--temp", "0", "-n", "60")

# A chat template that opens the think block for the model (Qwen3's convention), or closes it at once
# with enable_thinking false.
THINKING_TEMPLATE = (Path(__file__).parent / "data" / "thinking-chatml.jinja").read_text()


def split_whole(text: str, open_at_start: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(open_at_start)
    reasoning, answer = splitter.feed(text)
    tail_reasoning, tail_answer = splitter.finish()
    return reasoning + tail_reasoning, answer + tail_answer


@pytest.mark.parametrize("text, open_at_start, expected", [
    ("<think>plan</think>\n\nThe answer.", False, ("plan", "The answer.")),
    ("  \n<think>\nplan\n</think>answer", False, ("plan\n", "answer")),
    ("plan</think>answer", True, ("plan", "answer")),  # the template opened it: no opening tag in the output
    ("Answer first <think>not a block</think>", False, ("", "Answer first <think>not a block</think>")),
    ("<think>still thinking when -n hit", False, ("still thinking when -n hit", "")),
    ("<think>a</think>```\n<think>code</think>\n```", False, ("a", "```\n<think>code</think>\n```")),
    ("  leading spaces kept", False, ("", "  leading spaces kept")),
    ("<thin", False, ("", "<thin")),  # ended before it became a tag: it is text
    ("<think>x</thi", False, ("x</thi", "")),
    ("", False, ("", "")),
])
def test_splitter_cases(text, open_at_start, expected):
    assert split_whole(text, open_at_start) == expected


@given(st.text(alphabet="<>/thinkab \n", max_size=40), st.lists(st.integers(1, 6), max_size=40), st.booleans())
def test_splitting_does_not_depend_on_how_the_text_is_cut(text, cuts, open_at_start):
    """Tags split across tokens: any chunking gives what the whole text gives."""
    splitter = ReasoningSplitter(open_at_start)
    reasoning = answer = ""
    position = 0
    for size in cuts:
        r, a = splitter.feed(text[position : position + size])
        reasoning, answer, position = reasoning + r, answer + a, position + size
    r, a = splitter.feed(text[position:])
    tail_r, tail_a = splitter.finish()
    assert (reasoning + r + tail_r, answer + a + tail_a) == split_whole(text, open_at_start)


def test_reasoning_is_reported_once_when_one_piece_holds_its_end_and_the_answer():
    from llmcli.answer.generation import Answer, GenerationOptions
    from llmcli.answer.stats import Stats

    answer = Answer(GenerationOptions(), 0, 1000)
    pieces = [b"<think>", b"plan</think>The", b" answer", b"."]
    events = [event for i, piece in enumerate(pieces) for event in answer.add(i, False, piece)] + list(answer.close())
    assert "".join(e.text for e in events if not e.reasoning) == "The answer."
    assert [e.text for e in events if e.reasoning] == ["plan"]  # once, from the piece that ends it
    done = answer.done("stop", Stats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    assert (done.text, done.reasoning) == ("The answer.", "plan")  # the Done carries the whole answer


def test_a_prompt_that_ends_in_an_open_think_block_is_recognised():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def answer(*args: str) -> dict:
    result = run_cli("run", "--json", *GREEDY, *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_json_carries_reasoning_and_answer_apart_and_stdout_carries_the_answer_only():
    record = answer("--grammar", THINK_THEN_ANSWER, "Say hi")
    assert record["reasoning"] and record["text"].strip()
    assert "<think>" not in record["text"] and "</think>" not in record["text"]
    piped = run_cli("run", *GREEDY, "--grammar", THINK_THEN_ANSWER, "Say hi")  # default: show, but piped
    assert piped.stdout.strip() == record["text"].strip()
    assert record["reasoning"] not in piped.stdout + piped.stderr
    to_stderr = run_cli("run", *GREEDY, "--reasoning", "stderr", "--grammar", THINK_THEN_ANSWER, "Say hi")
    assert to_stderr.stdout.strip() == record["text"].strip() and record["reasoning"] in to_stderr.stderr
    kept = run_cli("run", *GREEDY, "--reasoning", "stdout", "--grammar", THINK_THEN_ANSWER, "Say hi")
    assert kept.stdout.startswith("<think>") and f"{record['reasoning']}</think>" in kept.stdout
    hidden = run_cli("run", *GREEDY, "--reasoning", "hide", "--grammar", THINK_THEN_ANSWER, "Say hi")
    assert hidden.stdout == piped.stdout and record["reasoning"] not in hidden.stderr
    no_think = answer("Say hi")  # a model that does not think: no reasoning, the same record shape
    assert no_think["reasoning"] is None and no_think["text"]


def test_on_a_terminal_the_thinking_is_shown_before_the_answer():
    shown = run_in_terminal(["run", *GREEDY, "--grammar", THINK_THEN_ANSWER, "Say hi"], {}).decode()
    record = answer("--grammar", THINK_THEN_ANSWER, "Say hi")
    assert record["reasoning"] in shown and record["text"].strip() in shown
    assert shown.index(record["reasoning"]) < shown.rindex(record["text"].strip())
    assert "<think>" not in shown


def test_n_counts_the_thinking_and_an_unterminated_block_is_all_reasoning():
    record = answer("-n", "12", "--grammar", THINK_THEN_ANSWER, "Say hi")  # "<think>" alone takes ~7 tokens here
    assert record["finish_reason"] == "length" and record["usage"]["completion_tokens"] == 12
    assert record["reasoning"] and record["text"] == ""


def test_stop_sequences_apply_to_the_answer_not_the_thinking():
    record = answer("--grammar", THINK_THEN_ANSWER, "Say hi")
    thought = record["reasoning"].split()[0]
    unstopped = answer("--stop", thought, "--grammar", THINK_THEN_ANSWER, "Say hi")
    assert unstopped["reasoning"] == record["reasoning"] and unstopped["text"] == record["text"]
    assert unstopped["finish_reason"] != "stop_sequence"
    word = record["text"].strip().split()[-1]
    stopped = answer("--stop", word, "--grammar", THINK_THEN_ANSWER, "Say hi")
    assert stopped["reasoning"] == record["reasoning"]
    assert stopped["finish_reason"] == "stop_sequence" and stopped["text"] == record["text"][: record["text"].index(word)]


def test_think_tags_inside_the_answer_stay_in_the_answer():
    grammar = 'root ::= "<think>" [a-z ]{3,10} "</think>" "```" "<think>" [a-z]{1,5} "</think>" "```"'
    record = answer("--grammar", grammar, "Write code")
    assert record["reasoning"] and record["text"].startswith("```<think>") and record["text"].endswith("</think>```")


def test_a_template_that_opens_the_block_and_think_switches_it(tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    opened = answer("--chat-template-file", str(template), "--grammar", 'root ::= [a-z ]{5,30} "</think>" [A-Z .!]{3,30}',
                    "Say hi")
    assert opened["reasoning"] and opened["text"] and "</think>" not in opened["text"]
    off = run_cli("run", "--show-prompt", "--no-think", "--chat-template-file", str(template), "Say hi")
    assert off.stdout.rstrip().endswith("<think>\n\n</think>")
    on = run_cli("run", "--show-prompt", "--think", "--chat-template-file", str(template), "Say hi")
    assert on.stdout.rstrip().endswith("<think>")
    plain = answer("--no-think", "--chat-template-file", str(template), "Say hi")
    assert plain["reasoning"] is None and plain["text"]
    counted = run_cli("count", "--json", "--chat", "--no-think", "--chat-template-file", str(template), "Say hi")
    assert json.loads(counted.stdout)["total"] == plain["usage"]["prompt_tokens"]


def test_think_on_a_template_without_the_switch_is_a_notice_not_an_error():
    result = run_cli("run", *GREEDY, "--no-think", "-n", "4", "Say hi")
    assert result.code == 0 and "no thinking switch" in result.stderr


def test_batch_and_chat_records_carry_reasoning_apart(tmp_path, isolated_env):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi\nSay bye\n")
    batch = run_cli("run", "--batch", str(prompts), *GREEDY, "--grammar", THINK_THEN_ANSWER, "-q")
    records = [json.loads(line) for line in batch.stdout.splitlines()]
    assert len(records) == 2 and all(r["reasoning"] and "<think>" not in r["text"] for r in records)
    chat = run_cli("chat", *GREEDY, "--grammar", THINK_THEN_ANSWER, "-q", input="Say hi\n")
    assert chat.code == 0, chat.stderr
    from llmcli import paths
    from llmcli.store.answer_log import AnswerLog

    with AnswerLog(paths.answer_log_file()) as log:
        ((conversation, _),) = log.conversations()
        exchange = log.events(conversation)[1]
    assert exchange["reasoning"] == records[0]["reasoning"] and exchange["text"] == records[0]["text"]
    assert "<think>" not in chat.stdout


# SmolLM2's "</" and its end of turn: the model never closes the think block itself, nor ends the answer inside it
NO_CLOSE = ("--logit-bias", "9617=-inf", "--logit-bias", "2=-inf")


def test_a_think_budget_closes_the_block_and_the_answer_follows_in_run_the_warm_run_and_serve(tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)  # opens the think block: all the output is thinking until it closes
    args = ("--chat-template-file", str(template), *GREEDY, "-n", "30", *NO_CLOSE)
    unbounded = answer(*args, "Say hi")
    assert unbounded["text"] == "" and unbounded["usage"]["reasoning_tokens"] == 30  # it never stops thinking
    bounded = answer(*args, "--think-budget", "8", "Say hi")
    assert 8 <= bounded["usage"]["reasoning_tokens"] <= 8 + 5  # 8 of thinking, then the closing tag's tokens
    assert bounded["reasoning"] and bounded["text"].strip() and "</think>" not in bounded["text"]
    assert bounded["reasoning"] == unbounded["reasoning"][: len(bounded["reasoning"])].rstrip()
    runtime = {"LLMCLI_RUNTIME_DIR": str(tmp_path / "rt")}
    warm = run_cli("run", "--keep-alive", "30s", "--json", *args, "--think-budget", "8", "Say hi", env=runtime)
    run_cli("stop", env=runtime)
    assert warm.code == 0, warm.stderr
    assert {k: json.loads(warm.stdout)[k] for k in ("text", "reasoning")} == {k: bounded[k] for k in ("text", "reasoning")}
    proc, url = start_server(tmp_path, "--chat-template-file", str(template), "-c", "512")
    try:
        body = {"max_tokens": 30, "temperature": 0, "messages": [{"role": "user", "content": "Say hi"}]}
        openai = HTTP.post(f"{url}/v1/chat/completions", timeout=60,
                             json={**body, "think_budget": 8, "logit_bias": {"9617": -100, "2": -100}}).json()
        anthropic = HTTP.post(f"{url}/v1/messages", timeout=60, json={
            **body, "thinking": {"type": "enabled", "budget_tokens": 8}}).json()
    finally:
        stop_server(proc)
    message = openai["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] and openai["timings"]["reasoning_tokens"] <= 13
    assert anthropic["usage"]["output_tokens"] >= 1 and anthropic["content"][0]["type"] == "thinking"


def test_effort_levels_are_thinking_budgets():
    from llmcli.serve.request_fields import think_budget_of

    assert [think_budget_of(level) for level in ("minimal", "low", "medium", "high", True, None)] == [
        {"think_budget": 256}, {"think_budget": 1024}, {"think_budget": 4096}, {}, {}, {}]
