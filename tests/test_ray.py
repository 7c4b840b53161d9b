"""`run --batch --ray` on a local Ray cluster (loopback only; started for the job and gone after it): the same records
as a local --batch, every record exactly once when a worker is killed mid-job, Ctrl-C leaves no Ray process, --resume
continues an interrupted job, and a missing extra is one line. One test: two local clusters at once would share
Ray's ports and session folder; one job takes both faults (a cluster's start is ~10 s of CPU on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

pytest.importorskip("ray")

WORDS = ["colour", "fruit", "planet", "animal", "tree", "river", "city", "metal", "bird", "flower", "stone", "song"]
ARGS = ("--temp", "0", "-n", "12", "-P", "2", "--no-log")
PROMPTS = [f"{ask} a {word}." for ask in ("Name", "Describe") for word in WORDS]
N = len(PROMPTS)  # prompts a job: 12 blocks of 2 over 2 workers, enough for a kill, then a Ctrl-C, to land mid-job


def ray_processes() -> list[str]:
    """Ray's live processes, as "PID ARGS" (an exited one not yet reaped by init, a zombie, holds nothing: not listed)."""
    found = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout.splitlines()
    live = []
    for pid, stat, args in (line.split(None, 2) for line in found):
        if not stat.startswith("Z") and any(name in args for name in ("raylet", "gcs_server", "ray::", "ray/_private")):
            live.append(f"{pid} {args}")
    return live


JOBS: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A job a failed assertion left running is stopped as a user would (SIGTERM: its Ray cluster stops with it), else
    killed."""
    yield
    while JOBS:
        proc = JOBS.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdout, proc.stderr):  # (read or not: not left to the GC)
            if pipe is not None:
                pipe.close()


def job(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LLMCLI_KEEP_ALIVE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "llmcli", "run", "--batch", str(tmp_path / "in.jsonl"), *ARGS, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    JOBS.append(proc)
    return proc


def started(proc: subprocess.Popen[str]) -> str:
    """Until the job says its workers loaded the model (its first line on stderr)."""
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("ray: "), line + proc.stderr.read()
    return line


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[str, str]:
    """Wait, then read what is left through the same buffered files `started` read from (communicate() would skip
    what they hold). The outputs are small: no pipe fills while waiting."""
    proc.wait(timeout=timeout)
    assert proc.stdout is not None and proc.stderr is not None
    return proc.stdout.read(), proc.stderr.read()


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def ray_sessions(monkeypatch: pytest.MonkeyPatch):
    """Ray's session folders (logs, sockets) in a short folder of the test's own, removed after it."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="llmcli-ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.waits_long  # (two local clusters start: ~20 s, mostly waiting)
def test_a_batch_on_ray_answers_as_locally_through_a_killed_worker_and_stops_clean(tmp_path: Path, ray_sessions) -> None:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": prompt, "id": i}) + "\n"
                                               for i, prompt in enumerate(PROMPTS)))
    local = run_cli("run", "--batch", str(tmp_path / "in.jsonl"), *ARGS)
    assert local.code == 0, local.stderr
    expected = {r["index"]: r["text"] for r in records(local.stdout)}

    # One cluster for both faults (a start costs ~10 s of CPU here): 2 workers × 1 thread on these 2 cores, one killed
    # in its first block, which the worker replacing it answers (records come out in input order: the first six hold
    # the first blocks); then Ctrl-C, half the job not yet answered
    killed = job(tmp_path, "--ray")
    assert "2 workers × 1 thread" in started(killed)
    time.sleep(0.5)  # into the first blocks
    workers = [int(line.split()[0]) for line in ray_processes() if "BatchWorker" in line]
    assert workers, ray_processes()
    os.kill(workers[0], signal.SIGKILL)
    assert killed.stdout is not None
    first = "".join(killed.stdout.readline() for _ in range(6))
    killed.send_signal(signal.SIGINT)
    out, err = finish(killed, 120)
    out = first + out
    assert killed.returncode == 130 and "Traceback" not in err, err
    partial = records(out)
    assert [r["index"] for r in partial] == list(range(N)) and [r["id"] for r in partial] == list(range(N))
    answered = {r["index"]: r["text"] for r in partial if "error" not in r}  # each exactly once, in input order
    assert len(answered) >= 6 and answered == {i: expected[i] for i in answered}  # greedy: a local --batch's answers
    assert all(r["error"] == "interrupted before it was answered" for r in partial if r["index"] not in answered)
    assert len(answered) < N, "the job ended before Ctrl-C reached it"
    assert f"batch: {N} prompts (0 errors, " in err and "ray, 2 workers × 1 thread, 1 replaced" in err and "MiB" in err
    deadline = time.monotonic() + 30
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes() == []  # no raylet, GCS or worker outlives the job

    (tmp_path / "part.jsonl").write_text(out)
    resumed = job(tmp_path, "--resume", str(tmp_path / "part.jsonl"))  # (locally: --resume is any batch's)
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    whole = records(out)
    assert [r["index"] for r in whole] == list(range(N)) and all("error" not in r for r in whole)
    assert {r["index"]: r["text"] for r in whole} == expected
    kept = len(answered)
    assert f"--resume: {kept} of {N} records are answered" in err and f"batch: {N - kept} prompts" in err

    texts = tmp_path / "texts.jsonl"  # embed --input --ray: the records a local embed writes, the same vectors
    texts.write_text("".join(json.dumps({"text": f"A note on a {word}.", "k": i}) + "\n" for i, word in enumerate(WORDS))
                     + "not json\n")
    here = run_cli("embed", "--input", str(texts))
    there = run_cli("embed", "--input", str(texts), "--ray", "--ray-workers", "1")
    assert there.code == 0 and "embed: 13 texts (1 error)" in there.stderr, there.stderr
    mine, theirs = records(here.stdout), records(there.stdout)
    assert [r.get("k") for r in theirs] == [r.get("k") for r in mine] and "error" in theirs[-1]
    for a, b in zip(mine[:-1], theirs[:-1], strict=True):
        dot = sum(x * y for x, y in zip(a["embedding"], b["embedding"], strict=True))
        assert dot / (sum(x * x for x in a["embedding"]) * sum(y * y for y in b["embedding"])) ** 0.5 > 0.9999
    assert ray_processes() == []


def test_without_the_ray_extra_ray_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['llmcli', 'run', '--batch', sys.argv[1], '--ray']; "
            "from llmcli.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.jsonl")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "LLMCLI_KEEP_ALIVE": "0"})
    assert result.returncode == 2 and "--ray needs Ray, which is not installed" in result.stderr
    assert "[ray]" in result.stderr and "Traceback" not in result.stderr
    assert run_cli("run", "--ray", "hi").code == 2
