"""Hostile input (issue 34): no request, file or neighbour can crash, exhaust or subvert llmcli. Each finding of the trial
as a test — requests only to the test's own server on 127.0.0.1, each loop bounded — and a seeded fuzz test of every
answering route (LLMCLI_FUZZ_EXAMPLES=N runs it longer)."""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import HTTP, run_cli, spawn_cli, start_server, stop_server
from gguf_tools import rewrite_metadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocols import SHAPES, assert_shape

from llmcli import reaper

KEY = "hostile-key"
HI = [{"role": "user", "content": "hi"}]
DEEP_GRAMMAR = "root ::= " + "(" * 30000 + '"a"' + ")" * 30000
LONG_STRING = {"type": "string", "maxLength": 30000}  # the 130-byte request's schema


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A server whose answers are short whatever a request asks (-n 8, --max-answer 16): the fuzz test stays bounded."""
    proc, url = start_server(tmp_path_factory.mktemp("hostile"), "-P", "2", "-c", "1024", "--temp", "0", "-n", "8",
                             "--max-answer", "16", "--api-key", KEY, "--max-connections", "8")
    yield proc, url
    stop_server(proc)


def post(url: str, path: str, body: object, headers: dict[str, str] | None = None, timeout: float = 60) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(f"{url}{path}", content=content, timeout=timeout,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})})


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- 1, 2: grammars: flat repetition, limits before llama.cpp's parser, memory back -----------------------------------


def test_a_long_max_length_is_a_flat_repetition_not_groups_nested_30000_deep():
    from llmcli.answer.grammar_limits import grammar_problem
    from llmcli.llama.schema_grammar import schema_to_gbnf

    gbnf = schema_to_gbnf({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30000}, "tags": {"type": "array", "items": {"type": "string"},
                                                                 "minItems": 2, "maxItems": 1500},
        "code": {"type": "string", "pattern": "^[a-z]{3,900}$"}}})
    assert "char{0,2000}" not in gbnf and "char*" in gbnf  # beyond llama.cpp's cap: unbounded, checked afterwards
    assert '("," space string){1,1499}' in gbnf and "{3,900}" in gbnf
    assert grammar_problem(gbnf) is None and gbnf.count("(") < 100


def test_run_json_schema_of_a_long_string_answers_and_a_deep_grammar_is_a_usage_error(tmp_path):
    result = run_cli("run", "--json", "-n", "4", "--temp", "0", "--json-schema", json.dumps(LONG_STRING), "hi")
    assert result.code in (0, 8), result.stderr  # 8: cut off by -n, not valid JSON yet; never 139
    assert json.loads(result.stdout)["finish_reason"] in ("length", "stop")  # (the model may close the string)
    deep = tmp_path / "deep.gbnf"
    deep.write_text(DEEP_GRAMMAR)
    refused = run_cli("run", "-n", "4", "--grammar-file", str(deep), "hi")
    assert refused.code == 2 and refused.stderr.startswith("Error: --grammar-file: the grammar is too large for "
                                                           "llama.cpp: groups nested more than 64 deep"), refused.stderr
    huge = run_cli("run", "-n", "4", "--json-schema", '{"type":"string","minLength":100000000}', "hi")
    assert huge.code == 2 and "at least 100000000" in huge.stderr and "Traceback" not in huge.stderr


AMBIGUOUS = 'root ::= r\nr ::= "a" r "b" | "a" r "c" | ""'  # 2^n parse stacks after n a's; llama.cpp dedups pairwise


@pytest.mark.in_process  # (a warm server's own stall: issue 58)
def test_a_signal_ends_run_while_llama_cpp_does_not_return():
    """A grammar whose parse stacks multiply with each `a` (forced, four a token) keeps llama.cpp's sampler from
    returning for minutes, and a signal's handler runs only once it returns: llmcli's watcher hears the signal and
    ends the process 3 s later (no static limit sees such a grammar: it is 46 bytes). SIGTERM and Ctrl-C, at once."""
    signals = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
    runs = {signum: spawn_cli("run", "-n", "64", "--temp", "0", "--logit-bias", "aaaa=100", "--grammar", AMBIGUOUS,
                              "go") for signum in signals}
    ended = {}
    try:
        shown = {signum: _inside_the_fourth_token(proc) for signum, proc in runs.items()}
        for signum, proc in runs.items():
            proc.send_signal(signum)
        ended = {signum: proc.communicate(timeout=60) for signum, proc in runs.items()}
        ended = {signum: (shown[signum] + out, err) for signum, (out, err) in ended.items()}
    finally:
        for proc in runs.values():
            proc.kill()
            proc.wait()
    for signum, (out, err) in ended.items():
        assert runs[signum].returncode == 128 + signum, err
        assert out.startswith(b"aaaa") and b"Traceback" not in err, err
        assert f"llama.cpp did not return within 3 s of {signals[signum]}".encode() in err, err


def test_serve_s_log_keeps_bugs_but_not_uvicorn_s_words_for_answers_cut_when_the_grace_is_up():
    """`serve` with such a request: SIGTERM ends it after its grace (+ 10 s, its own line says so); uvicorn cancels the
    stuck answer on the way and logged that as an ASGI traceback. (Checked by hand — 11 s, a clean log; too slow and
    too hot a test for the suite: the engine burns a core meanwhile.)"""
    import asyncio
    import logging

    from llmcli.cli.serve_cmd import not_a_shutdown_cut

    def record(message: str, error: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, (),
                                 (type(error), error, None) if error else None)

    assert not not_a_shutdown_cut(record("Exception in ASGI application", asyncio.CancelledError("cancelled")))
    assert not not_a_shutdown_cut(record("Cancel 1 running task(s), timeout graceful shutdown exceeded"))
    assert not_a_shutdown_cut(record("Exception in ASGI application", ValueError("a bug")))
    assert not_a_shutdown_cut(record("Invalid HTTP request received."))


def _inside_the_fourth_token(proc: Any) -> bytes:
    """What the run printed once its three forced tokens are out (`aaaa` each) and it has used 0.3 s more of CPU: it is
    inside the fourth token, which takes minutes (its sampler does not return; its first three take 0.3-1.6 s of CPU,
    and a signal that lands between two tokens runs its handler as usual)."""
    fd = proc.stdout.fileno()
    shown = b""
    deadline = time.monotonic() + 120
    while shown.count(b"a") < 12 and proc.poll() is None and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.05)[0]:
            block = os.read(fd, 4096)
            if not block:
                break
            shown += block
    start = _cpu_s(proc.pid)
    while _cpu_s(proc.pid) < start + 0.3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return shown


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_every_structured_output_field_takes_long_bounds_and_refuses_costly_grammars(server):
    proc, url = server
    tool = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": LONG_STRING}, "required": ["text"]}}}
    fields = [  # (route, the request, the field's name) — each the trial's 130-byte request in that protocol
        ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": LONG_STRING}}}, "response_format"),
        ("/api/chat", {"model": "smollm2", "messages": HI, "format": LONG_STRING, "stream": False}, "format"),
        ("/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": HI, "output_config": {"format": {
            "type": "json_schema", "schema": LONG_STRING}}}, "output_config"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                              "schema": LONG_STRING}}}, "text"),
        ("/v1/chat/completions", {"messages": HI, "tools": [tool], "tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 5000}}}},
         "response_format"),
    ]
    for path, body, _ in fields:
        reply = post(url, path, body)
        assert reply.status_code == 200, (path, reply.text)
    costly = [  # amplification: each a 400 naming its field, before a slot is taken
        ("/v1/chat/completions", {"messages": HI, "grammar": DEEP_GRAMMAR}, "grammar", "nested more than 64"),
        ("/v1/chat/completions", {"messages": HI, "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(60000))},
         "grammar", "bytes"),
        ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "minLength": 100000000}}}}, "response_format", "100000000"),
        ("/api/chat", {"model": "smollm2", "messages": HI, "format": {"type": "string", "minLength": 100000000}},
         "format", "100000000"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 30000}, "messages", "2048"),
    ]
    before = rss_mib(proc.pid)
    for path, body, field, words in costly:
        reply = post(url, path, body)
        assert reply.status_code == 400 and words in reply.text, (field, reply.text[:300])
        error = reply.json()["error"]
        assert isinstance(error, str) or error.get("param") == field, (field, error)
    assert rss_mib(proc.pid) - before < 100  # the trial's minLength request took RSS from 0.4 to 4.7 GB
    assert post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2}).status_code == 200


def test_a_grammar_no_answer_can_follow_is_refused_before_llama_cpp_aborts_on_it(server):
    """Issue 58: a grammar or schema that allows no token at some point passed every limit, then llama.cpp aborted the
    whole server on the first token ("Unexpected empty grammar stack", SIGABRT): every client's connection dropped.
    Each of the trial's requests is now its protocol's 400 naming its field; the server answers on; `run` says it in
    one line (exit 2) where it exited 134."""
    proc, url = server
    nul = {"const": "\u0000"}
    tool = {"name": "note", "description": "Notes.", "input_schema": {"type": "object", "properties": {"text": nul},
                                                                      "required": ["text"]}}
    impossible = [  # (route, the request, the field the 400 names)
        ("/api/chat", {"model": "smollm2", "messages": HI, "format": nul, "stream": False}, "format"),
        ("/v1/messages", {"model": "smollm2", "max_tokens": 8, "messages": HI, "tools": [tool],
                          "tool_choice": {"type": "any"}}, "tools"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                              "schema": {"enum": ["\u0000"]}}}}, "text.format"),
        ("/v1/chat/completions", {"messages": HI, "grammar": "root ::= [z-a]"}, "grammar"),
        ("/v1/chat/completions", {"messages": HI, "grammar": "root ::= [\\x00]"}, "grammar"),
        ("/v1/chat/completions", {"messages": HI, "grammar": "root ::= <[999999]>"}, "grammar"),
    ]
    for path, body, field in impossible:
        reply = post(url, path, body)
        assert reply.status_code == 400 and "no answer can follow" in reply.text, (field, reply.text[:300])
        error = reply.json()["error"]
        assert isinstance(error, str) or error.get("param", field) == field and field in error["message"] \
            or error.get("param") == field, (field, error)  # (Anthropic's errors have no param: the message names it)
        assert proc.poll() is None  # (it lives)
    assert post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2}).status_code == 200
    for grammar in ("root ::= [z-a]", "root ::= \"a\\x00\"", "root ::= <[999999]>"):
        refused = run_cli("run", "-n", "3", "--grammar", grammar, "hi")
        assert refused.code == 2 and refused.stderr.startswith("Error: --grammar: no answer can follow"), refused.stderr


def test_a_model_path_a_request_names_tells_nothing_of_the_file(server, tmp_path, smollm2):
    """Issue 58: a request's `model` may be a GGUF's path; one that cannot be loaded answered why ("not a GGUF file…",
    503): whether a file exists, and what it holds, could be probed; and any GGUF on the server's disk was loaded.
    Now a path is served only when it is one of llmcli's places (what `llmcli list --all` shows, an alias's file, the
    server's -m model: test_model_pool puts one in LM Studio's folder); any other is one 404, the same words whatever
    the file."""
    _, url = server
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("secret notes")
    elsewhere = tmp_path / "elsewhere.gguf"
    os.link(smollm2, elsewhere)  # (a model llmcli does not list: it was loaded and answered, 200)
    replies = {what: post(url, "/v1/chat/completions", {"model": name, "messages": HI, "max_tokens": 1})
               for what, name in (("missing", str(tmp_path / "none.gguf")), ("not a GGUF", str(not_gguf)),
                                  ("a system file", "/etc/hostname"), ("a folder", str(tmp_path) + "/"),
                                  ("a model elsewhere", str(elsewhere)))}
    for what, reply in replies.items():
        assert reply.status_code == 404, (what, reply.text)
        assert "not found (the server loads what `llmcli list --all` shows" in reply.json()["error"]["message"], what
        assert "secret" not in reply.text and "GGUF" not in reply.text.replace(".gguf", ""), (what, reply.text)


# -- 4: cross-site requests and DNS rebinding -------------------------------------------------------------------------


def test_a_web_page_cannot_drive_the_server(server):
    _, url = server
    body = {"model": "smollm2", "messages": HI, "max_tokens": 2, "prompt": "hi", "max_tokens_to_sample": 2}
    # What a page can post anywhere without asking: text or a form, which a browser sends with Origin (every POST) or
    # Sec-Fetch-Site (every request); a program's request without them is read as JSON (curl -d: test_protocols).
    browser = [{"Origin": "https://page.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}]
    for path, shape in SHAPES.items():
        for media, marks in zip(("text/plain", "application/x-www-form-urlencoded", ""), browser, strict=True):
            reply = post(url, path, body, {"Content-Type": media, **marks})
            assert reply.status_code == 415, (path, media, reply.text)
            assert_shape(shape, reply.json(), (path, media))
        rebound = post(url, path, body, {"Host": "attacker.example:8080"})
        assert rebound.status_code == 403 and "Host" in rebound.text, (path, rebound.text)
        assert_shape(shape, rebound.json(), path)
    for host in ("localhost", "127.0.0.1", "[::1]:80", "llmcli.localhost"):
        assert post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1}, {"Host": host}).status_code == 200
    health = HTTP.get(f"{url}/health", timeout=10).json()
    assert "pid" not in health and all("path" not in m for m in health["models"])
    keyed = HTTP.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert keyed["pid"] > 0 and keyed["models"][0]["path"].endswith(".gguf")


def test_allow_host_admits_a_reverse_proxy_s_name(tmp_path):
    proc, url = start_server(tmp_path, "-c", "256", "--allow-host", "llm.example.org")
    try:
        headers = {"Content-Type": "application/json"}
        body = json.dumps({"messages": HI, "max_tokens": 1})
        ok = HTTP.post(f"{url}/v1/chat/completions", content=body, headers={**headers, "Host": "llm.example.org"})
        other = HTTP.post(f"{url}/v1/chat/completions", content=body, headers={**headers, "Host": "evil.example.org"})
        assert ok.status_code == 200 and other.status_code == 403
    finally:
        stop_server(proc)


# -- 9: no 500 for odd bodies, names and ids; a seeded fuzz test --------------------------------------------------------


def test_odd_bodies_names_and_ids_are_400s_in_the_protocol_s_shape(server):
    _, url = server
    long_name = "x" * 300
    cases = [
        ("/api/show", {"model": long_name}), ("/api/chat", {"model": long_name, "messages": HI}),
        ("/v1/chat/completions", {"model": long_name, "messages": HI}), ("/v1/embeddings", {"model": long_name, "input": "x"}),
        ("/v1/chat/completions", b"[" * 1000 + b"]" * 1000), ("/v1/messages", b'{"a":' * 900 + b"1" + b"}" * 900),
        ("/v1/responses", {"input": "hi", "previous_response_id": {"a": 1}}), ("/llmcli/embed", b'"none"'),
        ("/api/generate", {"model": "smollm2\x00", "prompt": "hi"}),
    ]
    for path, body in cases:
        reply = post(url, path, body)
        assert 400 <= reply.status_code < 500, (path, reply.status_code, reply.text[:200])
        assert_shape(SHAPES.get(path, "openai"), reply.json(), path)
    headers = {"Authorization": f"Bearer {KEY}"}
    for name in (long_name, "a" * 5000):
        reply = HTTP.get(f"{url}/v1/models/{name}", headers=headers, timeout=10)
        assert reply.status_code in (400, 404) and "error" in reply.json()


def _json_values() -> st.SearchStrategy[object]:
    keys = st.sampled_from(["model", "messages", "prompt", "role", "content", "max_tokens", "stream", "tools",
                            "tool_choice", "response_format", "format", "grammar", "options", "input", "system",
                            "type", "text", "schema", "json_schema", "temperature", "stop", "n", "logit_bias",
                            "previous_response_id", "output_config", "think", "images", "keep_alive", "seed"])
    scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=40) \
        | st.sampled_from(["smollm2", "user", "assistant", "system", "tool", "json_schema", "json", "text", "auto",
                           "required", "none", "root ::= \"a\"", "function"])
    return st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                        | st.dictionaries(keys | st.text(max_size=8), children, max_size=6), max_leaves=24)


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, object]:
    path = draw(st.sampled_from(sorted(SHAPES)))
    body = draw(st.fixed_dictionaries({}, optional={"model": st.just("smollm2"), "messages": st.just(HI),
                                                    "max_tokens": st.integers(1, 4)}))
    body.update(draw(st.dictionaries(st.sampled_from(["messages", "prompt", "input", "tools", "tool_choice",
                                                      "response_format", "format", "grammar", "options", "stream",
                                                      "system", "stop", "logit_bias", "output_config", "text",
                                                      "previous_response_id", "n", "temperature"]),
                                     _json_values(), max_size=4)))
    return path, body


FUZZ_EXAMPLES = int(os.environ.get("LLMCLI_FUZZ_EXAMPLES", "120"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_bodies())
def test_fuzzed_bodies_never_get_a_5xx_hang_or_kill_the_server(server, case):
    proc, url = server
    path, body = case
    reply = post(url, path, body, timeout=60)  # a hang fails here
    assert reply.status_code < 500, (path, body, reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        assert_shape(SHAPES[path], reply.json(), (path, body))
    assert proc.poll() is None


# -- 13: idle connections cannot lock the others out ---------------------------------------------------------------


def test_idle_connections_cannot_lock_other_clients_out(server):
    _, url = server
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12)]  # --max-connections 8
    try:
        time.sleep(0.2)
        reply = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1}, timeout=30)
        assert reply.status_code == 200
    finally:
        for connection in idle:
            connection.close()


# -- 5, 6: templates: a budget that holds on serve's worker threads, memory bombs -------------------------------------

LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def looping_model(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rewrite_metadata(smollm2, tmp_path_factory.mktemp("loop") / "looping.gguf",
                            strings={"tokenizer.chat_template": LOOPING})


def test_a_looping_template_is_stopped_on_serve_s_worker_thread_and_sigterm_ends_the_server(tmp_path, looping_model):
    proc, url = start_server(tmp_path, "-m", str(looping_model), "-c", "256", "--shutdown-grace", "1")
    try:
        started = time.monotonic()
        reply = HTTP.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 1}, timeout=60)
        assert reply.status_code == 400 and "longer than 2 s" in reply.json()["error"]["message"], reply.text
        pending = threading.Thread(target=lambda: HTTP.post(f"{url}/v1/chat/completions",
                                                              json={"messages": HI}, timeout=60), daemon=True)
        pending.start()  # a rendering in flight when SIGTERM comes
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert time.monotonic() - started < 60
    finally:
        if proc.poll() is None:
            proc.kill()


BOMBS = {
    "format filter": "{{ '%2000000000s'|format('x') }}",
    "percent": "{{ '%2000000000s' % 'x' }}",
    "join separator": "{{ range(100000)|join('x' * 1000000) }}",
    "str.format width": "{{ '{:2000000000}'.format('x') }}",
    "nested width": "{{ '{:{}}'.format('x', 2000000000) }}",
    "tojson indent": "{{ messages|tojson(indent=100000000) }}",
    "ljust": "{{ 'x'.ljust(2000000000) }}",
    "doubling ~": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "growing list": "{% set ns = namespace(l=[], x='a' * 1000000) %}{% for i in range(100000) %}"
                    "{% set ns.l = ns.l + [ns.x ~ i] %}{% endfor %}",
    "replace": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "center": "{{ 'x'|center(2000000000) }}",
    "batch fill": "{{ [1]|batch(2000000000, 'x')|list }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "indent": "{{ ('\n' * 100000)|indent(100000) }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_memory_bombs_stop_with_one_line_and_no_memory(name):
    from llmcli.answer.message import Message
    from llmcli.errors import TemplateError
    from llmcli.prompt.chat_template import ChatTemplate, _compiled

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):  # the second from the template compiled once: its rendering is bounded again
        with pytest.raises(TemplateError) as raised:
            ChatTemplate(BOMBS[name], "gguf").render([Message("user", "hi")])
        assert "stopped" in raised.value.message and "\n" not in raised.value.message, raised.value.message
    assert _compiled.cache_info().hits >= 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # KiB: the trial saw 1-10 GB


def test_the_time_budget_holds_on_any_thread():
    from llmcli.answer.message import Message
    from llmcli.errors import TemplateError
    from llmcli.prompt.chat_template import ChatTemplate

    outcome: list[str] = []

    def render() -> None:
        try:
            ChatTemplate(LOOPING, "gguf").render([Message("user", "hi")])
        except TemplateError as exc:
            outcome.append(exc.message)

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and "longer than 2 s" in outcome[0]
    assert sys.gettrace() is None or "coverage" in type(sys.gettrace()).__module__  # the tracer is gone afterwards


# -- 3: a shared runtime dir another user made ----------------------------------------------------------------------


def _run_module(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m llmcli` (not forked: the temporary dir is read afresh from TMPDIR), threads not fixed (a fixed -t
    shares no cores, and so has no runtime dir to use)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("LLMCLI_THREADS", "LLMCLI_RUNTIME_DIR")}
    return subprocess.run([sys.executable, "-m", "llmcli", *args], capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL, env={**environment, **env})


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user owns needs root")
def test_a_runtime_dir_another_user_made_is_never_written_through(tmp_path):
    shared = Path(tempfile.mkdtemp(prefix="llmcli-shared-"))  # short: a socket's path has 107 bytes at most
    shared.chmod(0o1777)
    try:
        _planted_runtime_dir_is_refused(shared, tmp_path)
    finally:
        shutil.rmtree(shared)


def _planted_runtime_dir_is_refused(shared: Path, tmp_path: Path) -> None:
    planted = shared / f"llmcli-{os.getuid()}"
    (planted / "generating").mkdir(parents=True)
    (planted / "servers").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in ("generating/1", "servers/x.log"):
        (planted / name).symlink_to(victim)
    for directory in (planted, planted / "generating", planted / "servers"):
        os.chown(directory, 65534, 65534, follow_symlinks=False)
    env = {"TMPDIR": str(shared), "XDG_RUNTIME_DIR": ""}
    alone = _run_module("run", "--keep-alive", "0", "-n", "2", "--temp", "0", "hi", env=env)
    assert alone.returncode == 0 and alone.stderr.count("is not this user's alone") == 1, alone.stderr
    warm = _run_module("run", "--keep-alive", "1m", "-n", "2", "--temp", "0", "hi", env=env)
    assert warm.returncode == 0 and "warm servers' directory cannot be used" in warm.stderr, warm.stderr
    assert "Traceback" not in warm.stderr and "internal error" not in warm.stderr
    assert victim.read_text() == "precious" and sorted(p.name for p in planted.rglob("*")) == ["1", "generating",
                                                                                              "servers", "x.log"]


def test_private_dirs_are_0700_all_the_way_and_a_link_is_refused(tmp_path):
    from llmcli import paths

    made = paths.private_dir(tmp_path / "a" / "b" / "c", tmp_path / "a")
    for directory in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert directory.stat().st_mode & 0o777 == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(paths.UnsafeDirectory):
        paths.private_dir(tmp_path / "link" / "servers", tmp_path / "link")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_link_planted_as_the_warm_servers_dir_means_an_answer_here(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (runtime / "servers").symlink_to(tmp_path / "elsewhere")
    result = run_cli("run", "--keep-alive", "1m", "-n", "2", "--temp", "0", "hi", env={"LLMCLI_RUNTIME_DIR": str(runtime)})
    assert result.code == 0 and "answering in this process" in result.stderr, result.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


# -- 10, 11: a NaN in a GGUF; the hash memo under a full disk and concurrent writers ----------------------------------


def test_a_nan_epsilon_is_exit_5_not_an_abort(smollm2, tmp_path):
    bad = rewrite_metadata(smollm2, tmp_path / "nan.gguf", strings={"llama.attention.layer_norm_rms_epsilon": float("nan")})
    result = run_cli("run", "-m", str(bad), "-n", "1", "hi")
    assert result.code == 5 and "layer_norm_rms_epsilon = nan is not a usable number" in result.stderr, result.stderr


def test_the_hash_memo_is_written_whole_and_merged(tmp_path, monkeypatch):
    from llmcli import paths
    from llmcli.store import file_hashes

    models = [tmp_path / f"m{i}.bin" for i in range(8)]
    for i, model in enumerate(models):
        model.write_bytes(bytes([i]) * 100)
    script = "import sys; from pathlib import Path; from llmcli.store.file_hashes import remembered_sha256; " \
             "remembered_sha256(Path(sys.argv[1]))"
    memo = paths.hash_memo_file()
    memo.unlink()  # (the suite's own memo of its models: this test starts from none)
    writers = [subprocess.Popen([sys.executable, "-c", script, str(model)]) for model in models]
    assert all(w.wait(timeout=60) == 0 for w in writers)
    assert len(json.loads(memo.read_text())) == 8  # eight processes at once: every hash kept
    before = memo.read_bytes()

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_hashes.json, "dump", disk_full)
    (tmp_path / "new.bin").write_bytes(b"new")
    assert len(file_hashes.remembered_sha256(tmp_path / "new.bin")) == 64  # the hash, though not remembered
    assert memo.read_bytes() == before and not list(memo.parent.glob("*.tmp"))


# -- 7, 8, 12: MCP servers' children, their garbage and stderr, tool text on the terminal -----------------------------

MCP_SERVER = Path(__file__).parent / "data" / "mcp_server.py"


def _mcp_config(tmp_path: Path, mode: str = "stdio", timeout: float = 5, **env: str) -> Path:
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"t": {"command": sys.executable, "args": [str(MCP_SERVER), mode],
                                                       "env": env, "timeout": timeout}}}))
    return config


@pytest.mark.parametrize("ending", ["exit", "SIGTERM", "SIGINT", "SIGKILL"])
def test_an_mcp_server_s_children_never_outlive_llmcli(tmp_path, ending):
    pids = tmp_path / "pids"
    config = _mcp_config(tmp_path, MCP_PID_FILE=str(pids), MCP_SPAWN="1")
    if ending == "exit":
        assert run_cli("mcp", "list", "--mcp", str(config)).code == 0
    else:
        proc = spawn_cli("mcp", "call", "--mcp", str(config), "t", "hang", '{"seconds": 60}')
        deadline = time.monotonic() + 30
        while (not pids.exists() or len(pids.read_text().split()) < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the call is in flight
        proc.send_signal(getattr(signal, ending))
        proc.communicate(timeout=30)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3  # the server, its child, and a child in a session of its own
    deadline = time.monotonic() + 10
    while any(reaper.alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in started if reaper.alive(pid)], f"outlived llmcli ({ending}): {_states(started)}"


def _states(pids: list[int]) -> list[str]:
    """Each process's state, parent and command line (what a failure needs to be understood)."""
    found = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = Path(f"/proc/{stat[1]}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {stat[0]} [{command.strip()}] parent {stat[1]} [{parent.strip()}]")
        except OSError as exc:
            found.append(f"{pid}: {exc}")
    return found


