"""`llmcli launch AGENT` (issue 36): the model's server started once and reused, the agent configured the way it
expects and run in the foreground. The agents themselves come from npm and are tried by hand (the closing notes);
here a stand-in on PATH plays the agent with the official SDK, so what `launch` gives an agent is what is tested."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

CTX = "24576"  # what Claude Code's prompt and answers need (23,496 tokens), rounded up: a small KV cache

STAND_IN = textwrap.dedent('''\
    #!{python}
    """A stand-in for Claude Code: what `llmcli launch claude` gives it, and one answer through the Anthropic SDK."""
    import json, os, sys
    import anthropic

    client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"],
                                 auth_token=os.environ["ANTHROPIC_AUTH_TOKEN"], api_key=None, max_retries=0)
    reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=4,
                                   messages=[{{"role": "user", "content": sys.argv[-1]}}])
    print(json.dumps({{"args": sys.argv[1:], "url": os.environ["ANTHROPIC_BASE_URL"],
                      "model": os.environ["ANTHROPIC_MODEL"], "api_key": os.environ["ANTHROPIC_API_KEY"],
                      "stop_reason": reply.stop_reason, "tokens": reply.usage.output_tokens}}))
    ''')


@pytest.fixture
def agents(tmp_path: Path):
    """A PATH with a stand-in `claude` (and nothing else of the agents'); every launch server stopped after."""
    folder = tmp_path / "bin"
    folder.mkdir()
    claude = folder / "claude"
    claude.write_text(STAND_IN.format(python=sys.executable))
    claude.chmod(0o755)
    yield {"PATH": f"{folder}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    from llmcli.pipeline import launch

    run_cli("stop")
    for _, state in launch.running():  # (should `stop` have failed: nothing a test starts outlives it)
        os.kill(int(state["pid"]), signal.SIGKILL)


def test_an_unknown_agent_one_not_installed_and_a_model_too_small_are_one_line_errors(agents):
    unknown = run_cli("launch", "cursor")
    assert unknown.code == 2 and "no agent 'cursor'" in unknown.stderr and "claude, codex, opencode, aider" in unknown.stderr
    missing = run_cli("launch", "codex", "-m", "smollm2", env=agents)
    assert missing.code == 3, missing.stderr
    assert missing.stderr.splitlines()[0] == "Error: Codex is not installed (codex is not on PATH)"
    assert "npm install -g @openai/codex" in missing.stderr
    small = run_cli("launch", "claude", "-m", "smollm2", env=agents)
    assert small.code == 6, small.stderr  # SmolLM2 was trained on 8192 tokens: Claude Code's prompt is ~19,400
    assert "smollm2's trained context (8192 tokens) cannot hold Claude Code's prompt" in small.stderr
    assert "Traceback" not in small.stderr and "launch-" not in run_cli("ps").stdout  # nothing was started


@pytest.mark.long
def test_launch_runs_the_agent_on_its_model_s_server_and_the_next_launch_reuses_it(agents, gemma3):
    first = run_cli("launch", "claude", "-m", "gemma3-270m", "-c", CTX, "--", "-p", "Say hi", env=agents)
    assert first.code == 0, first.stderr
    told = json.loads(first.stdout)
    assert told["args"] == ["-p", "Say hi"] and told["model"] == "gemma3-270m" and told["api_key"] == ""
    assert told["url"].startswith("http://127.0.0.1:") and told["stop_reason"] in ("max_tokens", "end_turn")  # (the
    # model's words are its own: an answer came back through the launched server, whatever it says)
    assert f"Claude Code on gemma3-270m at {told['url']} (context {CTX} tokens" in first.stderr
    again = json.loads(run_cli("launch", "claude", "-m", "gemma3-270m", "-c", CTX, "--", "again", env=agents).stdout)
    assert again["url"] == told["url"]  # the same server, warm
    listed = run_cli("ps", "--json")
    (server,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert server["socket"] == told["url"] and server["model"] == "gemma3-270m"

    # --config: what each agent would be given, from the same server; nothing launched
    codex = run_cli("launch", "codex", "-m", "gemma3-270m", "-c", CTX, "--config", env=agents)
    assert codex.code == 0, codex.stderr
    key_line, command = codex.stdout.splitlines()
    assert key_line.startswith("LLMCLI_LAUNCH_KEY=llmcli-")
    assert f'base_url = "{told["url"]}/v1", wire_api = "responses"' in command and command.endswith("-m gemma3-270m")
    opencode = run_cli("launch", "opencode", "-m", "gemma3-270m", "-c", CTX, "--config", env=agents).stdout
    config = json.loads(shlex.split(opencode.splitlines()[0])[0].split("=", 1)[1])  # as a shell reads the line
    assert config["provider"]["llmcli"]["options"]["baseURL"] == f"{told['url']}/v1"
    assert config["model"] == "llmcli/gemma3-270m"
    aider = run_cli("launch", "aider", "-m", "gemma3-270m", "-c", CTX, "--config", env=agents).stdout
    assert f"--openai-api-base {told['url']}/v1 --model openai/gemma3-270m" in aider

    stopped = run_cli("stop")
    assert stopped.code == 0 and "stopped gemma3-270m" in stopped.stderr
    assert run_cli("ps", "--json").stdout.strip() == ""


def test_a_keep_alive_that_is_not_a_duration_is_refused_before_anything_starts(agents):
    refused = run_cli("launch", "claude", "--keep-alive", "soon", env=agents)
    assert refused.code == 2 and "--keep-alive must be a duration" in refused.stderr
    assert run_cli("ps", "--json").stdout.strip() == ""
