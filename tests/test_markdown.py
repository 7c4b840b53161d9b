"""Markdown rendered as the answer streams on a terminal; piped output stays the model's bytes.

The answers are forced by a grammar (a model's own words differ between CPUs), and what a terminal shows is read
back through pyte, a terminal emulator: the final screen, not the escape codes one by one.
"""

from __future__ import annotations

import io
import random
import re
import threading
import time

import pexpect
import pyte
import pytest
from conftest import run_cli, run_in_terminal, spawn_terminal
from rich.console import Console

from llmcli.cli.markdown_stream import MarkdownStream, settled_blocks

ANSWER = ("# Shopping\n\nSome **bold** and *italic* text with `code`.\n\n- one\n- two\n\n"
          "| fruit | count |\n|---|---|\n| apple | 3 |\n\n```python\ndef double(x):\n    return x * 2\n```\n\n"
          "A <script>alert(1)</script> tag.\n")
FORCED = 'root ::= "' + ANSWER.replace("\n", "\\n") + '"'
COLOUR = {"NO_COLOR": "", "TERM": "xterm-256color", "COLORTERM": ""}  # 256 colours, whatever the CI sets


def screen_of(output: str | bytes, width: int = 120, height: int = 60) -> list[str]:
    """What a `width` x `height` terminal shows after `output`, line by line, trailing spaces dropped."""
    screen = pyte.Screen(width, height)
    stream = pyte.ByteStream(screen) if isinstance(output, bytes) else pyte.Stream(screen)
    stream.feed(output)
    return [line.rstrip() for line in screen.display]


def streamed(pieces: list[str], width: int = 60, height: int = 40) -> list[str]:
    """The screen after MarkdownStream was fed `pieces` on a terminal of that size."""
    out = io.StringIO()
    console = Console(file=out, width=width, height=height, force_terminal=True, color_system="256")
    stream = MarkdownStream(console)
    for piece in pieces:
        stream.feed(piece)
    stream.close()
    return screen_of(out.getvalue().replace("\n", "\r\n"), width, height)


@pytest.mark.parametrize("source, blocks, rest", [
    ("", [], ""),
    ("# Title\n", [], "# Title\n"),  # one block: it may still grow
    ("# Title\n\nPara", [], "# Title\n\nPara"),  # the last line is not complete: not parsed yet
    ("# Title\n\nPara\n", ["# Title\n\n"], "Para\n"),
    ("Para\n#hashtag\n", [], "Para\n#hashtag\n"),  # not a heading: the paragraph goes on
    ("- a\n- b\n\nText\n", ["- a\n- b\n\n"], "Text\n"),
    ("```py\nx = 1\n\n# not a heading\n", [], "```py\nx = 1\n\n# not a heading\n"),  # an open fence holds everything
    ("| a |\n|---|\n| 1 |\n\n> quote\n\nafter\n", ["| a |\n|---|\n| 1 |\n\n", "> quote\n\n"], "after\n"),
])
def test_blocks_are_committed_only_once_later_text_cannot_change_them(source, blocks, rest):
    assert settled_blocks(source) == (blocks, rest)


def test_the_screen_does_not_depend_on_how_the_answer_was_cut():
    whole = streamed([ANSWER])
    for seed in range(3):
        rng = random.Random(seed)
        pieces, at = [], 0
        while at < len(ANSWER):
            size = rng.randint(1, 5)
            pieces.append(ANSWER[at : at + size])
            at += size
        assert streamed(pieces) == whole
    shown = "\n".join(whole)
    assert "Shopping" in shown and "• one" in shown and "def double(x):" in shown and "apple" in shown
    assert "**" not in shown and "```" not in shown and "|---|" not in shown
    assert "A <script>alert(1)</script> tag." in shown  # raw HTML is text, neither dropped nor interpreted


def test_an_open_block_taller_than_the_terminal_shows_its_last_lines_then_all_of_it():
    code = "```\n" + "".join(f"line {n}\n" for n in range(40)) + "```\n"
    out = io.StringIO()
    console = Console(file=out, width=40, height=10, force_terminal=True, color_system=None)
    stream = MarkdownStream(console)
    for line in code.splitlines(keepends=True):
        stream.feed(line)
        time.sleep(0.01)  # Live's thread draws the open block now and then
    frames = out.getvalue()
    stream.close()
    # While open, each redraw fits the terminal (a redraw first clears the lines of the one before it: one line up
    # for each line but the first); committed, the block is printed whole, once.
    heights = [clear.count("\x1b[1A") + 1 for clear in re.findall(r"\r\x1b\[2K(?:\x1b\[1A\x1b\[2K)*", frames)]
    assert heights and max(heights) < 10
    final = screen_of(out.getvalue().replace("\n", "\r\n"), 40, 60)
    assert [line.strip() for line in final if "line" in line] == [f"line {n}" for n in range(40)]


