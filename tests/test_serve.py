"""`llmcli serve` on the real SmolLM2, driven by a foreign client (the official `openai` package) and by raw HTTP:
the protocol, greedy answers equal to `run`'s, 32 concurrent streams, faults, and a clean SIGTERM.

Every request goes to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import jsonschema
import pytest
from conftest import HTTP, LOGS, closed_after, run_cli, start_server, stop_server

KEY = "test-key"
PROMPTS = ["Say hi.", "Name a colour.", "What is two plus two?", "Write a word that rhymes with cat."]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    proc, url = start_server(tmp_path_factory.mktemp("serve"), "-P", "8", "-c", "512", "--queue", "40", "--api-key", KEY)
    yield url, proc
    stop_server(proc)


def client(url: str):
    from openai import OpenAI

    return closed_after(OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120))


def run_greedy(prompt: str, n: int) -> str:
    result = run_cli("run", "--json", "--temp", "0", "-n", str(n), "--no-prompt-cache", "-c", "512", prompt)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["text"]


def rss_kib(proc: subprocess.Popen[bytes]) -> int:
    status = Path(f"/proc/{proc.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


def test_the_openai_client_chat_and_completions_streamed_and_not(server):
    url, _ = server
    openai = client(url)
    (model,) = [m.id for m in openai.models.list().data]
    assert model == "smollm2"
    whole = openai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                           temperature=0, max_tokens=16)
    assert whole.choices[0].message.content == run_greedy(PROMPTS[0], 16)  # as `llmcli run` answers it
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    chunks = list(openai.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                 temperature=0, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    completion = openai.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8)
    streamed = openai.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=8,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert completion.choices[0].text == run_greedy_raw("The capital of France is", 8)


def run_greedy_raw(prompt: str, n: int) -> str:
    result = run_cli("run", "--raw", "--json", "--temp", "0", "-n", str(n), "--no-prompt-cache", "-c", "512", prompt)
    return json.loads(result.stdout)["text"]


def test_response_format_json_schema_is_enforced_and_stop_sequences_apply(server):
    url, _ = server
    openai = client(url)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = openai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=0.7, seed=3,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    # (200 tokens: above what the schema lets an answer take, ~150 with every character of the name a 6-character
    # escape, so a sampled answer always ends; it takes ~15)
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    stopped = openai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPTS[0]}],
                                             temperature=0, max_tokens=16, stop=["here"])
    full = run_greedy(PROMPTS[0], 16)
    assert stopped.choices[0].message.content == full[: full.index("here")]
    assert stopped.choices[0].finish_reason == "stop"


def test_32_concurrent_streams_all_complete_with_run_s_greedy_answers(server):
    url, proc = server
    expected = {prompt: run_greedy(prompt, 8) for prompt in PROMPTS}
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            stream = client(url).chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": PROMPTS[index % 4]}], temperature=0,
                max_tokens=8, stream=True)
            results[index] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and len(results) == 32
    divergent = [i for i, text in results.items() if text != expected[PROMPTS[i % 4]]]
    assert divergent == []  # one sequence per slot: a neighbour never changes an answer
    health = HTTP.get(f"{url}/health").json()
    assert health["busy"] == 0 and health["waiting"] == 0


def test_faults_get_the_right_status_and_the_server_keeps_serving(server):
    url, proc = server
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = f"{url}/v1/chat/completions"
    baseline = rss_kib(proc)
    left = []
    for _ in range(10):  # clients that go away mid-stream
        with HTTP.stream("POST", chat, headers=auth, timeout=60, json={
                "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400, "stream": True}) as r:
            assert r.status_code == 200
            left.append(r.headers["x-request-id"])
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while HTTP.get(f"{url}/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert HTTP.get(f"{url}/health").json()["busy"] == 0  # their slots were freed

    ids = {}

    def status(body: bytes | dict, headers: dict[str, str] = auth) -> tuple[int, dict]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = HTTP.post(chat, content=content, headers={**headers, "Content-Type": "application/json"}, timeout=60)
        ids[response.headers["x-request-id"]] = response.status_code
        return response.status_code, response.json()

    message = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", auth, 400, None),
        (b'{"messages": "' + b"x" * (10 << 20) + b'"}', auth, 413, None),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, auth, 400, "context_length_exceeded"),
        ({"messages": message, "temperature": -1}, auth, 400, None),
        ({"messages": message, "top_p": 2}, auth, 400, None),
        ({"messages": message, "max_tokens": 0}, auth, 400, None),
        ({"messages": message, "n": 2}, auth, 400, None),
        ({"messages": message, "trace": 3}, auth, 400, None),  # (llmcli's trace comes in a stream's comments)
        ({"messages": message, "grammar": "root ::= ("}, auth, 400, None),  # llama.cpp refuses it in the slot
        ({"messages": [{"role": "wizard", "content": "hi"}]}, auth, 400, None),
        ({"messages": message, "model": "gpt-4"}, auth, 404, "model_not_found"),
        ({"messages": message}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        ({"messages": message}, {}, 401, "invalid_api_key"),
    ]
    for body, headers, expected, code in cases:
        got, error = status(body, headers)
        assert got == expected, (body if isinstance(body, dict) else body[:40], error)
        assert set(error["error"]) >= {"message", "type"} and (code is None or error["error"]["code"] == code)
    good, answer = status({"messages": message, "max_tokens": 4, "temperature": 0})
    assert good == 200 and answer["choices"][0]["message"]["content"]
    assert rss_kib(proc) - baseline < 100 * 1024  # back near its baseline (the KV cache was allocated at start)
    # Every request left a line in the server's log, with the id its client was told (issue 60: two stalled agent
    # requests left none): refused ones their status, answered ones the stats line, the clients that left saying so.
    log = LOGS[proc.pid].read_text()
    lines = {request_id: line for line in log.splitlines() for request_id in (*ids, *left) if f" {request_id} · " in line}
    assert set(lines) == {*ids, *left}, log[-3000:]
    for request_id, code in ids.items():
        assert lines[request_id].startswith("POST /v1/chat/completions req_")
        assert (f"· {code} " in lines[request_id]) if code != 200 else "tok/s" in lines[request_id], lines[request_id]
    assert all("the client left: 0 of 1 answers done" in lines[request_id] for request_id in left)


def test_a_full_queue_is_429_with_retry_after_and_sigterm_ends_the_streams_cleanly(tmp_path):
    """Two slots busy (an OpenAI stream, an Ollama stream), no queue: a third request is a 429 in its protocol's
    shape. SIGTERM mid-answer with no grace: both answers are cut at once, each stream ends as its protocol ends one,
    with a finish reason that says it was cut, and the server exits."""
    proc, url = start_server(tmp_path, "-P", "2", "--queue", "0", "-c", "256", "--shutdown-grace", "0")
    try:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 200, "stream": True,
                "logit_bias": {"0": -100, "1": -100, "2": -100}}  # no end of text: the slot stays busy
        ollama_body = {"model": "smollm2", "messages": body["messages"], "options": {"num_predict": 200}}
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as busy, \
                HTTP.stream("POST", f"{url}/api/chat", json=ollama_body, timeout=60) as ollama_busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the stream (the client goes away)
            next(line for line in lines if line.startswith("data:"))  # both slots are answering
            ollama_lines = ollama_busy.iter_lines()
            assert json.loads(next(ollama_lines))["done"] is False
            refused = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            refused = HTTP.post(f"{url}/api/chat", json=ollama_body, timeout=60)
            assert refused.status_code == 429 and "busy" in refused.json()["error"]
            proc.send_signal(signal.SIGTERM)  # mid-answer: they are cancelled, and their streams still end as streams
            rest = [line for line in lines if line.startswith("data:")]
            ollama_rest = [json.loads(line) for line in ollama_lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][5:])
        assert last["choices"][0]["finish_reason"] == "abort" and last["timings"]["finish_reason"] == "interrupted"
        assert ollama_rest[-1]["done"] is True and ollama_rest[-1]["done_reason"] == "abort"
        assert ollama_rest[-1]["eval_count"] < 200
        assert all(line["done"] is False for line in ollama_rest[:-1])
    finally:
        stop_server(proc)


def test_a_waiting_request_whose_client_left_holds_no_place_in_the_queue(tmp_path):
    """Issue 58: requests whose clients had left stayed counted as waiting until the engine reached them, so a busy
    slot and a queue of gone clients answered every new request 429. One slot, a queue of one: a client waits, then
    leaves; the next request takes its place and is answered."""
    proc, url = start_server(tmp_path, "-P", "1", "--queue", "1", "-c", "512")
    try:
        long = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 300, "stream": True,
                "logit_bias": {"0": -100, "1": -100, "2": -100}}  # no end of text: the slot stays busy
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the stream
            next(line for line in lines if line.startswith("data:"))  # the slot is answering
            with HTTP.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60):
                deadline = time.monotonic() + 30
                while HTTP.get(f"{url}/health", timeout=10).json().get("waiting") != 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert HTTP.get(f"{url}/health", timeout=10).json()["waiting"] == 1
            time.sleep(0.3)  # (it has left: its connection is closed)
            taken = HTTP.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert taken.status_code == 200, taken.text
    finally:
        stop_server(proc)


def test_a_short_prompt_starts_answering_beside_a_long_prefill(tmp_path):
    """Issue 60 (two Claude Code sessions at once): a request whose prompt was nearly all cached got its first token
    only when a concurrent request's long prompt had been evaluated (TTFT 77.6 s for 86 tokens left, beside 17,830):
    each pass's room went to the slot first in order. The shortest prompt left goes first now: the short request
    answers while the long one is still prefilling (passes of 64 prompt tokens: ~10 for the long prompt)."""
    from llmcli.eval.quality import default_text

    proc, url = start_server(tmp_path, "-P", "2", "-c", "1024", "-b", "64")
    try:
        order: list[str] = []
        bodies = {"long": {"messages": [{"role": "user", "content": default_text()[:2400] + "\nSummarize it."}],
                           "max_tokens": 4, "temperature": 0, "stream": True},
                  "short": {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 8,
                            "temperature": 0, "stream": True, "logit_bias": {"2": -100}}}  # (2: its end: 8 tokens)

        def stream(name: str) -> None:
            with HTTP.stream("POST", f"{url}/v1/chat/completions", json=bodies[name], timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        order.append(name)

        first = threading.Thread(target=stream, args=("long",))
        first.start()  # (the first slot: before this change, every pass's room was its until its prompt was in)
        deadline = time.monotonic() + 60
        while HTTP.get(f"{url}/health", timeout=10).json()["busy"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = threading.Thread(target=stream, args=("short",))
        second.start()
        first.join(120)
        second.join(120)
        assert "long" in order and order.count("short") >= 4, order
        assert order[:order.index("long")].count("short") >= 4, order  # (it was 0 or 1: at the long prompt's end)
    finally:
        stop_server(proc)


def test_a_public_address_needs_an_api_key():
    result = run_cli("serve", "--host", "0.0.0.0")
    assert result.code == 2 and "--api-key" in result.stderr and "Traceback" not in result.stderr


def test_a_taken_port_is_a_one_line_error_before_the_model_loads():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli("serve", "--port", str(taken.getsockname()[1]))
    assert result.code == 2 and "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr


def test_embeddings_through_the_openai_client_equal_llmcli_embed_s(server):
    """`/v1/embeddings` (issue 26, its first route): the model in embedding mode, loaded on first use — the vectors
    `llmcli embed` makes, within 1e-5; base64 as OpenAI encodes it; a bad request in OpenAI's error shape."""
    import base64
    from array import array

    import openai

    url, _ = server
    texts = ["The lighthouse keeper climbed the stairs.", "A recipe for bread.", "Tides follow the moon."]
    api = client(url)
    reply = api.embeddings.create(model="smollm2", input=texts)
    local = [json.loads(line) for line in run_cli("embed", input="\n".join(texts) + "\n").stdout.splitlines()]
    assert [d.index for d in reply.data] == [0, 1, 2]
    for remote, mine in zip(reply.data, local, strict=True):
        assert len(remote.embedding) == len(mine["embedding"])
        assert max(abs(a - b) for a, b in zip(remote.embedding, mine["embedding"], strict=True)) < 1e-5
    assert reply.usage.prompt_tokens == sum(m["tokens"] for m in local)
    raw = api.embeddings.with_raw_response.create(model="smollm2", input=texts[0], encoding_format="base64").http_response
    packed = array("f", base64.b64decode(raw.json()["data"][0]["embedding"]))
    assert max(abs(a - b) for a, b in zip(packed, local[0]["embedding"], strict=True)) < 1e-5
    with pytest.raises(openai.BadRequestError, match="dimensions must be"):
        api.embeddings.create(model="smollm2", input="hi", dimensions=7)
    with pytest.raises(openai.BadRequestError, match="input must be"):
        api.embeddings.create(model="smollm2", input=[])


