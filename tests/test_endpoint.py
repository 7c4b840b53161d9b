"""`--endpoint URL`: run, --batch, chat and bench against OpenAI-compatible servers — a scripted fake one on
loopback (faults on demand), `llmcli serve`, and llama-cpp-python's own server on the same GGUF.

Every request goes to 127.0.0.1 only; the fake server's waits are bounded.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import HTTP, closed_after, run_cli, start_llama_cpp_server, start_server, stop_server


class FakeServer:
    """Answers like an OpenAI-compatible server; `behaviour` scripts faults; `log` records each request."""

    def __init__(self) -> None:
        self.behaviour = "ok"
        self.log: list[tuple[str, dict]] = []
        self.keys: list[str | None] = []  # the Authorization header of each request
        self.failures_left = 0
        self.in_flight = self.most_in_flight = 0  # requests being answered at once
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.log.append((self.path, {}))
                self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.log.append((self.path, body))
                outer.keys.append(self.headers.get("Authorization"))
                if outer.behaviour == "hang":
                    time.sleep(4)  # longer than the client's timeout in the test; bounded
                    return self._json(500, {"error": {"message": "too late"}})
                if outer.behaviour == "fail_once" and outer.failures_left > 0:
                    outer.failures_left -= 1
                    return self._json(500, {"error": {"message": "internal hiccup"}})
                if outer.behaviour == "busy":
                    return self._json(429, {"error": {"message": "busy"}}, {"Retry-After": "0"})
                if outer.behaviour == "unauthorized":
                    return self._json(401, {"error": {"message": "bad key"}})
                if outer.behaviour == "bad_request":
                    return self._json(400, {"error": {"message": "temperature is out of range"}})
                prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
                if outer.behaviour == "echo_slowly":  # later prompts answer sooner: the order must be restored
                    with outer.lock:
                        outer.in_flight += 1
                        outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                    time.sleep(max(0.0, 0.3 - 0.02 * int(prompt.split()[-1])))
                    with outer.lock:
                        outer.in_flight -= 1
                words = ["You", " said:", f" {prompt}", " Hello", " world."]
                self._stream(words)

            def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                   **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, words: list[str]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for word in words:
                    chunk = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": len(words), "total_tokens": 16}}
                self.wfile.write(f"data: {json.dumps(last)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list[dict]:
        return [body for path, body in self.log if path.endswith("completions")]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServer]:
    """The fake endpoint, asked with no model set (it answers with its own: "fake-model")."""
    monkeypatch.delenv("LLMCLI_MODEL")
    server = FakeServer()
    yield server
    server.server.shutdown()
    server.server.server_close()  # (its listening socket: not left to the GC)


def test_run_streams_from_the_endpoint_with_stats_json_and_client_side_stops(fake):
    result = run_cli("run", "--endpoint", fake.url, "--temp", "0.3", "-n", "20", "Hi there")
    assert result.code == 0, result.stderr
    assert result.stdout == "You said: Hi there Hello world.\n"
    assert "prompt 11 tok" in result.stderr and "TTFT" in result.stderr and "stop: eos" in result.stderr
    (sent,) = fake.posts()
    assert sent["model"] == "fake-model" and sent["temperature"] == 0.3 and sent["max_tokens"] == 20
    assert sent["stream"] is True and sent["messages"][-1] == {"role": "user", "content": "Hi there"}
    record = json.loads(run_cli("run", "--endpoint", fake.url, "--json", "--stop", "Hello", "Hi").stdout)
    assert record["text"] == "You said: Hi " and record["finish_reason"] == "stop_sequence"  # cut here, never printed
    assert record["stop_sequence"] == "Hello"  # (the stream was closed there: the server's token counts never came)


@pytest.mark.parametrize("behaviour, code, fragment", [
    ("unauthorized", 1, "refused the API key"),
    ("bad_request", 2, "temperature is out of range"),
    ("busy", 4, "still busy or failing"),
])
def test_server_errors_map_to_exit_codes(fake, behaviour, code, fragment):
    fake.behaviour = behaviour
    result = run_cli("run", "--endpoint", fake.url, "-m", "fake-model", "hi")
    assert result.code == code, result.stderr
    assert fragment in result.stderr and "Traceback" not in result.stderr
    if behaviour == "unauthorized":
        assert "--api-key" in result.stderr
    if behaviour == "busy":
        assert len(fake.posts()) == 4  # the first try and three retries


def test_a_failing_server_is_retried_and_a_hanging_one_times_out(fake):
    fake.behaviour, fake.failures_left = "fail_once", 1
    retried = run_cli("run", "--endpoint", fake.url, "-m", "fake-model", "hi")
    assert retried.code == 0 and retried.stdout.startswith("You said: hi") and len(fake.posts()) == 2
    fake.behaviour = "hang"
    hung = run_cli("run", "--endpoint", fake.url, "-m", "fake-model", "--endpoint-timeout", "1", "hi")
    assert hung.code == 4 and "did not answer within 1 s" in hung.stderr  # it gave up before the server answered


def test_nothing_listening_is_a_network_error():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_cli("run", "--endpoint", f"http://127.0.0.1:{port}", "-m", "x", "hi")
    assert result.code == 4 and "cannot connect" in result.stderr and len(result.stderr.strip().splitlines()) == 2
    assert run_cli("run", "--endpoint", "ftp://example", "hi").code == 2


def test_batch_sends_in_parallel_and_writes_in_input_order(fake, tmp_path):
    fake.behaviour = "echo_slowly"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(12)) + '{"prompt": "prompt 12", "id": "x"}\n\n')
    result = run_cli("run", "--batch", str(prompts), "--endpoint", fake.url, "--parallel", "12")
    assert result.code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == list(range(14))
    assert [r["text"] for r in records[:13]] == [f"You said: prompt {i} Hello world." for i in range(13)]
    assert records[12]["id"] == "x" and records[13]["error"] == "empty line"
    assert fake.most_in_flight > 1  # the requests overlapped


def test_config_file_endpoint_and_api_key_from_the_environment(fake, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'endpoint = "{fake.url}"\n')
    fake.log.clear()
    result = run_cli("run", "hi", env={"LLMCLI_CONFIG": str(config), "LLMCLI_API_KEY": "sekrit"})
    assert result.code == 0, result.stderr
    assert result.stdout.startswith("You said: hi")  # the fake server answered, not the bundled model
    assert [path for path, _ in fake.log][-1] == "/v1/chat/completions" and fake.keys[-1] == "Bearer sekrit"


def test_run_endpoint_loads_neither_llama_cpp_nor_numpy(fake):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmcli", "run", "--endpoint", fake.url, "hi"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("You said: hi"), result.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "import time:" in line}
    assert "llmcli" in imported and "httpx2" in imported
    assert not {"llama_cpp", "numpy"} & imported


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("serve"), "-P", "4", "-c", "512", "--speculate", "lookup",
                             "--cors", "https://app.example")
    yield url
    stop_server(proc)


def local_greedy(*args: str) -> str:
    result = run_cli("run", "--json", "--temp", "0", "-n", "16", "--no-prompt-cache", "-c", "512", *args)
    return json.loads(result.stdout)["text"]


def test_run_batch_and_chat_against_llmcli_serve(served, tmp_path):
    remote = run_cli("run", "--endpoint", served, "--json", "--temp", "0", "-n", "16", "Say hi.")
    assert json.loads(remote.stdout)["text"] == local_greedy("Say hi.")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Say hi.\nName a colour.\n")
    batch = run_cli("run", "--batch", str(prompts), "--endpoint", served, "--temp", "0", "-n", "16", "-P", "2")
    texts = [json.loads(line)["text"] for line in batch.stdout.splitlines()]
    assert texts == [local_greedy("Say hi."), local_greedy("Name a colour.")]
    chat = run_cli("chat", "--endpoint", served, "--temp", "0", "-n", "12",
                   input="My name is Ada.\nWhat is my name?\n/show\n/stats\n/exit\n")
    assert chat.code == 0, chat.stderr
    assert "(" in chat.stderr and "cached)" in chat.stderr  # the second turn reused the server's KV cache
    assert f"({served}/v1)" in chat.stderr  # /show: the model and where it answers
    # /show: what it can tell (issue 57: it said nothing of the context): the last answer's prompt and answer
    assert "tokens used by the conversation as of its last answer (kept by the server), 2 exchanges" in chat.stderr
    assert "context  0 tokens" not in chat.stderr
    assert "total: 2 replies" in chat.stderr and "Error" not in chat.stderr  # /stats
    bench = run_cli("bench", "--endpoint", served, "-n", "8", "-r", "2", "--parallel", "1,2", "--format", "json")
    assert bench.code == 0, bench.stderr
    rows = {(r["test"], r["path"]): r for r in json.loads(bench.stdout)["results"]}
    assert rows[("ttft", "endpoint")]["n"] == 2 and rows[("tg8", "endpoint")]["mean"] > 0
    assert rows[("tg8 x2", "endpoint, aggregate")]["mean"] > 0


def test_run_and_batch_against_llama_cpp_python_s_own_server(smollm2, tmp_path, monkeypatch):
    monkeypatch.delenv("LLMCLI_MODEL")  # no model set: the server's own ("smol")
    proc, url = start_llama_cpp_server(smollm2, tmp_path / "llama-server.log", "--n_ctx", "512")
    try:
        result = run_cli("run", "--endpoint", url, "--json", "--temp", "0", "-n", "16", "Say hi.")
        assert result.code == 0, result.stderr
        record = json.loads(result.stdout)
        assert record["model"] == "smol" and record["text"].strip() and record["finish_reason"] in ("length", "stop")
        assert record["usage"]["completion_tokens"] == 16 or record["finish_reason"] == "stop"
        prompts = tmp_path / "p.txt"
        prompts.write_text("Say hi.\nName a colour.\n")
        # -P 1: this server answers one request at a time and, by default, abandons the answer in progress
        # when another request arrives (its `interrupt_requests`): two at once would leave one answer empty.
        batch = run_cli("run", "--batch", str(prompts), "--endpoint", url, "--temp", "0", "-n", "8", "-P", "1")
        records = [json.loads(line) for line in batch.stdout.splitlines()]
        assert [r["index"] for r in records] == [0, 1] and all(r["text"] for r in records)
        assert re.search(r"batch: 2 prompts \(0 errors\)", batch.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_chat_over_an_endpoint_sends_the_history_and_what_set_changed(fake):
    result = run_cli("chat", "--endpoint", fake.url, "--temp", "0.3", "-q", input="first\n/set temp 0.7\nsecond\n")
    assert result.code == 0, result.stderr
    first, second = fake.posts()
    assert first["temperature"] == 0.3 and second["temperature"] == 0.7
    assert [m["content"] for m in second["messages"]] == ["first", "You said: first Hello world.", "second"]


COPY = "The keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in the log."


def test_serve_drafts_from_the_prompt_and_answers_as_run_does(served):
    """A grounded request (a text to repeat, the copy forced by a grammar on any CPU) is decoded speculatively by
    the server's scheduler — accepted drafts in its timings — and its greedy answer is `run`'s."""
    prompt = f"{COPY}\n\nRepeat the text above word for word."
    grammar = f'root ::= "{COPY}"'
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 40, "grammar": grammar}
    request = urllib.request.Request(f"{served}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    assert reply["timings"]["draft_tokens"] > 0 and reply["timings"]["accepted_tokens"] > 0
    local = run_cli("run", "--json", "--temp", "0", "-n", "40", "--no-prompt-cache", "-c", "512", "--speculate", "off",
                    "--grammar", grammar, prompt)
    assert reply["choices"][0]["message"]["content"] == json.loads(local.stdout)["text"] == COPY


def test_endpoint_sends_every_sampling_setting_and_names_what_it_cannot(fake):
    """Issue 23, defect 4: nothing given is dropped without a word."""
    result = run_cli("run", "--endpoint", fake.url, "--mirostat", "2", "--mirostat-tau", "3", "--typical-p", "0.9",
                     "--dry-multiplier", "0.8", "--xtc-probability", "0.5", "--repeat-last-n", "32",
                     "--no-repetition-guard", "--no-think", "--logit-bias", "15043=-inf", "--logit-bias", "Hello=2",
                     "-t", "2", "-c", "1024", "hi")
    assert result.code == 0, result.stderr
    (sent,) = fake.posts()
    assert sent["mirostat"] == 2 and sent["mirostat_tau"] == 3 and sent["typical_p"] == 0.9
    assert sent["dry_multiplier"] == 0.8 and sent["xtc_probability"] == 0.5 and sent["repeat_last_n"] == 32
    assert sent["repetition_guard"] is False and sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["logit_bias"] == [[15043, False], ["Hello", 2.0]]  # (a text too: llama-server's form, issue 57)
    notice = next(line for line in result.stderr.splitlines() if "not used with --endpoint" in line)
    assert "--logit-bias" not in notice and "--threads" in notice and "--ctx-size" in notice
    by_id = run_cli("run", "--endpoint", fake.url, "--logit-bias", "15043=-inf", "hi")
    assert by_id.code == 0 and fake.posts()[-1]["logit_bias"] == {"15043": -100}  # ids alone: OpenAI's form
    chat = run_cli("chat", "--endpoint", fake.url, "-q", input="/set mirostat 2\n/set on_overflow truncate\nhi\n")
    assert fake.posts()[-1]["mirostat"] == 2
    assert "--on-overflow = truncate (not used:" in chat.stderr


def test_a_banned_token_is_banned_by_llmcli_serve_as_by_run(served):
    plain = local_greedy("Say hi.")
    first = json.loads(run_cli("tokenize", "--json", plain).stdout)["ids"][0]
    banned = local_greedy("--logit-bias", f"{first}=-inf", "Say hi.")
    assert banned != plain
    remote = run_cli("run", "--endpoint", served, "--json", "--temp", "0", "-n", "16", "--logit-bias", f"{first}=-inf",
                     "Say hi.")
    assert json.loads(remote.stdout)["text"] == banned


def test_bench_endpoint_prints_what_is_known_and_no_made_up_values(fake):
    """Issue 23, defect 14: a server's model size and threads are unknown here, not 0 B and 0."""
    table = run_cli("bench", "--endpoint", fake.url, "-n", "4", "-r", "1")
    assert table.code == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("| fake-model")]
    assert rows and all("| ? | ? | ? | ? |" in line for line in rows), table.stdout
    assert "0 B" not in table.stdout and f"against {fake.url}" in table.stdout
    record = json.loads(run_cli("bench", "--endpoint", fake.url, "-n", "4", "-r", "1", "--format", "json").stdout)
    assert all(r["size_bytes"] is None and r["threads"] is None for r in record["results"])


def test_a_model_by_id_and_cors_only_for_the_origins_given(served):
    """`GET /v1/models/{id}` (404 in OpenAI's shape for another id); CORS answers only an origin given with --cors."""
    import openai

    api = closed_after(openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0))
    assert api.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError, match="not found"):
        api.models.retrieve("gpt-4")

    def preflight(origin: str) -> dict[str, str]:
        request = urllib.request.Request(f"{served}/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return dict(response.headers)
        except urllib.error.HTTPError as error:
            error.close()  # (it holds the response's socket)
            return dict(error.headers)

    assert preflight("https://app.example").get("access-control-allow-origin") == "https://app.example"
    assert "access-control-allow-origin" not in {k.lower() for k in preflight("https://evil.example")}


def test_serve_ignores_a_config_file_endpoint(tmp_path):
    config = tmp_path / "config" / "llmcli" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('endpoint = "http://127.0.0.1:9/v1"\n')
    proc, url = start_server(tmp_path, "-c", "256")  # starts: the config file's endpoint is run's and chat's
    try:  # and answers from its own model, not from the (dead) endpoint
        reply = HTTP.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "smollm2", reply.text
    finally:
        stop_server(proc)
