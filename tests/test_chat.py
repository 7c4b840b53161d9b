"""`llmcli chat` on the real SmolLM2: a REPL in a real pseudo-terminal, line mode, KV-cache reuse, resume."""

from __future__ import annotations

import itertools
import json

import pexpect
import pytest
from conftest import Terminal, interrupt_at_a_prompt, run_cli, spawn_terminal

PROMPT = ">>> "


def spawn(*args: str, tmp_path=None) -> pexpect.spawn | Terminal:
    child = spawn_terminal("chat", *args, env={"TERM": "dumb"}, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect("/help for commands")
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn | Terminal, text: str) -> str:
    """Send a message; return everything printed until the next prompt (answer and stats line)."""
    child.sendline(text)
    child.expect_exact(PROMPT)
    assert "stop: " in child.before
    return child.before


def test_repl_turns_commands_interrupt_and_exit(tmp_path):
    child = spawn("--temp", "0", "-n", "24")
    say(child, "Hello, my name is Alice.")
    second = say(child, "What is my name?")
    assert "cached)" in second  # the first exchange came from the KV cache

    child.sendline("/set temp 0.7")
    child.expect_exact("--temp = 0.7")
    child.expect_exact(PROMPT)
    child.sendline("/set temp -1")
    child.expect_exact("--temp must be >= 0")
    child.expect_exact(PROMPT)

    child.sendline("/undo")
    child.expect_exact("last exchange removed")
    child.expect_exact(PROMPT)
    child.sendline("/set temp 0")
    child.expect_exact(PROMPT)
    retried = say(child, "/retry")
    assert "TTFT" in retried

    saved = tmp_path / "conversation.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("saved 2 messages")
    child.expect_exact(PROMPT)
    assert json.loads(saved.read_text())["messages"][0]["content"] == "Hello, my name is Alice."
    child.sendline("/clear")
    child.expect_exact("conversation cleared")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {saved}")
    child.expect_exact("loaded 2 messages")
    child.expect_exact(PROMPT)
    child.sendline("/history")
    child.expect_exact("[user] Hello, my name is Alice.")
    child.expect_exact(PROMPT)

    child.sendline("/frobnicate")
    child.expect_exact("Unknown command /frobnicate. Type /help for the list.")
    child.expect_exact(PROMPT)

    # Ctrl-C during a reply stops it and keeps the session
    child.sendline("/set max_tokens 3000")
    child.expect_exact(PROMPT)
    child.sendline("Write a very long story about a dragon and a knight.")
    child.expect_exact("knight.\r\n")  # the terminal's echo of the line
    child.expect(r"\w+ \w+ \w+")  # the answer is streaming
    child.sendintr()
    child.expect_exact("[interrupted")
    child.expect("stop: interrupted")
    child.expect_exact(PROMPT)
    child.sendline("/history")
    child.expect_exact("[assistant (interrupted)]")
    child.expect_exact(PROMPT)
    child.sendline("/set max_tokens 8")
    child.expect_exact(PROMPT)
    after = say(child, "Say hi.")  # the next turn works
    assert "stop: max tokens" in after or "stop: eos" in after

    # Ctrl-C at the prompt hints how to leave; Ctrl-D leaves with 0
    interrupt_at_a_prompt(child, "(Ctrl-D or /exit to leave)")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_multi_line_message_and_exit_command(isolated_env):
    child = spawn("--temp", "0", "-n", "8")
    child.sendline('"""')
    child.sendline("first line")
    child.sendline("second line")
    child.sendline('"""')
    child.expect("stop: ")
    child.expect_exact(PROMPT)
    child.sendline("/history")
    child.expect_exact("[user] first line\r\nsecond line")
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    typed = isolated_env / "data" / "chat_history"  # the up arrow's lines: this user's alone, as the log (issue 57)
    assert "first line" in typed.read_text() and typed.stat().st_mode & 0o777 == 0o600
    forgotten = spawn("--no-log", "-n", "2")  # --no-log (as `logs off`): nothing typed is kept
    forgotten.sendline("a secret line")
    forgotten.expect_exact(PROMPT)
    forgotten.sendline("/exit")
    forgotten.expect(pexpect.EOF)
    forgotten.close()
    assert "a secret line" not in typed.read_text()


def chat_lines(*args: str, messages: list[str], env: dict[str, str] | None = None) -> list[dict]:
    result = run_cli("chat", "--json", "-q", *args, input="\n".join(messages) + "\n", env=env)
    assert result.code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_only_the_new_turn_is_prefilled_over_eight_turns():
    messages = [f"Tell me one fact about the number {n}." for n in range(1, 9)]
    records = chat_lines("--temp", "0", "-n", "16", messages=messages)
    assert len(records) == 8
    for previous, current in itertools.pairwise(records):
        usage, timings = current["usage"], current["timings"]
        # everything the previous turn evaluated (its prompt and its answer) is reused...
        assert usage["cached_tokens"] >= previous["usage"]["prompt_tokens"] + previous["usage"]["completion_tokens"] - 1
        # ...so only the new message and the template's glue are evaluated
        assert timings["prefill_tokens"] == usage["prompt_tokens"] - usage["cached_tokens"]
        assert timings["prefill_tokens"] < 40
    assert records[-1]["usage"]["prompt_tokens"] > 8 * 16  # while the history itself kept growing


