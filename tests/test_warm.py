"""`--keep-alive` (issue 27, part 2): `run` answers through a private warm server of its model, reached over a Unix
socket only its user may open, started on first use and gone after the keep-alive; `llmcli ps` and `llmcli stop`.
Greedy answers equal in-process ones; a killed server is replaced; Ctrl-C cancels the server-side answer."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ScoredAnswer, run_cli, scored, spawn_cli, where_greedy_answers_part

from llmcli import reaper

PROMPT = "Say hi."


@pytest.fixture
def runtime():
    """The test's runtime dir (tests/conftest.py: every warm server started in it ends with the test)."""
    return {"LLMCLI_RUNTIME_DIR": os.environ["LLMCLI_RUNTIME_DIR"]}


def answer(env: dict[str, str], *args: str, prompt: str = PROMPT) -> dict:
    result = run_cli("run", "--json", "--temp", "0", "-n", "16", "--no-prompt-cache", *args, prompt, env=env)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def servers(env: dict[str, str]) -> list[dict]:
    result = run_cli("ps", "--json", env=env)
    assert result.code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not reaper.alive(pid):  # (a zombie that init has not reaped yet holds nothing)
            return True
        time.sleep(0.1)
    return False


def test_an_exited_process_that_init_has_not_reaped_yet_is_gone():
    """`llmcli stop` waits for the server to be gone: a server that has exited stays a zombie until init reaps it,
    which some inits do only every few seconds (and a container's PID 1 may never do)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pid, 0)  # a zombie still takes signal 0: "is it there?" is the wrong question
        assert not reaper.alive(pid) and reaper.alive(os.getpid())
    finally:
        os.waitpid(pid, 0)
    assert not reaper.alive(pid)


LONG = "Say hi to the sea, the sky, the hills, the rivers, the forests, the towns, the roads and the harbours of the coast."
OTHER = "Name three colours that a painter of the mountains, the snow, the lakes and the meadows of the north would mix."


def test_a_warm_run_answers_as_in_process_over_a_private_socket_and_stop_ends_it(runtime):
    in_process = answer(runtime, "--logprobs", "5", prompt=LONG)
    cold = answer(runtime, "--keep-alive", "5m", "--logprobs", "5", prompt=LONG)  # starts the server
    warm = answer(runtime, "--keep-alive", "5m", "--logprobs", "5", prompt=LONG)  # finds it
    here, *served = [ScoredAnswer(r["text"], r["finish_reason"], tuple(scored(r["logprobs"])))
                     for r in (in_process, cold, warm)]
    assert [where_greedy_answers_part(here, other) for other in served] == [None, None]  # (the same, or parted at a
    # near-tie: the warm one's prompt came from the slot's cache, not one prefill)
    assert warm["usage"]["cached_tokens"] > 0  # the prompt stayed in the server's slot
    # Another prompt takes its one slot: what the slot held is kept (serve's --cache-ram) and given back to the next
    # run of the first conversation, not evaluated again (without it: the template's opening alone, ~20 tokens).
    other = answer(runtime, "--keep-alive", "5m", prompt=OTHER)
    assert other["usage"]["cached_tokens"] < warm["usage"]["cached_tokens"] - 32
    again = answer(runtime, "--keep-alive", "5m", prompt=LONG)
    assert again["text"] == warm["text"] and again["usage"]["cached_tokens"] == warm["usage"]["cached_tokens"]
    (server,) = servers(runtime)
    socket = Path(server["socket"])
    assert stat.S_IMODE(socket.stat().st_mode) == 0o600 and stat.S_IMODE(socket.parent.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(socket.stat().st_mode) and server["models"][0]["path"].endswith(".gguf")
    stopped = run_cli("stop", "smollm2", env=runtime)
    assert stopped.code == 0 and "stopped" in stopped.stderr
    assert gone(server["pid"], 30) and not socket.exists() and list(socket.parent.iterdir()) == []
    none_left = run_cli("stop", env=runtime)
    assert none_left.code == 0 and "no warm server is running" in none_left.stderr  # stopping nothing is done
    assert run_cli("stop", "smollm2", env=runtime).code == 0  # a model without a server: nothing to stop
    assert run_cli("stop", "no-such-model", env=runtime).code == 3  # a name that means no model


def test_run_chat_and_embed_are_warm_by_default_and_keep_alive_0_answers_in_this_process(runtime):
    """No --keep-alive: the first run starts the model's warm server and says so once (never again); the next answers
    warm, as the stats line and --json say; `--keep-alive 0` and LLMCLI_KEEP_ALIVE=0 answer in this process."""
    default = {**runtime, "LLMCLI_THREADS": "1"}  # (as the suite's workers set it: -n0 too)
    (Path(os.environ["LLMCLI_DATA_DIR"]) / "warm-servers-explained").unlink()  # (the suite's tests have seen it)
    first = run_cli("run", "-m", "smollm2", "--temp", "0", "-n", "8", PROMPT, env=default)
    assert first.code == 0 and first.stdout, first.stderr
    assert first.stderr.count("stays loaded for 5m after each answer") == 1 and "llmcli stop" in first.stderr
    assert "load " in first.stderr.splitlines()[-1] and "warm" not in first.stderr.splitlines()[-1]
    again = run_cli("run", "-m", "smollm2", "--temp", "0", "-n", "8", "--json", PROMPT, env=default)
    assert again.code == 0 and "stays loaded" not in again.stderr  # said once
    record = json.loads(again.stdout)
    assert record["timings"]["warm"] is True and record["timings"]["load_s"] == 0
    assert record["timings"]["threads"] == record["timings"]["prefill_threads"] == 1  # the server's (LLMCLI_THREADS)
    assert record["timings"]["kv_cells"] == 512  # a warm server's slot grows with the work, as a local run's cache
    assert record["text"] == first.stdout.rstrip("\n")
    assert run_cli("run", "-m", "smollm2", "-n", "2", PROMPT, env=default).stderr.splitlines()[-1].startswith("warm · ")
    imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmcli", "run", "-m", "smollm2", "-n", "1",
                               PROMPT], env={**os.environ, **default}, capture_output=True, text=True, timeout=60)
    modules = {line.split("|")[-1].strip() for line in imported.stderr.splitlines() if "|" in line}
    assert imported.returncode == 0 and "llmcli.pipeline.remote" in modules  # a warm answer's client side loads no
    assert not {"llama_cpp", "numpy", "jinja2", "markdown_it"} & modules  # llama.cpp, numpy, templates or Markdown
    chat = run_cli("chat", "-m", "smollm2", "--no-save", "-n", "2", input="/set on_overflow truncate\nhi\nhi again\n/show\n",
                   env=default)
    stats = [line for line in chat.stderr.splitlines() if " · stop: " in line]
    assert chat.code == 0 and len(stats) == 2 and all(line.startswith("warm · ") for line in stats), chat.stderr
    shown = re.search(r"context  (\d+) / 4096 tokens used by the conversation as of its last answer \((\d+) of that "
                      r"prompt from the warm server's cache\), 2 exchanges", chat.stdout + chat.stderr)
    assert shown and int(shown.group(1)) > int(shown.group(2)) > 0, chat.stdout  # (the first exchange, reused: it
    # said "(0 in the KV cache)", the last prompt's cached count named as the cache's)
    assert "--on-overflow = truncate" in chat.stderr and "not used" not in chat.stderr  # (the warm server takes it)
    embedded = run_cli("embed", "-m", "smollm2", PROMPT, env=default)
    assert embedded.code == 0 and len(json.loads(embedded.stdout)) > 8 and "stays loaded" not in embedded.stderr
    (server,) = servers(default)  # one server answered them all
    assert server["models"][0]["name"] == "smollm2"  # the name the user gave
    table = run_cli("ps", env=default).stdout.splitlines()
    assert table[0].split() == ["MODEL", "CONTEXT", "PID", "FILE", "MEMORY", "BUSY", "RESTARTS", "EXITS",
                                  "WHERE"]  # as `list`
    assert table[1].split()[:3] == ["smollm2", "4096", str(server["pid"])] and not any(c in "\n".join(table) for c in "┃━│")
    for off in ({**default, "LLMCLI_KEEP_ALIVE": "0"}, default):
        here = run_cli("run", "-m", "smollm2", "-n", "2", *(["--keep-alive", "0"] if off is default else []), PROMPT,
                       env=off)
        assert here.code == 0 and here.stderr.splitlines()[-1].startswith("load "), here.stderr
    assert servers(default) == [server] or [s["pid"] for s in servers(default)] == [server["pid"]]
    batch = run_cli("run", "-m", "smollm2", "-n", "2", "--batch", "-", input="hi\nho\n", env=default)
    assert batch.code == 0 and "parallel" in batch.stderr and servers(default)[0]["pid"] == server["pid"]
    stopped = run_cli("stop", env=default)
    assert stopped.code == 0 and gone(server["pid"], 30)


def test_warm_servers_never_outnumber_max_models_and_count_in_the_next_memory_check(runtime, gemma3, monkeypatch):
    from llmcli.pipeline.warm import held_by_others

    default = {**runtime, "LLMCLI_KEEP_ALIVE": ""}
    assert run_cli("run", "-m", "smollm2", "-n", "1", PROMPT, env=default).code == 0
    (small,) = servers(default)
    monkeypatch.setenv("LLMCLI_RUNTIME_DIR", runtime["LLMCLI_RUNTIME_DIR"])
    held = held_by_others(Path(gemma3))
    assert held > 0 and held_by_others(Path(small["models"][0]["path"])) == 0  # its own file is not counted twice
    other = run_cli("run", "-m", str(gemma3), "--max-models", "1", "-n", "1", PROMPT, env=default)
    assert other.code == 0, other.stderr
    (left,) = servers(default)  # the one idle the longest made room
    assert left["models"][0]["path"] == str(Path(gemma3).resolve()) and gone(small["pid"], 30)
    assert run_cli("stop", env=default).code == 0 and gone(left["pid"], 30)


def test_a_killed_server_is_replaced_and_an_idle_one_exits_leaving_nothing(runtime):
    first = answer(runtime, "--keep-alive", "5m")
    (server,) = servers(runtime)
    os.kill(server["pid"], signal.SIGKILL)  # its socket stays behind, dead
    assert gone(server["pid"], 10) and Path(server["socket"]).exists()
    again = answer(runtime, "--keep-alive", "5m")  # the dead socket is replaced by a new server's
    (revived,) = servers(runtime)
    assert again["text"] == first["text"] and revived["pid"] != server["pid"]
    answer(runtime, "--keep-alive", "2s")  # each run's keep-alive is the server's from then on
    assert servers(runtime)[0]["models"][0]["expires_in_s"] <= 2
    assert gone(revived["pid"], 30) and not Path(revived["socket"]).exists()  # idle 2 s: it exits, its socket too
    assert list(Path(revived["socket"]).parent.iterdir()) == []


def test_a_model_file_rewritten_under_its_warm_server_gets_a_server_of_its_own(runtime, tmp_path, smollm2,
                                                                              packaged_smollm2):
    """A file rewritten in place (`quantize --force`, a new download to the same path) was answered by the server
    started for its old content, with the old weights (and one whose mapped file was cut short held each run 4 s on
    its /health). The file as it is now has its own server; `stop` ends both."""
    model = tmp_path / "model.gguf"
    shutil.copy(smollm2, model)
    answer(runtime, "-m", str(model), "--keep-alive", "5m")
    (old,) = servers(runtime)
    shutil.copy(packaged_smollm2, model)  # the same path and inode, another quant (Q4_1 over Q4_0)
    answer(runtime, "-m", str(model), "--keep-alive", "5m")
    new = [server for server in servers(runtime) if server["pid"] != old["pid"]]
    assert len(new) == 1 and new[0]["socket"] != old["socket"]
    stopped = run_cli("stop", str(model), env=runtime)
    assert stopped.code == 0 and gone(old["pid"], 30) and gone(new[0]["pid"], 30)


def test_ctrl_c_cancels_the_answer_on_the_server(runtime):
    answer(runtime, "--keep-alive", "5m")
    (server,) = servers(runtime)
    proc = spawn_cli("run", "--keep-alive", "5m", "-n", "4000", "--logit-bias", "2=-inf", "--logit-bias", "0=-inf",
                     "--logit-bias", "1=-inf", "Tell a very long story.", env=runtime)
    assert proc.stdout is not None
    assert proc.stdout.read(16)  # it is answering
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"warm \xc2\xb7 prompt " in err and b"stop: interrupted" in err, err  # (issue 57: `warm · 0 tok`)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        (state,) = servers(runtime)
        if state["models"][0]["slots"]["busy"] == 0:
            break
        time.sleep(0.1)
    assert state["models"][0]["slots"]["busy"] == 0 and state["pid"] == server["pid"]  # cancelled, server still up


def test_a_warm_server_that_cannot_start_leaves_nothing_in_the_runtime_dir(runtime, gemma3):
    """A setting the server refuses once it has bound its socket (a draft model of another vocabulary: its load's
    check): the run says so as in-process, and no socket, log or lock of that start is left (they were, for good: no
    server ever answers on that socket to remove them). What can be refused before a load starts no server at all:
    a context no memory here holds (the server's memory check, made before it starts: exit 6, as in-process), a
    setting's form."""
    started = Path(os.environ["LLMCLI_TEST_FORKED"])  # (each warm server a test's run starts is noted there)
    result = run_cli("run", "-c", "10000000", "-n", "2", PROMPT, env=runtime)
    assert result.code == 6 and "of memory (model" in result.stderr and "--force" in result.stderr
    assert not started.exists() or not started.read_text().split()  # (no server started to refuse it)
    forced = run_cli("run", "--force", "-c", "10000000", "-n", "2", PROMPT, env=runtime)  # (this process tries: its
    assert forced.code == 0 and forced.stdout, forced.stderr  # KV cache grows with the answer)
    assert "--force: a warm server would refuse a model that may not fit in memory; answering in this process" \
        in forced.stderr
    assert not started.exists() or not started.read_text().split()
    result = run_cli("run", "--draft-model", str(gemma3), "-n", "2", PROMPT, env=runtime)
    assert result.code == 2 and "cannot draft for this model" in result.stderr, result.stderr
    folder = Path(runtime["LLMCLI_RUNTIME_DIR"]) / "servers"
    left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    assert left == [], left
    noted = started.read_text().split()
    assert len(noted) == 1  # (the one that could not start)
    for args, says in ((["--draft-model", "no-such-draft"], "unknown model 'no-such-draft'"),
                       (["--speculate", "draft"], "--speculate draft needs a --draft-model"),
                       (["--logit-bias", "bad"], "--logit-bias 'bad': expected TOKEN=BIAS"),
                       (["--mmproj", "/no/such/mmproj.gguf"], "--mmproj /no/such/mmproj.gguf: no such file")):
        refused = run_cli("run", *args, "-n", "2", PROMPT, env=runtime)
        assert refused.code == (3 if "unknown model" in says else 2) and says in refused.stderr
    assert started.read_text().split() == noted  # (refused by their form: before a warm server was started)


def test_an_edited_chat_template_file_is_another_warm_server_s(runtime, tmp_path):
    """A warm server reads --chat-template-file when it starts: an edited file is another server's (the edit was
    ignored until the first server exited, while --show-prompt, rendered here, showed the new prompt); an unreadable
    one is refused before a server starts, as in-process."""
    template = tmp_path / "brief.jinja"
    template.write_text("{% for m in messages %}A: {{ m.content }}\n{% endfor %}B:")
    first = answer(runtime, "--chat-template-file", str(template))
    template.write_text("{% for m in messages %}Question asked by the user: {{ m.content }}\n{% endfor %}B:")
    edited = answer(runtime, "--chat-template-file", str(template))
    here = answer(runtime, "--keep-alive", "0", "--chat-template-file", str(template))
    assert edited["usage"]["prompt_tokens"] == here["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert len(servers(runtime)) == 2  # (the first file's server until it idles out)
    started = Path(os.environ["LLMCLI_TEST_FORKED"]).read_text().split()
    missing = run_cli("run", "--chat-template-file", str(tmp_path / "gone.jinja"), "-n", "2", PROMPT, env=runtime)
    assert missing.code == 2 and f"cannot read --chat-template-file {tmp_path / 'gone.jinja'}" in missing.stderr
    assert Path(os.environ["LLMCLI_TEST_FORKED"]).read_text().split() == started


def test_a_runtime_dir_too_deep_for_a_socket_answers_in_process_and_says_why(tmp_path):
    deep = tmp_path / ("d" * 100)
    result = run_cli("run", "--keep-alive", "5m", "--temp", "0", "-n", "4", PROMPT, env={"LLMCLI_RUNTIME_DIR": str(deep)})
    assert result.code == 0 and result.stdout and "too long for a Unix socket" in result.stderr
    assert "answering in this process" in result.stderr


@pytest.mark.parametrize("begun", [False, True, "sampled"])
def test_a_server_that_goes_away_leaves_the_answer_to_this_process(runtime, monkeypatch, begun):
    """A warm server that answers /health, then drops the request (it crashed after it was found) — at once, or after
    streaming the answer's first characters: the run loads the model itself and answers, with one notice; what the
    terminal shows is the in-process answer, once (the characters already shown are not shown again)."""
    import http.server
    import socketserver
    import threading

    from llmcli import __version__
    from llmcli.pipeline import Request, resolve_settings
    from llmcli.pipeline.warm import socket_for

    here = run_cli("run", "--temp", "0", "-n", "16", "--no-prompt-cache", "--keep-alive", "0", PROMPT, env=runtime)
    monkeypatch.setenv("LLMCLI_RUNTIME_DIR", runtime["LLMCLI_RUNTIME_DIR"])
    effective, model = resolve_settings(Request(settings={"keep_alive": "5m"}))
    socket = socket_for(model.path, effective, None)
    socket.parent.mkdir(parents=True, mode=0o700)
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "smollm2", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "Once upon a" if begun == "sampled" else here.stdout[:6]},
         "finish_reason": None}]}

    class Vanishing(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"status": "ok", "model": "smollm2", "version": __version__, "pid": 0}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            if begun:  # the answer's first characters, then the connection ends mid-stream
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            return

    fake = socketserver.UnixStreamServer(str(socket), Vanishing)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    try:
        if begun == "sampled":  # (issue 58: it printed a second, whole answer after the first's start)
            warm = run_cli("run", "--keep-alive", "5m", "--temp", "0.8", "--seed", "7", "-n", "16", "--json",
                           "--no-prompt-cache", PROMPT, env=runtime)
            assert warm.code == 0, warm.stderr
            record = json.loads(warm.stdout)
            assert record["text"].startswith("Once upon a") and len(record["text"]) > len("Once upon a") + 2
            assert "went away" in warm.stderr and "starts again" not in warm.stderr  # one answer, gone on from its start
            return
        warm = run_cli("run", "--keep-alive", "5m", "--temp", "0", "-n", "16", "--no-prompt-cache", PROMPT, env=runtime)
        assert warm.code == 0, warm.stderr
        assert warm.stdout == here.stdout and "went away" in warm.stderr and "starts again" not in warm.stderr
    finally:
        fake.shutdown()
        fake.server_close()
        socket.unlink(missing_ok=True)