def test_a_streamed_answer_is_rendered_on_a_terminal_and_piped_it_is_the_models_bytes():
    args = ["run", "--temp", "0", "--grammar", FORCED, "-q", "Write a shopping list"]
    shown = run_in_terminal(args, COLOUR)
    assert b"\x1b[1m" in shown and b"\x1b[38;5;" in shown  # bold and highlighted code: escape codes
    screen = "\n".join(screen_of(shown))
    assert "**" not in screen and "```" not in screen and "|---|" not in screen  # no raw marks left on the screen
    assert "Shopping" in screen and "• one" in screen and "fruit" in screen and "def double(x):" in screen
    assert "A <script>alert(1)</script> tag." in screen
    piped = run_cli(*args, "--markdown")
    assert piped.code == 0 and piped.stdout == ANSWER  # piped: byte for byte, even with --markdown asked for
    marked = "Some **bold** and *italic* text with `code`.\n\n| apple | 3 |\n"  # (a shorter answer: fewer tokens)
    plain_args = ["run", "--temp", "0", "--grammar", 'root ::= "' + marked.replace("\n", "\\n") + '"', "-q", "--plain",
                  "Write a shopping list"]
    plain = "\n".join(screen_of(run_in_terminal(plain_args, COLOUR)))
    assert "Some **bold** and *italic* text with `code`." in plain and "| apple | 3 |" in plain


def test_the_thinking_stays_dimmed_and_apart_and_chat_replies_render_the_same_way():
    thinking = 'root ::= "<think>plan **raw**</think>" "' + ANSWER.replace("\n", "\\n") + '"'
    shown = run_in_terminal(["run", "--temp", "0", "--grammar", thinking, "-q", "Write a shopping list"], COLOUR)
    assert b"\x1b[2;3mp" in shown  # the thinking: dim italic, as written, before the answer
    screen = screen_of(shown)
    assert screen.index("plan **raw**") < next(i for i, line in enumerate(screen) if "Shopping" in line)
    reply = run_in_terminal(["chat", "--temp", "0", "--grammar", FORCED, "-q"], COLOUR, stdin="a list\n")
    chat_screen = "\n".join(screen_of(reply))
    assert "• one" in chat_screen and "def double(x):" in chat_screen and "**" not in chat_screen


def test_a_terminal_narrower_than_a_table_or_a_code_line_wraps_them_cleanly():
    wide = ("| name | what it does |\n|---|---|\n| settled_blocks | finds the blocks later text cannot change |\n\n"
            "```python\nprint('a string far too long for a terminal thirty columns wide')\n```\n")
    out = io.StringIO()
    console = Console(file=out, width=30, height=40, force_terminal=True, color_system="256")
    stream = MarkdownStream(console)
    for piece in wide.splitlines(keepends=True):
        stream.feed(piece)
    stream.close()
    lines = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()))
    assert max(len(line.rstrip()) for line in lines) <= 30  # wrapped by the renderer, never by the terminal
    screen = " ".join(line.strip() for line in screen_of(out.getvalue().replace("\n", "\r\n"), 30, 40))
    for word in ("finds", "change", "print('a", "string", "wide')"):
        assert word in screen
    assert "settled_blo" in screen and "…" not in screen  # a word wider than its column is folded, not cut


def test_ctrl_c_ends_a_rendered_answer_with_what_was_shown_and_the_cursor_back():
    child = spawn_terminal("run", "--temp", "0", "-n", "2000", "--no-repetition-guard", "--grammar",
                           'root ::= "- **la**\\n" root', "Sing", env=COLOUR, timeout=60, dimensions=(30, 100))
    shown = b""
    while sum(line == " • la" for line in screen_of(shown, 100, 30)) < 6:  # rendered list items on the screen
        child.expect(b"la")
        shown += child.before + child.after
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    shown += child.before
    assert shown.rstrip().endswith(b"\x1b[?25h") or b"\x1b[?25h" in shown  # the cursor is shown again
    screen = [line for line in screen_of(shown, 100, 30) if line]
    items = [line for line in screen if "la" in line]
    assert len(items) >= 6 and all(line == " • la" for line in items[:-1])  # (Ctrl-C may cut the last one short)
    assert "interrupted" in screen[-1]


