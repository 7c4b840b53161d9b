"""The engine in a supervised process (issue 58): a dead engine is started again and the answers in flight go on; a
step past --step-timeout fails the request it was sampling, and only it."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import LOGS, ScoredAnswer, run_cli, scored, start_server, stop_server, where_greedy_answers_part

KEY = "engine-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["Tell me about the sea.", "Write a story about a cat.", "Explain how rain forms.", "Describe a city at night."]


def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()  # (the pids: only with the key)


def _stream(url: str, prompt: str, seen: list[int], index: int) -> ScoredAnswer:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 112,
            "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 5}
    text, finish, tokens = "", None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
            tokens += scored((choice.get("logprobs") or {}).get("content") or ())
            seen[index] = len(text)
    return ScoredAnswer(text, finish, tuple(tokens))


def _answer_all(url: str) -> tuple[list[ScoredAnswer | None], list[int], list[threading.Thread]]:
    results: list[ScoredAnswer | None] = [None] * len(PROMPTS)
    seen = [0] * len(PROMPTS)

    def ask(index: int) -> None:
        results[index] = _stream(url, PROMPTS[index], seen, index)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    return results, seen, threads


@pytest.mark.long
def test_four_streams_complete_through_three_engine_deaths_and_health_answers_throughout(tmp_path, smollm2):
    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "4", "-c", "512", "--api-key", KEY)  # (4 × 512 cells:
    # each of the four engine starts zeroes 47 MB of KV cache, not 377)
    try:
        undisturbed, _, threads = _answer_all(url)
        for thread in threads:
            thread.join(120)
        first = _health(url)["engine"]
        assert first["state"] == "running" and first["restarts"] == 0 and first["pid"] not in (0, proc.pid)
        assert "pid" not in httpx.get(f"{url}/health", timeout=10).json()["engine"]  # (not to a caller without the key)

        results, seen, threads = _answer_all(url)
        statuses = []
        for sig in (signal.SIGSEGV, signal.SIGKILL, signal.SIGSEGV):
            marks = list(seen)  # each kill lands while every stream is still going (and after it has gone on)
            wait_until(lambda marks=marks: all(s >= m + 16 or r is not None
                                               for s, m, r in zip(seen, marks, results, strict=True)), 60)
            pid = _health(url)["engine"]["pid"]
            os.kill(pid, sig)
            statuses.append(_health(url)["status"])  # answered at once, while the engine starts again
            wait_until(lambda pid=pid: _health(url)["engine"]["pid"] != pid, 60)
        for thread in threads:
            thread.join(120)

        assert all(r is not None and r.finish in ("stop", "length") and r.tokens for r in results), results
        parted = [where_greedy_answers_part(a, b) for a, b in zip(undisturbed, results, strict=True)]  # type: ignore[arg-type]
        assert parted == [None] * len(PROMPTS), parted  # (greedy: the text an undisturbed run gives, or the same
        # up to a near-tie — never a token lost, repeated or chosen on a wrong cache)
        engine = _health(url)["engine"]
        assert engine["restarts"] == 3 and engine["state"] == "running"
        assert set(statuses) <= {"ok", "degraded"}
        log = LOGS[proc.pid].read_text()  # one line a restart, with its cause
        assert log.count("started again in") == 3 and "killed by SIGSEGV" in log and "killed by SIGKILL" in log
    finally:
        stop_server(proc)


def test_a_grammar_that_stalls_the_sampler_fails_alone_after_the_step_timeout(tmp_path, smollm2):
    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "2", "--step-timeout", "2")
    try:
        token_a = 81  # SmolLM2's "a"
        outcome: dict[str, httpx.Response] = {}

        def hostile() -> None:  # ambiguous: every "a" doubles the grammar's stacks (minutes per token soon)
            outcome["hostile"] = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "go"}], "max_tokens": 64,
                "temperature": 0, "logit_bias": {str(token_a): 100},
                "grammar": 'root ::= r\nr ::= "a" r "b" | "a" r "c" | ""'})

        said: set[str] = set()  # /health throughout: ok, degraded while the step is past its limit and the engine
        done = threading.Event()  # is ended and started again, ok again

        def watch() -> None:
            while not done.is_set():
                said.add(httpx.get(f"{url}/health", timeout=10).json()["status"])
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        thread = threading.Thread(target=hostile)
        thread.start()
        time.sleep(0.5)
        normal = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 24, "temperature": 0})
        thread.join(120)
        done.set()
        watcher.join(30)
        assert said == {"ok", "degraded"}, said
        assert normal.status_code == 200 and normal.json()["choices"][0]["message"]["content"]
        refused = outcome["hostile"]
        assert refused.status_code == 400
        assert "step limit (2 s" in refused.json()["error"]["message"], refused.text
        engine = _health(url)["engine"]
        assert engine["restarts"] == 1 and engine["last_restart"]["cause"] == "a step took longer than 2 s"
        again = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 24, "temperature": 0})
        assert again.json()["choices"][0]["message"]["content"] == normal.json()["choices"][0]["message"]["content"]
    finally:
        stop_server(proc)


def test_ps_shows_each_warm_server_s_restarts():
    done = run_cli("run", "-n", "4", "hi")
    assert done.code == 0
    shown = run_cli("ps", "--json")
    record = json.loads(shown.stdout.splitlines()[0])
    engine = record["models"][0]["slots"]["engine"]
    os.kill(engine["pid"], signal.SIGKILL)
    wait_until(lambda: json.loads(run_cli("ps", "--json").stdout.splitlines()[0])["models"][0]["slots"]["engine"]
               ["restarts"] == 1, 60)
    table = run_cli("ps").stdout.splitlines()
    column = table[0].index("RESTARTS")
    assert table[1][column:].split()[0] == "1"
    again = run_cli("run", "-n", "4", "hi")  # (the restarted engine answers; its text may differ: threads adapt)
    assert again.code == 0 and again.stdout.strip() and "warm" in again.stderr


def test_a_request_waiting_for_a_slot_through_two_deaths_is_no_suspect(tmp_path, smollm2):
    """One slot: an answer streams while another request waits for the slot; the engine dies twice (each time after the
    answer has gone on): the waiting request made no progress, but it held no slot — both complete."""
    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "1", "--api-key", KEY)
    try:
        seen = [0]
        results: dict[str, object] = {}

        def first() -> None:
            results["first"] = _stream(url, PROMPTS[0], seen, 0)

        def second() -> None:
            results["second"] = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json={
                "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 16, "temperature": 0})

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        threads[0].start()
        wait_until(lambda: seen[0] > 0, 60)
        threads[1].start()
        for _ in range(2):
            mark = seen[0]
            wait_until(lambda mark=mark: seen[0] >= mark + 16 or "first" in results, 60)
            assert "first" not in results and "second" not in results  # (still streaming; still waiting)
            pid = _health(url)["engine"]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda pid=pid: _health(url)["engine"]["pid"] != pid, 60)
        for thread in threads:
            thread.join(120)
        assert results["first"].finish in ("stop", "length")
        waited = results["second"]
        assert waited.status_code == 200 and waited.json()["choices"][0]["message"]["content"], waited.text
        assert _health(url)["engine"]["restarts"] == 2
    finally:
        stop_server(proc)


def test_a_request_in_flight_at_two_deaths_without_progress_fails_alone(tmp_path, smollm2):
    """The engine dies twice while a request holds its slot and has made no progress (its long prompt is one chunk: no
    progress until its first token): it is the likely cause, it fails (500), and the server answers the next one."""
    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "1", "-b", "2048", "--api-key", KEY)
    try:
        outcome: dict[str, httpx.Response] = {}
        long = {"messages": [{"role": "user", "content": "word " * 1500}], "max_tokens": 4, "temperature": 0}

        def ask() -> None:
            outcome["long"] = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json=long)

        thread = threading.Thread(target=ask)
        thread.start()
        for _ in range(2):  # each time it holds the slot again, before its prompt is evaluated
            wait_until(lambda: _health(url)["busy"] == 1 or "long" in outcome, 60)
            assert "long" not in outcome, outcome["long"].text
            pid = _health(url)["engine"]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda pid=pid: _health(url)["engine"]["pid"] != pid, 60)
        thread.join(120)
        failed = outcome["long"]
        assert failed.status_code == 500 and "died twice" in failed.json()["error"]["message"], failed.text
        after = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0})
        assert after.status_code == 200 and _health(url)["engine"]["restarts"] == 2
    finally:
        stop_server(proc)


def _mapped(pid: int, path: Path) -> bool:
    """Whether process `pid` maps the file at `path` (a model's weights loaded with mmap)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def test_the_zygote_keeps_a_model_s_weights_from_its_first_restart_until_the_model_is_unloaded(tmp_path, smollm2,
                                                                                               isolated_env, monkeypatch):
    """An engine's death makes the zygote load that model's weights and keep them: the next restarts load nothing (on
    an 8B-shaped model, 4.7 s → 0.4 s) and answer as before; unloading the model frees them in the zygote too."""
    monkeypatch.setenv("HOME", str(isolated_env / "home"))
    folder = isolated_env / "home" / ".lmstudio" / "models" / "tests" / "copy"  # (a place a request may name)
    folder.mkdir(parents=True)
    model = folder / "copy.gguf"
    os.link(smollm2, model)  # (weights the test process does not keep: any the zygote has are its own doing)
    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "1", "--api-key", KEY)
    try:
        def ask() -> str:
            answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json={
                "model": str(model), "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
                "temperature": 0})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["message"]["content"]

        def engine() -> dict:
            (served,) = [m for m in _health(url)["models"] if not m["pinned"]]
            return served["slots"]["engine"]

        before = ask()
        zygote = int(Path(f"/proc/{engine()['pid']}/stat").read_text().rpartition(")")[2].split()[1])  # (its parent)
        assert not _mapped(zygote, model)
        for restart, weights in ((1, "loaded"), (2, "kept"), (3, "kept")):
            pid = engine()["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda pid=pid: engine()["pid"] != pid and engine()["state"] == "running", 60)
            assert engine()["restarts"] == restart and engine()["last_restart"]["weights"] == weights
            assert _mapped(zygote, model)
            assert ask() == before
        log = LOGS[proc.pid].read_text()
        assert log.count("weights loaded") == 1 and log.count("weights kept") == 2, log
        httpx.post(f"{url}/api/generate", headers=AUTH, timeout=60, json={"model": str(model), "prompt": "",
                                                                         "keep_alive": 0})
        wait_until(lambda: not _mapped(zygote, model), 30)  # unloaded: the zygote keeps nothing of it
    finally:
        stop_server(proc)


def test_a_cache_that_cannot_grow_fails_its_request_alone_and_the_server_answers_on(tmp_path, smollm2):
    """A server whose KV cache grows with the work (--exit-when-idle: warm servers, launch's) and an engine whose
    memory is capped (RLIMIT_AS, set on its process: ~40 MiB more than it holds): a prompt that needs ~3,000 cells
    cannot have them — its request fails (500, llama.cpp's words and llmcli's hint), the engine goes on with the cache
    it had (its conversation still cached: the next answer reuses it)."""
    import resource

    proc, url = start_server(tmp_path, "-m", str(smollm2), "-P", "1", "--exit-when-idle", "--keep-alive", "5m",
                             "--api-key", KEY)
    try:
        def ask(text: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0})

        first = ask("Say hi")
        assert first.status_code == 200
        pid = _health(url)["engine"]["pid"]
        held = int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) << 10
        _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
        resource.prlimit(pid, resource.RLIMIT_AS, (held + (40 << 20), hard))
        refused = ask("word " * 3000)
        assert refused.status_code == 500, refused.text
        error = refused.json()["error"]
        assert error["message"].startswith("llama.cpp could not create a context of 3072 tokens")
        assert error["llmcli_error"]["exit_code"] == 6 and "--ctx-size" in error["llmcli_error"]["hint"]
        again = ask("Say hi")
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
        engine = _health(url)["engine"]
        assert engine["restarts"] == 0 and engine["pid"] == pid
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # (the cache it had, back)
    finally:
        stop_server(proc)


