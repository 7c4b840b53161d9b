"""What a new user hit in the third trial (issue 23): each defect through the real CLI on the real model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import HTTP, run_cli


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


# 5. a context-overflow hint names the real cause and a fix within the trained context (SmolLM2: 8192)

def _hint(result) -> str:
    assert result.code == 6, result.stderr
    return result.stderr


def test_overflow_hints_name_the_cause_and_a_fix_that_works():
    import re

    huge = _hint(run_cli("run", "-q", input="word " * 20000))  # more than the model was trained on
    assert "reads at most 8192" in huge and "--on-overflow truncate" in huge
    assert all(int(n) <= 8192 for n in re.findall(r"--ctx-size (\d+)", huge)), huge
    long = _hint(run_cli("run", "-q", "-c", "256", input="word " * 600))  # fits a larger context
    assert "--ctx-size 1024 (the model was trained on 8192)" in long and "--on-overflow truncate" in long
    too_many = _hint(run_cli("run", "-q", "-c", "256", "-n", "100000", "--on-overflow", "truncate", "hi"))
    assert "-n 100000 does not fit" in too_many and "--on-overflow" not in too_many, too_many  # -n is the cause
    assert "even an empty message" not in too_many and "-n 2" in too_many  # "-n 2xx or less"
    capped = run_cli("run", "-c", "256", "-n", "100000", "--json", "--logit-bias", "2=-inf",  # (2: SmolLM2's end)
                     "word " * 200)  # (a long prompt: little room left to decode)
    assert capped.code == 0, capped.stderr  # -n past the room left: capped to it, with a notice (not an error)
    room = int(re.search(r"-n 100000 is more than the context has left after the prompt: the answer stops at (\d+) "
                         "tokens", capped.stderr).group(1))
    record = json.loads(capped.stdout)
    assert record["usage"]["prompt_tokens"] + room == 256 and record["usage"]["completion_tokens"] <= room
    cut = run_cli("run", "-q", "-c", "256", "-n", "4", "--on-overflow", "truncate", input="word " * 200000)
    assert cut.code == 0 and "input truncated" in cut.stderr, cut.stderr  # 1 MB: cut before the template sees it


# 7, 15, 16. each command offers the options that apply to it

def _help(*command: str) -> str:
    result = run_cli(*command, "--help")
    assert result.code == 0, result.stderr
    return result.stdout


def test_help_offers_only_what_applies():
    import socket

    pull = _help("pull")
    assert "--hub-timeout" in pull and "KV cache" not in pull and "stats line" not in pull
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        pulled = run_cli("pull", "--hub-timeout", "1.2", "someone/x-GGUF",
                         env={"HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}"})
    assert pulled.code == 4 and "within 1.2 s" in pulled.stderr
    serve = _help("serve")
    assert "--endpoint" not in serve and "--endpoint-timeout" not in serve and "--reasoning" not in serve
    for command in ("count", "tokenize"):
        assert "--raw " not in _help(command)  # (the default without --chat)
    label = run_cli("count", "--chat", "q").stderr
    assert "chat prompt" in label
    refused = run_cli("count", "-s", "Be brief.", "q")  # --system shapes only a chat prompt
    assert refused.code == 2 and "add --chat" in refused.stderr


def test_serve_ignores_a_config_file_endpoint(tmp_path):
    from conftest import start_server, stop_server

    config = tmp_path / "config" / "llmcli" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('endpoint = "http://127.0.0.1:9/v1"\n')
    proc, url = start_server(tmp_path, "-c", "256")  # starts: the config file's endpoint is run's and chat's
    try:  # and answers from its own model, not from the (dead) endpoint
        reply = HTTP.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "smollm2", reply.text
    finally:
        stop_server(proc)


# 8. everyday text searches the log literally; the FTS syntax stays; a bad query is a usage error

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


# empty lists say so; `templates edit` opens the template alone

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


# 9. an extra's hint installs into this llmcli's own environment

def test_extra_hints_follow_how_llmcli_was_installed(monkeypatch, tmp_path):
    from llmcli import install_hint as hints

    root = str(Path(__file__).resolve().parents[1])
    hint = hints.install_hint("serve")
    assert "'llmcli[serve]'" not in hint or root not in hint
    if hints._source()[0] is not None:  # installed from this clone (CI: pip install -e ".[dev]")
        assert f"{root}[serve]" in hint and "-e " in hint
    assert hint.split(" install ")[0] in ("pip", f"{sys.executable} -m pip")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    (tmp_path / "pipx_metadata.json").write_text("{}")  # what pipx writes beside each app's venv
    assert hints.install_hint("serve").startswith("pipx inject llmcli 'starlette>=")
    assert "uvicorn" in hints.install_hint("serve")


# friction: one name, one model; the README lists every built-in alias

def test_the_builtin_alias_of_the_installed_model_needs_no_download():
    from llmcli.store.models import ALIASES

    by_alias = run_cli("run", "-m", "smollm2-135m", "--temp", "0", "-n", "4", "--json", "hi", env={"HF_HUB_OFFLINE": "1"})
    by_package = run_cli("run", "-m", "smollm2", "--temp", "0", "-n", "4", "--json", "hi")
    assert by_alias.code == 0, by_alias.stderr
    assert json.loads(by_alias.stdout)["text"] == json.loads(by_package.stdout)["text"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert all(f"`{alias}`" in readme for alias in ALIASES)


# 10. completion offers an option's choices, not files

def test_completion_offers_the_choices_of_an_option():
    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        return run_cli(env={"_LLMCLI_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}).stdout.split()

    assert complete("llmcli run --speculate ") == ["auto", "lookup", "draft", "off"]
    assert complete("llmcli chat --kv-type q") == ["q8_0", "q4_0"]
    assert complete("llmcli run --reasoning s") == ["show", "stderr", "stdout"]
    assert complete("llmcli bench --format ") == ["md", "json", "csv"]
    assert complete("llmcli embed --format ") == ["jsonl", "npy"]


# 11. more threads than cores is said

def test_more_threads_than_cores_is_a_notice():
    from llmcli.llama.cpu_topology import physical_cores

    cores = physical_cores()
    over = run_cli("run", "-t", str(cores + 1), "-n", "1", "-q", "hi")
    assert over.code == 0 and f"--threads {cores + 1} is more than the {cores} physical core" in over.stderr
    assert "--threads" not in run_cli("run", "-t", str(cores), "-n", "1", "-q", "hi").stderr


# 13. a control token (here an image marker, forced by a grammar) is not answer text unless --special

def test_control_tokens_are_left_out_of_the_answer_unless_special(gemma3):
    args = ("run", "-m", str(gemma3), "--raw", "--temp", "0", "-n", "5", "--grammar",
            'root ::= "<start_of_image><strong>Paris"', "The capital of France:")
    plain = json.loads(run_cli(*args, "--json").stdout)
    assert plain["text"] == "<strong>Paris" and plain["usage"]["completion_tokens"] == 3  # (<strong> is text: HTML)
    assert run_cli(*args, "-q", "--special").stdout == "<start_of_image><strong>Paris\n"


# friction: a sign of life during a long prefill, on a terminal only

def test_prefill_progress_shows_on_a_terminal_and_is_gone_before_the_answer():
    from conftest import run_in_terminal

    document = " ".join(f"item{i}" for i in range(150))  # ~470 tokens in chunks of 64: some seconds on one thread
    args = ["run", "--no-prompt-cache", "-t", "1", "-b", "64", "--temp", "0", "-n", "4", "--grammar", 'root ::= "DONE"',
            "Summarise."]
    shown = run_in_terminal(args, {"NO_COLOR": "1"}, stdin=document, stderr=True).decode()
    assert "evaluating the prompt · " in shown and " tokens · " in shown and "tok/s" in shown, shown[-2000:]
    assert shown.rindex("evaluating the prompt") < shown.index("DONE")  # erased before the first token
    assert "evaluating" not in shown[shown.index("DONE"):]
    piped = run_cli(*args, input=document)
    assert piped.code == 0 and piped.stdout == "DONE\n" and "evaluating" not in piped.stderr


# friction: -n -1 is "no limit", as in llama.cpp's tools; -n 0 says what to do

def test_n_minus_one_means_until_the_context_is_full():
    full = json.loads(run_cli("run", "-c", "64", "-n", "-1", "--no-repetition-guard", "--temp", "0", "--json", "--grammar", 'root ::= ("a "){400}',
                              "hi").stdout)
    assert full["finish_reason"] == "context_full"
    zero = run_cli("run", "-n", "0", "hi")
    assert zero.code == 2 and "or -1, or no -n" in zero.stderr
    _, err = chat_lines("/set max_tokens -1", "/show", args=("-n", "5"))
    assert "--max-tokens = none" in err and "max_tokens=none" in err


# friction: a piped text that cannot be embedded is a failure, not exit 0

def test_embedding_nothing_is_an_error():
    too_long = run_cli("embed", "-c", "64", input="word " * 300)
    assert too_long.code == 6 and "do not fit" in too_long.stderr
    some = run_cli("embed", "-c", "64", input="short\n" + "word " * 300 + "\n")
    assert some.code == 0 and "1 of 2 texts have an error record" in some.stderr


# friction: /show and /stats read as a person would say them

def test_show_names_the_template_s_own_system_prompt_and_stats_count_in_words():
    _, err = chat_lines("hi", "/show", "/stats")
    assert "system   (none given; the chat template adds its own: You are a helpful" in err  # SmolLM2's template
    assert "total: 1 reply · " in err and "1 replies" not in err
    settings = err.split("settings ", 1)[1].split("\n(", 1)[0]
    assert all(len(line) <= 120 for line in settings.splitlines()) and "temp=0*" in settings


def test_empty_lists_say_so_on_stderr():
    for command in (("cache", "list"), ("chat", "--list")):
        result = run_cli(*command)
        assert result.code == 0 and result.stdout == "" and result.stderr.startswith("no saved "), command