@pytest.mark.parametrize("where", ["warm", "in_process"])
def test_the_kv_cache_is_sized_to_the_turns_and_grows_keeping_the_conversation(where):
    """run and chat make the KV cache their work needs (the prompt and -n's room; 512 cells at least), not the whole
    context: a turn that needs more grows it, the conversation copied as it is (reused, never evaluated again). The
    same through the warm server (the default): its slot grows with the work as this process's cache does."""
    env = {"LLMCLI_KEEP_ALIVE": "0" if where == "in_process" else "5m"}
    first = run_cli("run", "--json", "-n", "2", "--grammar", 'root ::= "OK"', "One.", env=env)
    assert first.code == 0, first.stderr
    assert json.loads(first.stdout)["timings"]["kv_cells"] == 512  # of the context's 4096
    room = 511 - json.loads(first.stdout)["usage"]["prompt_tokens"]  # the first turn's prompt and room: 511 cells
    records = chat_lines("--temp", "0", "-n", str(room), "--grammar", 'root ::= "OK"', messages=["One.", "Two."],
                         env=env)
    assert [r["text"] for r in records] == ["OK", "OK"]
    assert all(r["timings"]["warm"] is (where == "warm") for r in records)  # (the run before started the server)
    assert [r["timings"]["kv_cells"] for r in records] == [512, 1024]  # the second turn needs > 512: twice as many
    before, after = records
    assert after["usage"]["cached_tokens"] >= before["usage"]["prompt_tokens"]  # (the forced reply's tokens may differ)
    assert after["timings"]["prefill_tokens"] == after["usage"]["prompt_tokens"] - after["usage"]["cached_tokens"] < 20


@pytest.mark.parametrize("where", ["warm", "in_process"])
def test_long_conversation_in_a_small_context_drops_old_turns(where):
    """Past the context, chat drops its oldest exchanges and goes on: in this process, and through the warm server
    (which fits the conversation itself and says how many it dropped); the record drops them too."""
    messages = [f"Write two sentences about the city number {n}." for n in range(6)]
    result = run_cli("chat", "-c", "256", "--temp", "0", "-n", "40", "-q", "--json", input="\n".join(messages) + "\n",
                     env={"LLMCLI_KEEP_ALIVE": "0" if where == "in_process" else "5m"})
    assert result.code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 6
    assert "dropped the" in result.stderr
    assert any(r["notices"] for r in records)
    assert all(r["usage"]["prompt_tokens"] + 40 <= 256 for r in records)
    assert all(record["timings"]["warm"] is (where == "warm") for record in records[1:])
    ((_, events),) = _recorded().items()
    kinds = [event["type"] for event in events]
    assert "drop" in kinds and kinds.count("exchange") == 6
    resumed = run_cli("chat", "--resume", "last", "--no-save", "-q", input="/history\n")
    assert resumed.stderr.count("[user]") < 6  # the conversation goes on as it was answered: without the dropped ones


def _recorded() -> dict[str, list[dict]]:
    """Every conversation's record in the log: {id: records}."""
    from llmcli import paths
    from llmcli.store.answer_log import AnswerLog

    with AnswerLog(paths.answer_log_file()) as log:
        return {cid: log.events(cid) for cid, _ in log.conversations()}


def test_resume_last_restores_the_history(isolated_env):
    first = run_cli("chat", "--temp", "0", "-n", "8", "-q", input="My secret word is PINEAPPLE.\n")
    assert first.code == 0, first.stderr
    (records,) = _recorded().values()
    header, exchange = records[0], records[1]
    assert header["type"] == "session" and len(header["model_sha256"]) == 64 and len(header["template_sha256"]) == 64
    assert exchange["user"] == "My secret word is PINEAPPLE." and exchange["sampling"]["temp"] == 0.0

    resumed = run_cli("chat", "--resume", "last", "--temp", "0", "-n", "8", "-q", input="/history\nWhat is my secret word?\n")
    assert resumed.code == 0, resumed.stderr
    assert "resumed" in resumed.stderr and "[user] My secret word is PINEAPPLE." in resumed.stderr
    (records,) = _recorded().values()  # the same conversation, appended to
    assert [r["type"] for r in records] == ["session", "exchange", "exchange"]
    rendered = run_cli("chat", "--resume", "last", "--no-save", "-q", input="/history\n").stderr
    assert rendered.count("[user]") == 2

    unknown = run_cli("chat", "--resume", "nope", input="hi\n")
    assert unknown.code == 2 and "no single conversation matches" in unknown.stderr