def test_an_embedding_process_that_dies_fails_its_request_and_the_next_one_starts_another(server):
    """Issue 58: the model in embedding mode ran in the server's own process — llama.cpp failing on a text took `serve`
    down. It runs in a process of its own: killed while it embeds, that request fails in OpenAI's error shape (503,
    saying so), the server answers throughout, and the next request starts another that gives the same vectors."""
    import openai

    url, _ = server
    api = client(url)

    def embedding_pid() -> int | None:
        health = HTTP.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
        return health["models"][0]["embedding_pid"]

    first = api.embeddings.create(model="smollm2", input="Tides follow the moon.").data[0].embedding
    pid = embedding_pid()
    assert pid is not None and pid != server[1].pid
    failures: list[Exception] = []

    def long_request() -> None:
        try:
            api.embeddings.create(model="smollm2", input=[f"{i}: " + "The lighthouse keeper climbed the stairs. " * 8
                                                          for i in range(240)])
        except openai.APIStatusError as exc:
            failures.append(exc)

    asking = threading.Thread(target=long_request)
    started = _cpu_seconds(pid)
    asking.start()
    deadline = time.monotonic() + 120
    while _cpu_seconds(pid) < started + 0.5 and asking.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # (half a second of CPU into the request: it embeds)
    asking.join(120)
    assert len(failures) == 1 and failures[0].status_code == 503, failures
    assert "the embedding engine stopped (killed by signal 9)" in str(failures[0])
    again = api.embeddings.create(model="smollm2", input="Tides follow the moon.").data[0].embedding
    assert max(abs(a - b) for a, b in zip(again, first, strict=True)) < 1e-5
    assert embedding_pid() not in (None, pid)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_no_cors_unless_asked(server):
    import urllib.request

    url, _ = server
    request = urllib.request.Request(f"{url}/health", headers={"Origin": "https://app.example"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert "access-control-allow-origin" not in {k.lower() for k in response.headers}


def test_what_a_fault_trial_sent_is_a_400_naming_the_field_and_the_connection_stays_up(server):
    """Issue 27's hardening cases: a lone surrogate (it crashed the tokenizer: a 500 in plain text and a dropped
    connection), fields accepted and ignored, an integer called "a number", errors naming CLI flags or no field."""
    url, _ = server
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "surrogate"),
        ({"messages": hi, "frobnicate": 1}, "frobnicate", "not a field"),
        ({"messages": hi, "logit_bias": {str(10**9): 5}}, "logit_bias", "outside the vocabulary"),
        ({"messages": hi, "max_tokens": 4.5}, "max_tokens", "an integer"),
        ({"messages": hi, "tools": "x"}, "tools", "list"),
        ({"messages": hi, "audio": {"voice": "x"}}, "audio", "not supported"),
        ({"messages": hi, "grammar": "root ::= ("}, "grammar", "grammar"),
        ({"messages": hi, "response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "JSON Schema"),
    ]
    with httpx2.Client(headers=headers, timeout=60) as http:  # one connection, kept alive through every case
        for body, param, words in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = http.post(f"{url}/v1/chat/completions", content=content)
            assert reply.status_code == 400 and reply.headers["content-type"] == "application/json", reply.text
            error = reply.json()["error"]
            assert words in error["message"] and error["param"] == param, error
            assert "--" not in error["message"], error  # no CLI flag named to an HTTP client
        completion = http.post(f"{url}/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1,
                                                                "stream": True, "max_tokens": 2})  # (echo is answered,
        assert completion.status_code == 400 and completion.json()["error"]["param"] == "echo"  # streamed: no logprobs)
        assert http.post(f"{url}/v1/chat/completions", json={"messages": hi, "max_tokens": 2}).status_code == 200


def test_sigterm_lets_the_answers_in_flight_finish_within_the_grace(tmp_path):
    """A whole (not streamed) answer and a stream in flight when SIGTERM comes: both finish, complete, within
    --shutdown-grace; the server exits with 143 and no traceback (stop_server checks its log)."""
    proc, url = start_server(tmp_path, "-P", "2", "-c", "256", "--shutdown-grace", "60")
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 48,
            "logit_bias": {"0": -100, "1": -100, "2": -100}}  # no end of text: exactly 48 tokens
    replies: dict[str, object] = {}

    def whole() -> None:
        replies["whole"] = HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

    try:
        with HTTP.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            thread = threading.Thread(target=whole)
            thread.start()
            deadline = time.monotonic() + 30
            while HTTP.get(f"{url}/health").json()["busy"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        thread.join(timeout=120)
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert replies["whole"]["choices"][0]["finish_reason"] == "length"
        assert replies["whole"]["usage"]["completion_tokens"] == 48
        assert proc.wait(timeout=60) == 143
        said = LOGS[proc.pid].read_text()
        assert "waiting up to 60 s for 2 answers in flight (a second signal cuts them)" in said  # not a silent wait
    finally:
        stop_server(proc)


def test_slow_and_idle_connections_are_closed_and_their_number_is_capped(tmp_path):
    """A slowloris (a header byte at a time), a connection that never sends, a body that never ends: each is closed
    (or a 408) after --header-timeout; beyond --max-connections, connections are closed as they open."""
    import socket

    proc, url = start_server(tmp_path, "-c", "256", "--header-timeout", "1", "--max-connections", "4")
    port = int(url.rsplit(":", 1)[1])

    def closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> bool:
        """Whether the server closes `sock` within `seconds` (sending `drip` a byte at a time meanwhile)."""
        sock.settimeout(0.25)
        deadline, sent = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            try:
                if sent < len(drip):
                    sock.sendall(drip[sent:sent + 1])
                    sent += 1
                if sock.recv(4096) == b"":
                    return True
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                return True
        return False

    try:
        slowloris = socket.create_connection(("127.0.0.1", port))
        assert closed_within(slowloris, 8, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60)
        idle = socket.create_connection(("127.0.0.1", port))
        assert closed_within(idle, 8)
        slow_body = socket.create_connection(("127.0.0.1", port))
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"messages\":")
        slow_body.settimeout(8)
        assert slow_body.recv(4096).startswith(b"HTTP/1.1 408")
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        dropped = sum(closed_within(sock, 0.5) for sock in held)
        assert dropped >= 4  # the cap: past the fourth (a client's share: the second), the idlest one makes room
        for sock in [slowloris, idle, slow_body, *held]:
            sock.close()
        assert HTTP.get(f"{url}/health", timeout=10).json()["status"] == "ok"  # and the server serves on
    finally:
        stop_server(proc)


def test_a_new_session_leaves_the_slot_of_the_last_one_whole(server):
    """Issue 60: a new agent session (the same system prompt, a new conversation) was put in the slot that shared most
    with it — the previous session's — and cut it back to their shared prefix, so the previous session's next turn
    evaluated its whole conversation again. A free slot is given a copy of the shared prefix instead: both reuse all
    they can."""
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    system = {"role": "system", "content": "You are a coding agent. " + " ".join(
        f"Rule {i}: keep file number {i} tidy and the diff small." for i in range(12))}

    def chat(messages: list[dict]) -> dict:
        response = HTTP.post(f"{url}/v1/chat/completions", headers=auth, timeout=120, json={
            "messages": messages, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()

    session = [system, {"role": "user", "content": "Fix the loop in main.py: " + "it skips the last file; " * 6}]
    first = chat(session)
    other = chat([system, {"role": "user", "content": "Write a README with the install steps."}])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # (the system prompt, shared)
    turn = chat([*session, first["choices"][0]["message"], {"role": "user", "content": "Now add a test."}])
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1, (
        first["usage"], turn["usage"])
