"""UTF-8 assembly and stop-sequence hold-back, without a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmcli.answer.answer_text import StopMatcher, Utf8Assembler, cut_at_first_stop


def assemble(pieces: list[bytes]) -> list[str]:
    assembler = Utf8Assembler()
    out = [assembler.feed(piece) for piece in pieces]
    out.append(assembler.finish())
    return out


def test_multibyte_characters_split_across_tokens_are_assembled():
    text = "héllo 世界 🎉!"
    data = text.encode("utf-8")
    pieces = [bytes([b]) for b in data]  # the worst split: one byte per token
    out = assemble(pieces)
    assert "".join(out) == text
    assert all("\ufffd" not in chunk for chunk in out)
    # nothing is emitted while a character is incomplete
    emoji = "🎉".encode()
    assert assemble([emoji[:2], emoji[2:]])[0] == ""


@given(st.text(), st.data())
def test_any_split_of_any_text_reassembles(text, data):
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.sets(st.integers(0, len(raw)))))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert "".join(assemble(pieces)) == text


def test_invalid_bytes_become_replacement_characters():
    assert "".join(assemble([b"ok\xff", b"\xe4", b"!"])) == "ok\ufffd\ufffd!"


def stream(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stops)
    emitted: list[str] = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        emitted.append(text)
        if stop is not None:
            return emitted, stop
    text, stop = matcher.finish()
    emitted.append(text)
    return emitted, stop


def test_stop_split_across_pieces_is_never_printed():
    emitted, stop = stream(["Hello wor", "ld! ", "STO", "P now"], ["STOP"])
    assert "".join(emitted) == "Hello world! "
    assert stop == "STOP"
    assert "S" not in "".join(emitted)


def test_false_start_is_released():
    emitted, stop = stream(["a ST", "ART b"], ["STOP"])
    assert "".join(emitted) == "a START b" and stop is None


def test_earlier_stop_wins_even_if_a_later_one_completes_first():
    emitted, stop = stream(["xabc", "d"], ["abcd", "bc"])
    assert "".join(emitted) == "x" and stop == "abcd"


alphabet = st.sampled_from("ab\n é🎉")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_streaming_equals_cut_at_first_stop(text, stops, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    emitted, stop = stream(pieces, stops)
    expected_text, expected_stop = cut_at_first_stop(text, stops)
    assert "".join(emitted) == expected_text
    assert (stop is None) == (expected_stop is None)
    if stop is not None:
        assert text.find(stop) == len(expected_text)
    # no prefix of what was emitted ever contains a stop sequence
    printed = ""
    for chunk in emitted:
        printed += chunk
        assert not any(s in printed for s in stops)


# -- AnswerText and Answer: what both decode loops feed every token to ---------------------------


def test_answer_text_assembles_bytes_then_holds_back_stops():
    from llmcli.answer.answer_text import AnswerText

    answer = AnswerText(["STOP"])
    euro = "€".encode()
    assert answer.feed(b"price: " + euro[:1]) == "price: "
    assert answer.feed(euro[1:]) == "€"
    assert answer.feed(b" ST") == " "  # "ST" may begin the stop sequence: held back
    assert answer.feed(b"OP and more") == ""
    assert answer.stop == "STOP"
    assert answer.feed(b"after the stop") == ""
    assert answer.finish() == ""


def test_answer_text_finish_releases_a_false_start_and_drops_a_dangling_byte():
    from llmcli.answer.answer_text import AnswerText

    answer = AnswerText(["</end>"])
    assert answer.feed(b"a </e") == "a "
    assert answer.finish() == "</e"
    assert answer.stop is None
    dangling = AnswerText([])
    assert dangling.feed(b"ok " + "€".encode()[:2]) == "ok "
    assert dangling.finish() == ""  # the start of a character that never came: dropped (issue 23), not U+FFFD


@pytest.mark.parametrize("max_tokens, n_prompt, n_ctx, tokens, finish, n_out", [
    (None, 10, 100, [b"a", b"b", None], "stop", 2),  # None: the end-of-generation token (not counted)
    (2, 10, 100, [b"a", b"b", b"c"], "length", 2),
    (None, 10, 12, [b"a", b"b", b"c", b"d"], "context_full", 3),  # the third has no cell left to be decoded in
    (None, 10, 100, [b"x", b"<", b"/", b"s", b">", b"y"], "stop_sequence", 5),
])
def test_answer_applies_one_finish_rule(max_tokens, n_prompt, n_ctx, tokens, finish, n_out):
    from llmcli.answer.generation import Answer, GenerationOptions

    answer = Answer(GenerationOptions(max_tokens=max_tokens, stops=("</s>",)), n_prompt, n_ctx)
    text = ""
    for token, piece in enumerate(tokens):
        text += "".join(event.text for event in answer.add(token, piece is None, piece or b""))
        if answer.finish is not None:
            break
    text += "".join(event.text for event in answer.close())
    assert (answer.finish, answer.n_out) == (finish, n_out)
    assert "</s>" not in text


def test_a_notice_mid_answer_starts_on_a_line_of_its_own_on_a_terminal_and_piped_bytes_are_untouched():
    """A notice that comes while the answer's line is open (a cut-off tool call, a capped -n) ends that line first on
    a terminal, and the answer's end adds no second newline; piped, the answer's bytes are the model's."""
    import io

    from rich.console import Console

    from llmcli.answer.events import Done, Notice, Token
    from llmcli.answer.stats import AnswerClock
    from llmcli.cli.stream import AnswerSink, show_answer

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, expected in ((Terminal(), "partial\nmore\n"), (io.StringIO(), "partialmore\n")):
        errors = io.StringIO()
        events = [Token("partial"), Notice("a notice"), Token("more"),
                  Done("stop", AnswerClock().stats(prompt_tokens=1), text="partialmore")]
        show_answer(iter(events), AnswerSink(stream), Console(file=errors, width=100), quiet=True)
        assert stream.getvalue() == expected and "a notice" in errors.getvalue()