def test_an_mcp_server_s_garbage_and_failure_are_one_notice_each(tmp_path):
    garbage = run_cli("mcp", "list", "--mcp", str(_mcp_config(tmp_path, "garbage", timeout=1)))  # (it never answers)
    assert "Traceback" not in garbage.stderr and garbage.stderr.count("Failed to parse JSONRPC") <= 1, garbage.stderr
    broken = run_cli("mcp", "list", "--mcp", str(_mcp_config(tmp_path, "broken")))
    assert "ModuleNotFoundError: No module named 'fastmcp_helpers'" in broken.stdout + broken.stderr, broken
    assert broken.code == 1  # a server failed: `mcp list` says so in its exit code too


def test_tools_debug_shows_a_tool_s_control_sequences_without_obeying_them(tmp_path):
    result = run_cli("run", "--mcp", str(_mcp_config(tmp_path)), "--tools-debug", "--tool-choice", "t_escapes",
                     "--temp", "0", "-n", "64", "Use the tool.")
    assert "tool result t_escapes: ^[]0;pwned^G^[[2J^[]52;c;cHduZWQ=^Gdone" in result.stderr, result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr


# -- issue 58, item 5: one bad line is that line's error; -t within llama.cpp's arrays ---------------------------------


def test_a_lone_surrogate_or_a_deep_nesting_is_one_line_s_error_and_t_is_bounded(tmp_path):
    """A JSONL line holding a lone surrogate escape, or 100,000 nested brackets, lost the whole job (an internal error,
    a RecursionError): each is now that line's error record in `--batch` (the others answered) and in `embed --input`,
    and one line naming the line in `eval tools --items`. `-t 100000` segfaulted llama.cpp: refused (exit 2)."""
    deep = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "hi"}\n{"prompt": "\\ud800"}\n' + deep + '\n{"prompt": "ho"}\n')
    result = run_cli("run", "--keep-alive", "0", "-n", "2", "--temp", "0", "--batch", str(batch))
    assert result.code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3] and records[0]["text"] and records[3]["text"]
    assert "lone surrogate" in records[1]["error"] and "nested too deep" in records[2]["error"]
    lines = tmp_path / "texts.jsonl"
    lines.write_text('{"text": "hi"}\n' + deep.replace("prompt", "text") + '\n{"text": "\\udfff"}\n')
    embedded = run_cli("embed", "--keep-alive", "0", "--input", str(lines))
    assert embedded.code == 0, embedded.stderr
    vectors = [json.loads(line) for line in embedded.stdout.splitlines()]
    assert "embedding" in vectors[0] and "nested too deep" in vectors[1]["error"] and "surrogate" in vectors[2]["error"]
    items = tmp_path / "items.jsonl"
    items.write_text(deep + "\n")
    evaluated = run_cli("eval", "tools", "--items", str(items))
    assert evaluated.code == 2 and f"{items}:1: not JSON (malformed JSON: nested too deep)" in evaluated.stderr
    assert "Traceback" not in evaluated.stderr + embedded.stderr + result.stderr
    threads = run_cli("run", "-t", "100000", "-n", "1", "hi")
    assert threads.code == 2 and "--threads must be between 1 and 512" in threads.stderr



def test_a_cache_that_cannot_be_written_while_a_packaged_model_is_assembled_is_exit_6():
    """Issue 58: assembling gemma3-270m from its packages into a cache that cannot be written (read-only, full) was
    "internal error: PermissionError" (exit 1): now one line naming the place, exit 6 (resources), nothing left."""
    result = _run_module("run", "-m", "gemma3-270m", "-n", "1", "hi",
                         env={"LLMCLI_CACHE_DIR": "/sys/llmcli-test", "LLMCLI_KEEP_ALIVE": "0"})  # (sysfs: EPERM)
    assert result.returncode == 6, result.stderr
    assert result.stderr.startswith("Error: could not assemble gemma3-270m in /sys/llmcli-test") and \
        "internal error" not in result.stderr
