"""MCP (issue 25): tools from servers the tests write with the official SDK — a stdio one and a Streamable HTTP one on
127.0.0.1 — through `run`, `llmcli mcp list` and `mcp call`; faults (a server that will not start, a call past its
timeout, a server killed mid-call, Ctrl-C during a call); after each, no server process is left (by pid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ctrl_c_when, free_port, run_cli, wait_for_port

from llmcli import reaper

SERVER = Path(__file__).parent / "data" / "mcp_server.py"


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[Path]:
    """The file each server writes its pid to; after the test, none of them may be running."""
    path = tmp_path / "pids"
    yield path
    started = [int(line) for line in path.read_text().split()] if path.exists() else []
    deadline = time.monotonic() + 5
    while any(reaper.alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if reaper.alive(pid)], "an MCP server outlived llmcli"


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """One HTTP MCP server for the module's tests (the tests' own: not among the `pids` that must end with llmcli)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_port(port, proc, timeout=30)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=10)


def _config(tmp_path: Path, pids: Path, **servers: dict) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def _stdio(pids: Path, **extra: object) -> dict:
    return {"command": sys.executable, "args": [str(SERVER), "stdio"], "env": {"MCP_PID_FILE": str(pids)}, **extra}


def test_mcp_list_shows_each_server_its_state_and_tools(tmp_path, pids, http_server):
    garbage = {"command": sys.executable, "timeout": 1, "args": [
        "-c", f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); print('not json', flush=True); "
        "time.sleep(60)"]}
    config = _config(tmp_path, pids, local=_stdio(pids, tools=["shout", "add"]), remote={"url": http_server},
                     broken={"command": str(tmp_path / "no-such-server")}, garbage=garbage)
    result = run_cli("mcp", "list", "--mcp", str(config), "--json")
    assert result.code == 1, result.stderr  # every server listed; two failed: exit 1
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["local"]["state"] == "running"
    assert [t["name"] for t in rows["local"]["tools"]] == ["local_shout", "local_add"]  # the allow-list
    assert rows["remote"]["state"] == "running" and "remote_hang" in [t["name"] for t in rows["remote"]["tools"]]
    assert rows["broken"]["state"] == "failed" and rows["broken"]["error"]
    assert rows["garbage"]["state"] == "failed" and "did not start within 1 s" in rows["garbage"]["error"]
    table = run_cli("mcp", "list", "--mcp", str(_config(tmp_path, pids, local=_stdio(pids, tools=["shout"]),
                                                       broken={"command": str(tmp_path / "no-such-server")})))
    assert "local  running" in table.stdout and "broken  failed" in table.stdout


def test_mcp_call_and_its_faults(tmp_path, pids, http_server):
    config = _config(tmp_path, pids, local=_stdio(pids), remote={"url": http_server})
    shouted = run_cli("mcp", "call", "local", "shout", '{"text": "hi"}', "--mcp", str(config))
    assert shouted.code == 0 and shouted.stdout == "HI!\n"
    assert run_cli("mcp", "call", "remote", "add", '{"a": 2, "b": 3}', "--mcp", str(config)).stdout == "5\n"
    picture = run_cli("mcp", "call", "local", "picture", "--mcp", str(config))
    assert picture.stdout.startswith("[image: image/png")  # described, not dumped
    started = time.monotonic()
    hung = run_cli("mcp", "call", "local", "hang", '{"seconds": 30}', "--tool-timeout", "1", "--mcp", str(config))
    assert hung.code == 1 and "did not answer within 1 s" in hung.stdout and time.monotonic() - started < 20
    killed = run_cli("mcp", "call", "local", "die", '{"code": 3}', "--mcp", str(config))
    assert killed.code == 1 and "failed" in killed.stdout and "Traceback" not in killed.stderr


def test_run_calls_an_mcp_tool_and_its_result_reaches_the_model(tmp_path, pids, http_server):
    config = _config(tmp_path, pids, local=_stdio(pids, tools=["shout"]), remote={"url": http_server, "tools": ["shout"]},
                     broken={"command": str(tmp_path / "no-such-server")})  # (two tools: a short prompt to prefill)
    for tool in ("local_shout", "remote_shout"):
        # (the tool's string is bounded, 24 characters: SmolLM2's greedy call repeats "hello" to any -n on an
        # AVX-512 CPU, in process and on a warm slot alike: issue 57; -n is the room that bound allows)
        result = run_cli("run", "--mcp", str(config), "--tool-choice", tool, "--tools-debug", "--temp", "0", "-n", "256",
                         "--chain-limit", "1", "--json", "Shout hello.")
        assert result.code == 0, result.stderr
        assert "MCP server broken:" in result.stderr and "going on without it" in result.stderr
        call = json.loads(result.stdout)["tool_calls"][0]
        assert call["name"] == tool and not call["result_is_error"]
        assert call["result"] == json.loads(call["arguments"])["text"].upper() + "!"
        assert f"<tool_response>\n{call['result']}\n</tool_response>" in result.stderr.split("next prompt ends: …")[1]
    only = run_cli("run", "--mcp", str(config), "--mcp-server", "local", "--tool-choice", "remote_shout", "hi")
    assert only.code == 2 and "remote_shout" in only.stderr  # --mcp-server: the other servers are not used


def test_ctrl_c_during_an_mcp_call_stops_it_and_its_server(tmp_path, pids):
    config = _config(tmp_path, pids, local=_stdio(pids, tools=["hang"]))
    code, err = ctrl_c_when(["run", "--mcp", str(config), "--tool-choice", "local_hang", "--tools-debug", "--temp", "0",
                             "-n", "40", "Wait."], b"tool call local_hang(")
    assert code == 130 and b"Traceback" not in err


def test_the_mcp_package_is_not_imported_unless_mcp_is_used():
    imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmcli", "run", "--help"],
                              capture_output=True, text=True, timeout=60).stderr
    modules = {line.split("|")[-1].strip().split(".")[0] for line in imported.splitlines() if "|" in line}
    assert "mcp" not in modules and "llmcli" in modules


def test_chat_keeps_its_servers_for_the_session_and_lists_their_tools(tmp_path, pids):
    config = _config(tmp_path, pids, local=_stdio(pids, tools=["shout"]))
    result = run_cli("chat", "--mcp", str(config), "--no-save", "-q", input="/tools\n/tools\n")
    assert result.code == 0, result.stderr
    assert result.stderr.count("local_shout") == 2 and "Upper-case a text." in result.stderr


def test_a_named_reaper_is_found_by_its_name_and_ends_its_tree_when_told():
    """What ends a hung MCP server at once (its call timed out, or it did not start in time): llmcli finds the reaper
    it started for that server among its children by name, and its SIGTERM ends the server's whole tree — a child
    that ignores SIGTERM too, SIGKILLed after the reaper's grace."""
    stubborn = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
               "subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(reaper.command(os.getpid(), [sys.executable, "-c", stubborn], "server-a"),
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        tree = reaper.descendants(proc.pid)
        assert len(tree) == 2 and reaper.named("server-a") == [proc.pid] and reaper.named("server-b") == []
        reaper.end_named("server-b")  # another server's name: nothing happens
        assert proc.poll() is None
        reaper.end_named("server-a")
        assert proc.wait(timeout=30) == 143 and not [pid for pid in tree if reaper.alive(pid)]
    finally:  # (a failure before the end: the tree is ended as llmcli ends it, then the reaper)
        reaper.end_named("server-a")
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
