"""chat's commands and its saved conversations: /set, /show, /save and /load, /undo, --list and --resume, and the
errors that never end a session, through the real CLI on SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli


def chat_lines(*lines: str) -> tuple[str, str]:
    """A piped chat (one message or /command a line); (stdout, stderr)."""
    result = run_cli("chat", "--no-save", "--temp", "0", "-n", "6", input="\n".join(lines) + "\n")
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    return result.stdout, result.stderr


def test_set_none_clears_stop_and_system():
    _, err = chat_lines("/set stop none", "/set system none", "/show", "/set stop [\"a\", \"b\"]", "/set system Be brief.",
                        "/show", "/set stop none", "/set system none", "/show")
    shows = err.split("model    ")[1:]
    assert len(shows) == 3
    for show in (shows[0], shows[2]):
        assert "stop=none" in show and 'stop=["none"]' not in show
        assert "system   (none given" in show
    assert 'stop=["a", "b"]*' in shows[1] and "system   Be brief." in shows[1]
    assert "--stop = none" in err and "['none']" not in err  # what /set says: no Python repr


def _used(show: str) -> int:
    return int(show.split("context  ", 1)[1].split(" /", 1)[0])


def test_show_counts_the_conversation_after_clear_undo_and_load(tmp_path: Path):
    saved = tmp_path / "one.json"
    _, err = chat_lines("hi", "/show", f"/save {saved}", "/clear", "/show", "hi", "/undo", "/show", f"/load {saved}",
                        "/show")
    shows = err.split("model    ")[1:]
    after_hi, cleared, undone, loaded = (_used(s) for s in shows)
    assert after_hi > 0 and cleared == 0 and undone == 0 and loaded == after_hi
    assert "1 exchange" in shows[0] and "0 exchanges" in shows[1] and "0 exchanges" in shows[2]


def test_show_names_the_template_s_own_system_prompt_and_stats_count_in_words():
    _, err = chat_lines("hi", "/show", "/stats")
    assert "system   (none given; the chat template adds its own: You are a helpful" in err  # SmolLM2's template
    assert "total: 1 reply · " in err and "1 replies" not in err
    settings = err.split("settings ", 1)[1].split("\n(", 1)[0]
    assert all(len(line) <= 120 for line in settings.splitlines()) and "temp=0*" in settings


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


def test_list_and_resume_count_the_same_exchanges():
    first = run_cli("chat", "--temp", "0", "-n", "4", "-q", input="one\ntwo\nthree\n/undo\nfour\n")
    assert first.code == 0, first.stderr
    listed = json.loads(run_cli("chat", "--list", "--json").stdout)
    assert listed[0]["exchanges"] == 3
    resumed = run_cli("chat", "--resume", "last", "-q", "-n", "4", input="/exit\n")
    assert "3 exchanges" in resumed.stderr, resumed.stderr
    second = run_cli("chat", "--temp", "0", "-n", "4", "-q", input="one\n/clear\ntwo\n")
    assert second.code == 0
    counts = sorted(c["exchanges"] for c in json.loads(run_cli("chat", "--list", "--json").stdout))
    assert counts == [1, 3]


def test_resume_keeps_the_flags_given_now(isolated_env):
    first = run_cli("chat", "--temp", "0", "-n", "5", "-q", input="/set max_tokens 9\n/set top_k 7\nhi\n")
    assert first.code == 0, first.stderr
    resumed = run_cli("chat", "--resume", "last", "-n", "7", "-q", input="/show\n")
    shown = resumed.stderr
    assert "max_tokens=7" in shown and "top_k=7" in shown  # the flag wins; the saved /set stays where no flag is
    assert "seed=random" in shown and "logit_bias=none" in shown and "None" not in shown and "()" not in shown


def test_saved_conversations_are_listed_newest_first():
    for message in ("first conversation", "second conversation"):
        assert run_cli("chat", "-q", "-n", "2", input=f"{message}\n").code == 0
    listed = json.loads(run_cli("chat", "--list", "--json").stdout)
    assert [c["first_message"] for c in listed] == ["first conversation", "second conversation"]
    table = run_cli("chat", "--list").stdout.splitlines()
    assert table[0].split()[:2] == ["ID", "LAST"] and table[1].startswith(listed[-1]["id"])
    resumed = run_cli("chat", "--resume", listed[0]["id"], "--no-save", "-q", input="/history\n")
    assert "[user] first conversation" in resumed.stderr