def test_a_stalled_terminal_holds_up_the_printer_not_the_answer():
    class Stalled(io.StringIO):
        """A terminal that stops taking output while `flowing` is clear (Ctrl-S, a slow link)."""

        def __init__(self) -> None:
            super().__init__()
            self.flowing = threading.Event()
            self.flowing.set()

        def write(self, text: str) -> int:
            self.flowing.wait()
            return super().write(text)

    out = Stalled()
    console = Console(file=out, width=60, height=40, force_terminal=True, color_system="256")
    stream = MarkdownStream(console)
    stream.feed("# Start\n\nA first paragraph.\n\n")  # the open block is on the screen
    out.flowing.clear()
    fed = threading.Thread(target=lambda: [stream.feed(f"Paragraph {n}.\n\n") for n in range(200)])
    fed.start()
    fed.join(timeout=30)
    assert not fed.is_alive()  # 200 pieces handed over, 200 blocks settled, while nothing could be written
    out.flowing.set()
    stream.close()
    screen = [line for line in screen_of(out.getvalue().replace("\n", "\r\n"), 60, 1000) if line]
    assert screen[:2] == ["                           Start", "A first paragraph."]
    assert screen[2:] == [f"Paragraph {n}." for n in range(200)]  # every block once, in order


LINES = 24  # after the 6th, the rest still takes seconds to come: the keys are typed mid-answer


def _numbered(lines: int) -> str:
    """A grammar for an answer of `lines` numbered lines, each its own ("- line 001" ...)."""
    return 'root ::= "' + "".join(f"- line {n:03d}\\n" for n in range(1, lines + 1)) + '"'


def _numbered_lines(screen: list[str]) -> list[int]:
    return [int(line.split()[-1]) for line in screen if re.fullmatch(r" • line \d\d\d", line)]


@pytest.mark.parametrize("keys", ["/exit\r", "ctrl-c"])
def test_keys_typed_while_an_answer_renders_are_not_echoed_under_it_and_each_line_shows_once(keys):
    """chat on a terminal, rendering Markdown (numbered lines): keys typed mid-answer, Enter included, are not
    echoed under it (an echoed newline moved the cursor under rich's open block, which was then drawn again) and begin
    the next prompt's line; Ctrl-C ends the answer with each line shown once. Nothing is typed but `keys`."""
    # Ctrl-C's answer is 400 lines (~3000 tokens, half a minute), far longer than this test takes to type it after
    # the 6th even on a loaded machine, where this process may read the terminal seconds behind what chat wrote (99
    # lines once ended first in CI): had the answer ended first, the ^C would be the prompt's, and a ^D sent as chat
    # printed the next prompt was lost (the terminal drops an end-of-file typed in canonical mode when readline turns
    # it off).
    grammar = _numbered(400 if keys == "ctrl-c" else LINES)
    child = spawn_terminal("chat", "--temp", "0", "-n", "4000", "--no-save", "--no-repetition-guard", "--grammar",
                           grammar, env={**COLOUR, "COLUMNS": "100"}, timeout=60, dimensions=(200, 100))
    child.expect_exact(">>> ")
    child.sendline("Count")
    shown = b""
    while len(_numbered_lines(screen_of(shown, 100, 200))) < 6:
        child.expect(b"line")
        shown += child.before + child.after
    if keys == "ctrl-c":
        child.sendintr()
        if child.expect_exact(["[interrupted: the partial reply stays in the conversation]", pexpect.TIMEOUT]):
            shown += child.before  # the answer's, not the prompt's
            pytest.fail("no interruption line; the screen:\n" + "\n".join(screen_of(shown, 100, 200)))
        shown += child.before + child.after
        child.expect_exact(">>> ")
        shown += child.before + child.after
        child.sendeof()
    else:
        child.send(keys)  # typed ahead: the answer goes on for seconds
    child.expect(pexpect.EOF)
    shown += child.before
    child.close()
    assert child.exitstatus == 0
    screen = [line for line in screen_of(shown, 100, 200) if line]
    numbers = _numbered_lines(screen)
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 6, "\n".join(screen)  # each once, in order
    if keys != "ctrl-c":
        assert len(numbers) == LINES and screen[-1] == ">>> /exit"  # the whole answer; the keys were the next prompt's
        assert sum("/exit" in line for line in screen) == 1 and "^C" not in "\n".join(screen)


def test_the_answer_is_the_terminal_s_own_text_unless_a_colour_is_set():
    args = ["run", "--temp", "0", "--plain", "--grammar", 'root ::= "plain words"', "-q", "Say it."]
    plain = run_in_terminal(args, COLOUR)
    assert b"plain words" in plain and b"\x1b[3" not in plain  # no colour of llmcli's (-q: no stats either)
    coloured = run_in_terminal([*args, "--answer-color", "cyan"], COLOUR)
    assert b"\x1b[36mp" in coloured and b"plain words" in b"".join(re.split(rb"\x1b\[[0-9;]*m", coloured))
    wrong = run_cli(*args, "--answer-color", "not a colour")
    assert wrong.code == 2 and "--answer-color" in wrong.stderr
