"""A busy machine (issue 37, part 2): the default thread count is the cores this process may use less what other
processes keep busy now (llmcli/llama/cpu_load.py), decided before an answer and between decode steps; an explicit
-t is obeyed. The arithmetic on synthetic /proc/stat readings; one real run beside a spinning process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import HTTP, run_cli, start_server, stop_server

from llmcli.llama import cpu_load


def test_other_processes_time_is_counted_and_this_one_s_is_not(tmp_path, monkeypatch):
    stat, clock, own = tmp_path / "stat", [100.0], [0.0]

    def reading(cpu0: int, cpu1: int, cpu2: int = 0) -> None:  # busy ticks (user) per CPU; idle ones do not matter
        stat.write_text(f"cpu  {cpu0 + cpu1} 0 0 9 0 0 0 0 0 0\n" + "".join(
            f"cpu{n} {ticks} 0 0 9 0 0 0 0 0 0\n" for n, ticks in enumerate((cpu0, cpu1, cpu2))) + "intr 0\n")

    monkeypatch.setattr(cpu_load, "STAT_FILE", str(stat))
    monkeypatch.setattr(cpu_load, "TICK_S", 0.01)
    monkeypatch.setattr(cpu_load, "_own_seconds", lambda: own[0])
    monkeypatch.setattr(cpu_load, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    reading(0, 0)
    load = cpu_load.CpuLoad()
    load.cpus = {0, 1}  # (CPU 2 is not this process's: its time is nobody's business here)
    load._mark = load._sample()
    clock[0], own[0] = 101.0, 1.0
    reading(100, 100, 100)  # 2 s of CPU on the two CPUs, 1 s of it this process's: another process took a core
    assert load.free_cores(2) == 1 and load.others == pytest.approx(1.0)
    clock[0] = 101.1
    reading(200, 200, 200)  # not a window yet (0.1 s): the last reading stands
    assert load.free_cores(2) == 1
    clock[0], own[0] = 102.0, 3.0
    reading(200, 200, 300)  # this process alone on its CPUs (2 s of 2): every core free
    assert load.free_cores(2) == 2 and load.others == pytest.approx(0.0)
    clock[0] = 103.0
    reading(240, 210, 300)  # 0.5 s of the others': half a core is not taken
    assert load.free_cores(2) == 2
    clock[0] = 104.0
    reading(300, 250, 300)  # 1 s: taken (at least one core is always this process's)
    assert load.free_cores(1) == 1 and load.free_cores(2) == 1


def test_a_first_pass_waits_for_a_reading_and_a_core_is_taken_only_if_held_and_another_thread_runs_now(tmp_path, monkeypatch):
    stat, loadavg, tasks, clock, slept = tmp_path / "stat", tmp_path / "loadavg", tmp_path / "task", [100.0], []

    def reading(busy: int, running: int, own: str = "R") -> None:  # busy ticks on each of 2 CPUs; threads runnable
        stat.write_text(f"cpu  {2 * busy} 0 0 9 0 0 0 0 0 0\n" + "".join(
            f"cpu{n} {busy} 0 0 9 0 0 0 0 0 0\n" for n in range(2)) + "intr 0\n")
        loadavg.write_text(f"1.00 1.00 1.00 {running}/300 4242\n")
        shutil.rmtree(tasks, ignore_errors=True)  # (a thread of an earlier reading is gone)
        for tid, state in enumerate(own):  # this process's threads, the reading one (R) first
            (tasks / str(tid)).mkdir(parents=True, exist_ok=True)
            (tasks / str(tid) / "stat").write_text(f"{tid} (a (tricky) name) {state} 1 1 1\n")

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 3))
        clock[0] += seconds

    for name, value in (("STAT_FILE", str(stat)), ("LOADAVG_FILE", str(loadavg)), ("TASKS_DIR", str(tasks)),
                        ("TICK_S", 0.01), ("_own_seconds", lambda: 0.0), ("_affinity", lambda: {0, 1}),
                        ("time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))):
        monkeypatch.setattr(cpu_load, name, value)
    monkeypatch.setattr(cpu_load, "_start", None)
    reading(0, 1)
    cpu_load.mark_start()  # (the CLI, as the process starts)
    clock[0] = 100.05
    load = cpu_load.CpuLoad()  # the model loaded in 0.05 s: the window began at the process's start
    reading(20, 2)  # 0.4 s of CPU on 2 CPUs in 0.2 s, not this process's; one other thread runs now
    assert load.free_cores(2, 0.2, starting=True) == 1 and slept == [0.15]  # the rest of the first window, once
    clock[0] += 0.5
    reading(70, 1)  # both cores busy all the window (a warm run starting up), but no other thread runs now
    assert load.free_cores(2, 0.2, starting=True) == 2 and load.others == 0 and slept == [0.15]
    clock[0] += 0.1
    reading(80, 1)  # the next window begins at the decision: 0.1 s later there is no reading yet, the decision holds
    assert load.free_cores(2, 0.2) == 2
    clock[0] += 0.5
    reading(130, 3, "RR")  # this process's event loop runs too: one other thread, not two
    assert load.free_cores(2, 0.2, starting=True) == 1
    for busy in (130, 130, 180):  # idle readings (a server's): two quiet windows, then a burst of both cores
        clock[0] += 0.5
        reading(busy, 2)
        load.update(0.2)
    assert load.free_cores(2, 0.2, starting=True) == 2  # one busy window of the last three: not a core held
    monkeypatch.setattr(cpu_load, "_start", (os.getpid() + 1, frozenset({0, 1}), (1.0, 0.0, 0.0)))
    assert cpu_load.CpuLoad()._mark == (clock[0], 3.6, 0.0)  # a parent's mark is not a forked child's


@pytest.mark.in_process  # (this process's threads beside a busy core)
def test_a_run_beside_a_busy_core_decodes_on_the_core_left_and_t_is_obeyed(smollm2, tmp_path):
    """A spinning process pinned to one of two CPUs this run may use: the default evaluates the prompt and decodes on
    one thread (two threads would wait on the shared core at every pass); -t 2 keeps two. So does a server's first
    answer (its model loaded in a fraction of the first window: a warm server's first prompt ran on both cores at
    11 tok/s instead of 120)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                               preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cpus))  # (the forked run inherits it)
        args = ["run", "-m", str(smollm2), "--json", "--temp", "0", "-n", "48", "--grammar", 'root ::= ([a-z] " "){40}',
                "Count."]
        chosen = run_cli(*args, env={"LLMCLI_THREADS": ""})
        quiet = run_cli(*args[:-1], "-q", "Count.", env={"LLMCLI_THREADS": ""})  # (issue 57: -q leaves the notice out)
        # (two threads beside the spinner wait on it at every pass: 32 prompt tokens took 12 s under the suite; raw, 3)
        fixed = run_cli("run", "-m", str(smollm2), "--json", "--raw", "-t", "2", "-n", "1", "Count.",
                        env={"LLMCLI_THREADS": ""})
        server, url = start_server(tmp_path, "-m", str(smollm2), env={"LLMCLI_THREADS": ""})
        try:
            served = HTTP.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "smollm2", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Count."}]})
        finally:
            stop_server(server)
    finally:
        os.sched_setaffinity(0, mine)
        spinner.kill()
        spinner.wait()
    assert chosen.code == 0 and fixed.code == 0, chosen.stderr + fixed.stderr
    assert json.loads(chosen.stdout)["timings"]["threads"] == json.loads(chosen.stdout)["timings"]["prefill_threads"] == 1
    assert served.status_code == 200 and served.json()["timings"]["prefill_threads"] == 1, served.text
    assert chosen.stderr.count("other processes kept ~") == 1 and "decoded on 1 thread," in chosen.stderr
    assert quiet.code == 0 and "other processes kept" not in quiet.stderr, quiet.stderr
    assert "other processes kept" not in fixed.stderr  # (-t given: nothing was cut)
    assert json.loads(fixed.stdout)["timings"]["threads"] == 2


