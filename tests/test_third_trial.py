"""What a new user hit in the third trial (issue 23): each defect through the real CLI on the real model."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli


def chat_lines(*lines: str, args: tuple[str, ...] = ()) -> tuple[str, str]:
    """A piped chat (one message or /command a line); (stdout, stderr)."""
    result = run_cli("chat", "--no-save", "--temp", "0", "-n", "6", *args, input="\n".join(lines) + "\n")
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    return result.stdout, result.stderr


# 2. `none` clears a list or an optional setting, as /help says

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


# 3. /show counts the conversation's tokens, after /clear, /undo and /load too

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


# 6. an answer cut mid-character drops its incomplete bytes

def test_an_answer_cut_mid_character_ends_without_a_replacement_character():
    grammar = 'root ::= "克斯的猫很可爱"'  # forced (any CPU): byte tokens, so -n cuts inside a character
    seen = set()
    for n in (1, 2, 3, 4):
        result = run_cli("run", "--temp", "0", "-n", str(n), "--grammar", grammar, "写一句话")
        assert result.code == 0, result.stderr
        assert "\ufffd" not in result.stdout
        record = json.loads(run_cli("run", "--temp", "0", "-n", str(n), "--json", "--grammar", grammar, "写一句话").stdout)
        assert "\ufffd" not in record["text"] and "克斯的猫很可爱".startswith(record["text"])
        seen.add(record["text"])
    assert "" in seen and "克" in seen  # a cut inside the first character, and one after it


# 12. --list counts the exchanges --resume restores

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
