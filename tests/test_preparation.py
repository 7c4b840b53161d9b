"""One answer preparation (issue 35): settings become GenerationOptions in one place, and what follows from a rendered
prompt (a think block the template opened, a reasoning model thinking before a forced call) is decided in one place,
for run, the warm path and serve alike. `serve --special` once dropped control tokens that `run --special` kept."""

from __future__ import annotations

import json

from conftest import HTTP, run_cli, start_server, stop_server

from llmcli.answer.generation import GenerationOptions
from llmcli.answer.sampling_config import SamplingConfig
from llmcli.answer.tool_calls import tool_spec
from llmcli.config.settings import SETTINGS

MARKED = 'root ::= "<start_of_image>Paris"'  # a control token's text, forced: --special shows it, else it is dropped


def test_special_keeps_control_tokens_in_run_the_warm_run_and_serve(gemma3, tmp_path):
    args = ("-m", str(gemma3), "--raw", "--special", "--temp", "0", "-n", "8", "--grammar", MARKED)
    here = run_cli("run", *args, "The capital of France is")
    warm = run_cli("run", "--keep-alive", "30s", *args, "The capital of France is",
                   env={"LLMCLI_RUNTIME_DIR": str(tmp_path / "rt")})
    run_cli("stop", env={"LLMCLI_RUNTIME_DIR": str(tmp_path / "rt")})
    proc, url = start_server(tmp_path, "-m", str(gemma3), "--special", "-c", "256")
    try:
        served = HTTP.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                            "temperature": 0, "grammar": MARKED}, timeout=60).json()
    finally:
        stop_server(proc)
    assert here.code == 0 and warm.code == 0, (here.stderr, warm.stderr)
    assert here.stdout.strip() == warm.stdout.strip() == served["choices"][0]["text"] == "<start_of_image>Paris"


def test_settings_become_options_in_one_place_and_the_prompt_decides_the_rest():
    values = {name: setting.default for name, setting in SETTINGS.items()} | {"special": True, "stop": ["END"],
                                                                              "max_tokens": 7}
    options = GenerationOptions.from_settings(values, SamplingConfig(temp=0), max_draft=4)
    assert (options.special, options.stops, options.max_tokens, options.max_draft) == (True, ("END",), 7, 4)
    tools = tool_spec([{"name": "f", "parameters": {"type": "object"}}], "required", "hermes")
    asked = GenerationOptions.from_settings(values, SamplingConfig(), tools=tools)
    reasoning = asked.for_prompt("<|im_start|>assistant\n<think>\n", "{% if x %}<think>{% endif %}")
    assert reasoning.thinking_open and reasoning.tools is not None and reasoning.tools.think_first
    plain = asked.for_prompt("<|im_start|>assistant\n", "no thinking here")
    assert not plain.thinking_open and plain.tools is not None and not plain.tools.think_first
    not_split = GenerationOptions.from_settings(values | {"reasoning": "stdout"}, SamplingConfig())
    assert not not_split.for_prompt("<think>\n", "<think>").thinking_open  # --reasoning stdout: all of it is the answer


def test_control_tokens_are_left_out_of_the_answer_unless_special(gemma3):
    args = ("run", "-m", str(gemma3), "--raw", "--temp", "0", "-n", "5", "--grammar",
            'root ::= "<start_of_image><strong>Paris"', "The capital of France:")
    plain = json.loads(run_cli(*args, "--json").stdout)
    assert plain["text"] == "<strong>Paris" and plain["usage"]["completion_tokens"] == 3  # (<strong> is text: HTML)
    assert run_cli(*args, "-q", "--special").stdout == "<start_of_image><strong>Paris\n"
