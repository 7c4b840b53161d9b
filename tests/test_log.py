"""The answer log (SQLite), `--continue`, and prompt templates, through the real CLI on SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import run_cli, spawn_cli

QUICK = ("--temp", "0", "-n", "6", "-q")


def logged(*args: str) -> list[dict]:
    result = run_cli("logs", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_runs_chat_and_batch_are_logged_and_found_by_a_word_of_their_answer(tmp_path):
    answer = run_cli("run", *QUICK, "Name a lighthouse keeper.").stdout.strip()
    word = max(answer.split(), key=len).strip(".,!?")
    (found,) = logged("-q", word)
    assert found["answer"].strip() == answer and found["prompt"] == "Name a lighthouse keeper." and found["kind"] == "run"
    assert found["model"] == "smollm2" and found["settings"]["temp"] == 0 and found["timings"]["completion_tokens"] > 0
    assert found["finish_reason"] in ("stop", "length") and found["conversation_id"]
    record = json.loads(run_cli("run", *QUICK, "--json", "Name a harbour.").stdout)  # where its answer is kept
    (kept,) = [r for r in logged("-n", "5") if r["prompt"] == "Name a harbour."]
    assert record["log_id"] == kept["id"] and record["conversation_id"] == kept["conversation_id"]
    assert run_cli("chat", *QUICK, input="Say hi.\n").code == 0
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    assert run_cli("run", "--batch", str(prompts), *QUICK).code == 0
    assert run_cli("run", "--no-log", *QUICK, "unlogged").code == 0
    records = logged("-n", "50")
    assert sorted(r["kind"] for r in records) == ["batch", "batch", "chat", "run", "run"]
    assert [r["prompt"] for r in logged("-m", "smollm2", "--since", "1h", "-n", "2")] == ["two", "one"]
    plain = run_cli("logs", "-n", "1").stdout
    assert "> two" in plain and "batch" in plain
    removed = run_cli("logs", "rm", str(found["id"]))
    assert removed.code == 0 and not logged("-q", word)
    assert run_cli("logs", "rm", "--before", "0m").code == 0 and logged() == []


def test_eight_runs_at_once_leave_eight_records(isolated_env):
    procs = [spawn_cli("run", *QUICK, f"Count to {i}.", env={"LLMCLI_THREADS": "1"}) for i in range(8)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and b"not in the log" not in err, err
    assert sorted(r["prompt"] for r in logged("-n", "20")) == sorted(f"Count to {i}." for i in range(8))


def test_a_broken_log_never_fails_a_run(isolated_env):
    database = isolated_env / "data" / "logs.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    database.write_bytes(b"this is not a database" * 100)
    result = run_cli("run", *QUICK, "hi")
    assert result.code == 0 and result.stdout.strip()
    assert "the answer is not in the log" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_read_only_log_is_read_and_a_damaged_one_is_an_error_not_a_usage_error(isolated_env):
    assert run_cli("run", *QUICK, "Name a colour.").code == 0
    data = isolated_env / "data"
    locked = [data, *data.iterdir()]
    if os.geteuid() == 0:  # (root writes through permissions: the immutable attribute stops it)
        if subprocess.run(["chattr", "+i", *map(str, locked)], capture_output=True).returncode != 0:
            pytest.skip("root, and no chattr here: a read-only data dir cannot be made")
        unlock = lambda: subprocess.run(["chattr", "-i", *map(str, locked)], check=True)  # noqa: E731
    else:
        for path in locked:
            path.chmod(0o555 if path.is_dir() else 0o444)
        unlock = lambda: [p.chmod(0o755 if p.is_dir() else 0o644) for p in locked]  # noqa: E731
    try:
        assert subprocess.run(["touch", str(data / "new")], capture_output=True).returncode != 0  # read-only indeed
        listed = run_cli("logs", "--json")
        assert listed.code == 0, listed.stderr
        assert [r["prompt"] for r in json.loads(listed.stdout)] == ["Name a colour."]
        assert "1 answers" in run_cli("logs", "status").stdout
    finally:
        unlock()
    (data / "logs.db").write_bytes(b"this is not a database" * 100)
    for path in data.glob("logs.db-*"):
        path.unlink()
    damaged = run_cli("logs")
    assert damaged.code == 1 and "cannot read the log" in damaged.stderr  # (an I/O failure: not exit 2)


def test_logs_off_on_and_status():
    assert "logging on (default)" in run_cli("logs", "status").stdout
    assert run_cli("logs", "off").code == 0
    run_cli("run", *QUICK, "hi")
    assert "logging off" in run_cli("logs", "status").stdout and logged() == []
    assert run_cli("run", "--log", *QUICK, "hi").code == 0 and len(logged()) == 1  # a flag still logs one
    assert run_cli("logs", "on").code == 0 and "logging on" in run_cli("logs", "status").stdout
    assert run_cli("logs", "path").stdout.strip().endswith("logs.db")


def test_continue_puts_the_previous_exchange_before_the_prompt():
    first = run_cli("run", *QUICK, "My name is Ada.").stdout.strip()
    shown = run_cli("run", "-C", "--show-prompt", "What is my name?").stdout
    assert "My name is Ada." in shown and first in shown and shown.index(first) < shown.index("What is my name?")
    assert run_cli("run", "-C", *QUICK, "What is my name?").code == 0
    ids = {r["conversation_id"] for r in logged()}
    assert len(ids) == 1  # the continued run joined the conversation
    (cid,) = ids
    again = run_cli("run", "--cid", cid, "--show-prompt", "And again?").stdout
    assert again.count("My name is Ada.") == 1 and "What is my name?" in again
    assert run_cli("run", "--cid", "nope", "hi").code == 2


def test_a_template_with_input_from_stdin_and_placeholders(isolated_env):
    saved = run_cli("run", "--save", "summ", "-s", "You are terse.", "--temp", "0", "-n", "8",
                    "Summarize for $audience: $input")
    assert saved.code == 0 and "saved template summ" in saved.stderr
    shown = run_cli("run", "-T", "summ", "--var", "audience=kids", "--show-prompt",
                    input="The keeper counted ships.").stdout
    assert "You are terse." in shown and "Summarize for kids: The keeper counted ships." in shown
    answered = run_cli("run", "-T", "summ", "--var", "audience=kids", "--json", input="The keeper counted ships.")
    record = json.loads(answered.stdout)
    assert record["usage"]["completion_tokens"] <= 8  # the template's -n
    missing = run_cli("run", "-T", "summ", input="text")
    assert missing.code == 2 and "no value for $audience" in missing.stderr
    assert "summ" in run_cli("templates", "list").stdout
    assert "placeholders: $audience, $input" in run_cli("templates", "show", "summ").stdout
    assert run_cli("templates", "rm", "summ").code == 0 and run_cli("run", "-T", "summ", "x").code == 2


def test_log_search_takes_everyday_text():
    empty = run_cli("logs")
    assert empty.code == 0 and empty.stdout == "" and "the log is empty" in empty.stderr
    prompt = "what? a-b it's C++ magic"
    assert run_cli("run", "--temp", "0", "-n", "2", prompt).code == 0
    for query in ("what?", "a-b", "it's", "C++", "mag*", '"a b"', "nothing OR magic", "magic NOT nothing"):
        found = run_cli("logs", "-q", query, "--json")
        assert found.code == 0, (query, found.stderr)
        assert [r["prompt"] for r in json.loads(found.stdout)] == [prompt], query
    missing = run_cli("logs", "-q", "absent")
    assert missing.code == 0 and "no answer matches" in missing.stderr
    for bad in ('"open', "x OR", "NOT"):
        refused = run_cli("logs", "-q", bad)
        assert refused.code == 2 and refused.stderr.startswith("Error: cannot search for"), (bad, refused.stderr)
        assert "fts5" not in refused.stderr.lower() and len(refused.stderr.strip().splitlines()) == 1


def test_templates_edit_opens_the_template_and_keeps_the_rest(isolated_env, tmp_path):
    assert "no templates saved yet" in run_cli("templates", "list").stderr
    config = isolated_env / "xdg-config" / "llmcli" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('temp = 0.9  # mine\n\n[templates.sum]\n# why\nprompt = "Sum: $input"\n')
    seen = tmp_path / "seen.toml"
    editor = f"sh -c 'cp \"$0\" {seen}; echo \"temp = 0.3\" >> \"$0\"'"
    edited = run_cli("templates", "edit", "sum", env={"EDITOR": editor, "VISUAL": ""})
    assert edited.code == 0, edited.stderr
    assert seen.read_text() == '[templates.sum]\n# why\nprompt = "Sum: $input"\n'  # the template, not the file
    assert config.read_text() == 'temp = 0.9  # mine\n\n[templates.sum]\n# why\nprompt = "Sum: $input"\ntemp = 0.3\n'
    broken = run_cli("templates", "edit", "sum", env={"EDITOR": "sh -c 'echo \"bogus = 1\" >> \"$0\"'", "VISUAL": ""})
    assert broken.code == 2 and "unchanged" in broken.stderr
    assert config.read_text().endswith("temp = 0.3\n")
    config.write_text(config.read_text() + "bogus = 1\n")  # an unknown key: said by any command, not only its use
    listed = run_cli("count", "hi")
    assert listed.code == 2 and "[templates.sum] unknown key 'bogus'" in listed.stderr


def test_logs_rm_removes_an_exchange_from_everything_that_replays_it_and_leaves_no_byte_of_it(isolated_env):
    """Issue 57: `logs rm ID` said "removed 1 answer" while `chat --list`, `chat --resume` and `run -C` still held the
    prompt, and logs.db kept it (conversation_events, the FTS segments, free pages, the WAL). The data dir is 0700
    and its log 0600."""
    assert run_cli("run", *QUICK, "The secret word is PAPAYA.").code == 0
    assert run_cli("run", "-C", *QUICK, "What was the secret word? Say it.").code == 0
    (first, *_), = [[r for r in logged() if "PAPAYA" in r["prompt"]]]
    typed = isolated_env / "data" / "chat_history"  # (as chat's up arrow keeps what was typed)
    typed.write_text("The secret word is PAPAYA.\nsomething else\n")
    shown = run_cli("run", "-C", "--show-prompt", "And now?").stdout
    assert "PAPAYA" in shown and "What was the secret word?" in shown
    removed = run_cli("logs", "rm", str(first["id"]))
    assert removed.code == 0 and "removed 1 answer" in removed.stdout
    assert not logged("-q", "PAPAYA")
    shown = run_cli("run", "-C", "--show-prompt", "And now?").stdout  # the rest of the conversation goes on
    assert "PAPAYA" not in shown and "What was the secret word?" in shown
    listed = run_cli("chat", "--list", "--json")
    assert listed.code == 0 and "PAPAYA" not in listed.stdout
    data = isolated_env / "data"
    leftovers = [p.name for p in data.iterdir() if p.name.startswith("logs.db") and b"PAPAYA" in p.read_bytes()]
    assert leftovers == []  # (nor in the -wal file: emptied)
    assert typed.read_text() == "something else\n"  # the line history forgets it too
    assert os.stat(data).st_mode & 0o777 == 0o700 and os.stat(data / "logs.db").st_mode & 0o777 == 0o600
    assert run_cli("logs", "rm", "--before", "0m").code == 0 and logged() == []
    assert "What was the secret word?" not in run_cli("chat", "--list", "--json").stdout


def test_an_exchange_is_recorded_once_and_logs_rm_removes_exactly_it(isolated_env):
    """Issue 57: each exchange was recorded twice (the answers and the conversation's record, its text in both), and
    `logs rm` found the record's copy by its text: two exchanges alike (the same question, the same forced answer)
    both left the conversation when one was removed."""
    import sqlite3

    forced = ("--temp", "0", "-q", "--grammar", 'root ::= "Noted."')
    assert run_cli("run", *forced, "Remember KIWI.").code == 0
    assert run_cli("run", "-C", *forced, "Remember KIWI.").code == 0
    assert run_cli("run", "-C", *forced, "Anything else?").code == 0
    first, second = sorted((r for r in logged() if r["prompt"] == "Remember KIWI."), key=lambda r: r["id"])
    with sqlite3.connect(isolated_env / "data" / "logs.db") as db:  # the texts are the answers' alone
        events = [json.loads(row[0]) for row in db.execute("SELECT record FROM conversation_events")]
    assert [e["type"] for e in events] == ["session", "exchange", "exchange", "exchange"]
    assert not [e for e in events if "KIWI" in json.dumps(e) or "Noted." in json.dumps(e)]
    shown = run_cli("run", "-C", "--show-prompt", "And now?").stdout
    assert shown.count("Remember KIWI.") == 2 and shown.count("Noted.") == 3
    assert run_cli("logs", "rm", str(first["id"])).code == 0
    shown = run_cli("run", "-C", "--show-prompt", "And now?").stdout  # the other exchange alike stays
    assert shown.count("Remember KIWI.") == 1 and shown.count("Noted.") == 2 and "Anything else?" in shown
    assert [r["id"] for r in logged("-q", "KIWI")] == [second["id"]]
    listed = json.loads(run_cli("chat", "--list", "--json").stdout)
    assert [c["exchanges"] for c in listed] == [2]


def test_a_log_written_before_exchanges_were_recorded_once_is_read_and_removed_as_before(tmp_path):
    """A schema-3 log (each exchange's texts in its conversation's record too) is brought up to date: its exchanges
    replay as they were, and `logs rm` still removes one from the conversation."""
    import sqlite3

    from llmcli.store.answer_log import MIGRATIONS, AnswerLog

    path = tmp_path / "logs.db"
    with sqlite3.connect(path) as db:
        for step in MIGRATIONS[:3]:
            db.executescript(step)
        db.execute("PRAGMA user_version = 3")
        db.execute("INSERT INTO answers (time, kind, model, prompt, answer, conversation_id) "
                   "VALUES (1, 'run', 'm', 'Remember FIG.', 'Noted.', 'c1')")
        for record in ({"type": "session", "id": "c1"}, {"type": "exchange", "user": "Remember FIG.", "text": "Noted."}):
            db.execute("INSERT INTO conversation_events (conversation_id, time, type, record) VALUES ('c1', 1, ?, ?)",
                       (record["type"], json.dumps(record)))
    with AnswerLog(path) as log:
        assert [(e["type"], e.get("user")) for e in log.events("c1")] == [("session", None), ("exchange", "Remember FIG.")]
        assert log.remove(log.find()[0]["id"]) == 1
        assert [e["type"] for e in log.events("c1")] == ["session"]