def test_no_save_leaves_no_record(isolated_env):
    assert run_cli("chat", "--no-save", "-n", "4", "-q", input="hi\n").code == 0
    assert _recorded() == {}


def test_a_chat_saved_as_jsonl_by_an_older_llmcli_resumes_and_goes_on_in_the_log(isolated_env):
    folder = isolated_env / "data" / "conversations"
    folder.mkdir(parents=True)
    old = folder / "20250101-120000-abcdef.jsonl"
    lines = [{"type": "session", "id": old.stem, "model": "smollm2", "system": "You are terse."},
             {"type": "exchange", "user": "My secret word is PINEAPPLE.", "assistant": "Noted."},  # the oldest shape
             {"type": "set", "name": "temp", "value": 0.3}]
    old.write_text("".join(json.dumps(line) + "\n" for line in lines))
    listed = json.loads(run_cli("chat", "--list", "--json").stdout)
    assert [(c["id"], c["exchanges"], c["first_message"]) for c in listed] == [
        (old.stem, 1, "My secret word is PINEAPPLE.")]
    resumed = run_cli("chat", "--resume", "2025", "-n", "4", "-q", input="/show\n/history\nAnd now?\n")
    assert resumed.code == 0, resumed.stderr
    assert "[user] My secret word is PINEAPPLE." in resumed.stderr and "--temp = 0.3" not in resumed.stderr
    assert "system   You are terse." in resumed.stderr and "temp 0.3" in resumed.stderr.replace("=", " ")
    records = _recorded()[old.stem]  # carried into the log, whole, and continued there; the file left as it was
    assert [r["type"] for r in records] == ["session", "exchange", "set", "exchange"]
    assert old.read_text() == "".join(json.dumps(line) + "\n" for line in lines)
    assert [c["id"] for c in json.loads(run_cli("chat", "--list", "--json").stdout)] == [old.stem]


def test_bad_command_values_keep_the_session_in_line_mode():
    result = run_cli("chat", "-n", "4", "-q", "--temp", "0", input="/set top_p 7\n/set nonsense 1\n/set top-q 5\n/load /nonexistent\nhi\n")
    assert result.code == 0
    assert "--top-p must be in (0, 1]" in result.stderr
    assert "unknown setting 'nonsense'" in result.stderr and "Did you mean" not in result.stderr.split("'top-q'")[0]
    assert "unknown setting 'top-q'\nHint: Did you mean 'top_p' or 'top_k'? Settings: system," in result.stderr
    assert "cannot load /nonexistent" in result.stderr
    assert result.stdout.strip()


@pytest.mark.in_process  # (--resume's KV state from the prompt cache: this process's)
def test_ctrl_c_before_the_reply_retry_at_temp_0_load_and_resume_say_what_happened(tmp_path):
    """Ctrl-C while a long message is evaluated: nothing is left unanswered in the conversation (and no "partial
    reply" is claimed); /retry at --temp 0 says it gives the same reply; /load restores the saved settings too; a
    resumed short chat says why no KV state was saved."""
    child = spawn_terminal("chat", "--temp", "0", "-n", "8", "--plain", env={"TERM": "xterm"}, encoding="utf-8",
                           timeout=120, dimensions=(40, 200))
    child.expect_exact(PROMPT)  # (a terminal that draws the prefill's status line)
    child.sendline("Summarize: " + "the cat sat on the mat and looked around the room. " * 300)
    child.expect_exact("evaluating the prompt")  # (shown once the prefill has taken a second)
    child.sendintr()
    child.expect_exact("[interrupted before the reply began: the message is not in the conversation]")
    child.expect_exact(PROMPT)
    assert "partial reply" not in child.before
    child.sendline("/history")
    child.expect_exact("(no messages yet)")
    child.expect_exact(PROMPT)
    say(child, "Hello.")
    child.sendline("/retry")
    child.expect_exact("--temp 0 gives the same reply again")
    child.expect_exact(PROMPT)
    child.sendline("/set top_k 7")
    child.expect_exact(PROMPT)
    saved = tmp_path / "saved.json"
    child.sendline(f"/save {saved}")
    child.expect_exact(PROMPT)
    child.sendline("/set top_k 40")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {saved}")
    child.expect_exact(f"loaded 2 messages from {saved} and its settings: top_k")
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    resumed = run_cli("chat", "--resume", "last", "-q", input="/show\n")
    assert resumed.code == 0 and "states are saved from --prompt-cache-min 256" in resumed.stderr, resumed.stderr
    assert "top_k" in resumed.stderr and "7" in resumed.stderr.split("top_k", 1)[1].split("\n", 1)[0]