def test_a_server_loading_its_model_never_asks_its_own_socket(runtime, monkeypatch):
    """`serve --socket` listens before its model loads, and the load's memory check asks each warm server what it
    holds: never its own socket, where nothing answers yet (it waited health's whole timeout, 2 s, at every start)."""
    import http.server
    import socketserver
    import threading

    from llmcli import paths
    from llmcli.pipeline import warm

    monkeypatch.setenv("LLMCLI_RUNTIME_DIR", runtime["LLMCLI_RUNTIME_DIR"])
    monkeypatch.setattr(warm, "_LISTENING_HERE", set())
    socket = paths.warm_servers_dir() / "own.sock"
    socket.parent.mkdir(parents=True, mode=0o700)

    class Answering(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"pid": os.getpid(), "models": [{"path": "/elsewhere.gguf"}]}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    fake = socketserver.UnixStreamServer(str(socket), Answering)
    serving = threading.Thread(target=fake.serve_forever, daemon=True)
    serving.start()
    try:
        assert [found for found, _ in warm.running()] == [socket]  # another process's server: asked, counted
        assert warm.held_by_others(Path("/a/model.gguf")) > 0
        warm.listening_here(socket)
        assert warm.running() == [] and warm.held_by_others(Path("/a/model.gguf")) == 0
    finally:
        fake.shutdown()
        fake.server_close()
        serving.join()  # (the next tests fork their CLI runs only while this process is single-threaded)