def test_a_cache_that_can_be_made_neither_larger_nor_again_fails_its_request_and_ends_the_engine(smollm2, monkeypatch):
    """(The engine's side, in this process: memory cannot be taken away twice in a row from outside.) A growing
    cache whose larger context and then its old one both fail to be made (llmcli's own _create_context refusing,
    llama.cpp's words): the request is told the grow's error, not the restore's, then SlotServer.run ends with
    ContextLost — nothing runs on a context that is gone (it crashed the engine: SIGSEGV); the engine process exits 75
    on it, and its supervisor starts another, saying why (llmcli/serve/engine_child.py, engine_process.py)."""
    from llmcli.answer.generation import GenerationOptions
    from llmcli.decode.serving import Job, SlotServer
    from llmcli.errors import ContextLost, ResourceError
    from llmcli.llama.engine import Engine
    from llmcli.llama.engine_config import EngineConfig

    with Engine(smollm2, EngineConfig(n_ctx=4096, n_threads=1, kv_later=True)) as engine:
        made = engine._create_context

        def short_of_memory(n_cells: int, n_seq_max: int, unified: bool) -> None:
            raise ResourceError(f"llama.cpp could not create a context of {n_cells} tokens: out of memory?",
                                hint="Try a smaller --ctx-size (or --parallel).")

        events: list = []
        server = SlotServer(engine, 1, 8)
        prompt = engine.vocab.tokenize("word " * 3000, add_special=True)
        job = Job(prompt, GenerationOptions(max_tokens=4), 1, events.append)
        server.submit(job)
        monkeypatch.setattr(engine, "_create_context", short_of_memory)
        with pytest.raises(ContextLost) as lost:
            server.run()
        monkeypatch.setattr(engine, "_create_context", made)
        assert str(lost.value.message).startswith("llama.cpp could not create a context of 3072 tokens")
        assert lost.value.message.endswith("nor could the 512-token cache it had be made again")
        assert job.failure is not None and job.failure.message == lost.value.message and not job.failure.refused
        assert [type(event).__name__ for event in events] == ["Done"] and events[0].finish_reason == "interrupted"
