"""`llmcli count` and `llmcli tokenize`: the vocabulary alone, the same counts `run` reports."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

DOC = "The lighthouse keeper counted the ships.\nÉté, 日本, emoji 🙂 and tabs\there.\n"


def counted(*args: str, input: str | None = None) -> dict:
    result = run_cli("count", "--json", *args, input=input)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def prompt_tokens(*args: str, input: str | None = None) -> int:
    result = run_cli("run", "--json", "--temp", "0", "-n", "1", *args, input=input)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["usage"]["prompt_tokens"]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_counts_equal_what_run_reports_for_the_same_input(tmp_path, request, name):
    model = str(request.getfixturevalue(name))  # (the model's file: assembled once a session, not once a test)
    doc = tmp_path / "doc.md"
    doc.write_text(DOC, encoding="utf-8")
    raw = counted("-m", model, str(doc))
    assert raw["files"] == [{"name": str(doc), "tokens": raw["total"]}]
    assert raw["total"] == prompt_tokens("-m", model, "--raw", input=DOC)  # the file as run takes it piped in
    assert counted("-m", model, input=DOC)["total"] == raw["total"]  # stdin
    chat = counted("-m", model, "--chat", "-s", "Be brief.", "What is a token?")
    assert chat["total"] == prompt_tokens("-m", model, "-s", "Be brief.", "What is a token?")
    piped = counted("-m", model, "--chat", "Summarise.", input=DOC)  # stdin first, then the prompt, as run does
    assert piped["total"] == prompt_tokens("-m", model, "Summarise.", input=DOC)
    shown = run_cli("run", "-m", model, "--show-prompt", "Summarise.", input=DOC)
    assert f"{piped['total']} tokens" in shown.stderr


def test_count_per_file_total_and_context(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one two three\n")
    second.write_text(DOC * 40)
    record = counted(str(first), str(second), "-c", "1000")
    assert [f["name"] for f in record["files"]] == [str(first), str(second)]
    assert record["total"] == sum(f["tokens"] for f in record["files"])
    assert record["context"] == 1024  # as llama.cpp pads a context (and run reports it)
    assert record["fits"] is (record["total"] <= 1024)
    plain = run_cli("count", str(first), str(second), "-c", "1000")
    lines = plain.stdout.splitlines()
    assert lines[-1].split() == [str(record["total"]), "total"] and len(lines) == 3
    assert "context 1024" in plain.stderr and ("fits" in plain.stderr or "does not fit" in plain.stderr)
    shown = run_cli("run", "-c", "1000", "--show-prompt", "hi")
    assert "context 1024" in shown.stderr


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_bytes(b"GGUF\0\1\2"), "not a text file"),
    (lambda p: p.write_bytes(b"caf\xe9 latin-1"), "not UTF-8 text"),
    (lambda p: None, "no such file"),
])
def test_files_count_cannot_read_are_one_line_errors(tmp_path, make, fragment):
    target = tmp_path / "input"
    make(target)
    result = run_cli("count", str(target))
    assert result.code == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_tokenize_shows_ids_and_pieces_and_they_rebuild_the_text():
    result = run_cli("tokenize", "--json", "Hello world, 日本 🙂")
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    assert set(record) == {"ids", "pieces"} and len(record["ids"]) == len(record["pieces"]) > 2
    assert all(isinstance(i, int) for i in record["ids"])
    assert len(record["ids"]) == counted(input="Hello world, 日本 🙂")["total"]
    pieces = record["pieces"]
    if "\\x" not in "".join(pieces):  # every piece whole characters: they join into the text
        assert "".join(pieces) == "Hello world, 日本 🙂"
    plain = run_cli("tokenize", "Hello world")
    assert [line.split(None, 1)[1] for line in plain.stdout.splitlines()] == ['"Hello"', '" world"']


def test_tokenize_shows_split_characters_as_escaped_bytes_and_special_tokens_by_name():
    record = json.loads(run_cli("tokenize", "--json", "--chat", "𝔘").stdout)  # a rare character: byte tokens
    assert "<|im_start|>" in record["pieces"]
    assert any(piece.startswith("\\x") for piece in record["pieces"])


def test_an_argument_that_names_no_file_is_counted_as_text():
    text = run_cli("count", "Hello world")
    assert text.code == 0 and int(text.stdout) >= 2 and "counting the argument itself as text" in text.stderr
    assert run_cli("count", "no/such-file.txt").code == 2  # a path that is not there is still a missing file
    missing = run_cli("count", "nosuch.txt")  # (issue 57: a file's name without a slash was counted as text, exit 0)
    assert missing.code == 2 and "nosuch.txt: no such file" in missing.stderr
    assert run_cli("count", "hello").code == 0  # a word is still text