def test_embed_through_the_warm_server_gives_the_in_process_vectors(runtime):
    lines = "A lighthouse keeper climbed the stairs.\nA recipe for bread.\n"
    here = [json.loads(line) for line in run_cli("embed", "--normalize", input=lines, env=runtime).stdout.splitlines()]
    warm = run_cli("embed", "--normalize", "--keep-alive", "5m", input=lines, env=runtime)
    assert warm.code == 0, warm.stderr
    served = [json.loads(line) for line in warm.stdout.splitlines()]
    assert [r["tokens"] for r in served] == [r["tokens"] for r in here]
    for remote, mine in zip(served, here, strict=True):
        assert max(abs(a - b) for a, b in zip(remote["embedding"], mine["embedding"], strict=True)) < 1e-5
    assert len(servers(runtime)) == 1


def test_without_the_serve_extra_answers_are_given_in_this_process_quietly_unless_warm_was_asked_for(runtime,
                                                                                                    monkeypatch):
    import llmcli.pipeline.warm

    monkeypatch.setattr(llmcli.pipeline.warm, "serve_installed", lambda: False)  # (the forked runs inherit it)
    default = {**runtime, "LLMCLI_KEEP_ALIVE": ""}
    quiet = run_cli("run", "-m", "smollm2", "-n", "2", PROMPT, env=default)
    assert quiet.code == 0 and quiet.stderr.startswith("load ") and "serve" not in quiet.stderr, quiet.stderr
    asked = run_cli("run", "-m", "smollm2", "-n", "2", "--keep-alive", "5m", PROMPT, env=default)
    assert asked.code == 0 and "a warm server needs the serve extra" in asked.stderr and servers(default) == []
