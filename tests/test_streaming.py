"""UTF-8 assembly and stop-sequence hold-back, without a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmcli.streaming import StopMatcher, Utf8Assembler, cut_at_first_stop


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
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
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
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
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