def _threads_used(env: dict[str, str] | None = None) -> int:
    result = run_cli("run", "--json", "-q", "-n", "2", "hi", env={"LLMCLI_THREADS": "", **(env or {})})
    assert result.code == 0, result.stderr
    return int(json.loads(result.stdout)["timings"]["threads"])


def test_threads_follow_the_cpu_affinity():
    from llmcli.llama.cpu_topology import physical_cores

    assert 1 <= _threads_used() <= physical_cores()  # every core it may use, less those other processes keep busy
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "llmcli", "run", "--json", "-q", "-n", "2",
                             "hi"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                            env={**os.environ, "LLMCLI_THREADS": ""})  # (a new process: its own view of the CPUs)
    assert pinned.returncode == 0, pinned.stderr
    assert json.loads(pinned.stdout)["timings"]["threads"] == 1  # pinned to one CPU: one thread
    # (the default path: the pinned run is answered by a warm server of its own, pinned as it is — not by the one the
    # unpinned run above started, which has every CPU)
    warm = [json.loads(line) for line in run_cli("ps", "--json").stdout.splitlines()]
    assert sorted(len(os.sched_getaffinity(server["pid"])) for server in warm) == sorted([1, len(os.sched_getaffinity(0))])


def test_a_generating_llmcli_takes_its_share_of_the_cores(isolated_env):
    from llmcli.llama.cpu_topology import physical_cores

    generating = isolated_env / "xdg-runtime" / "llmcli" / "generating"
    generating.mkdir(parents=True)
    peer = subprocess.Popen(["sleep", "60"])  # stands in for another llmcli that is generating
    try:
        (generating / str(peer.pid)).touch()
        stale = generating / "999999999"  # a pid that does not run: left behind by a killed process
        stale.touch()
        assert _threads_used() <= max(1, physical_cores() // 2)
        assert not stale.exists()
        assert _threads_used(env={"LLMCLI_THREADS": "2"}) == 2  # --threads/LLMCLI_THREADS given: fixed
    finally:
        peer.kill()
        peer.wait()
    assert _threads_used() <= physical_cores()  # alone again (less what other processes keep busy)
    assert sorted(p.name for p in generating.iterdir()) == []  # every run unregistered itself


def test_more_threads_than_cores_is_a_notice():
    from llmcli.llama.cpu_topology import physical_cores

    cores = physical_cores()
    over = run_cli("run", "-t", str(cores + 1), "-n", "1", "-q", "hi")
    assert over.code == 0 and f"--threads {cores + 1} is more than the {cores} physical core" in over.stderr
    assert "--threads" not in run_cli("run", "-t", str(cores), "-n", "1", "-q", "hi").stderr
