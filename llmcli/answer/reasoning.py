"""Reasoning models think before they answer, inline: `<think>…</think>` and then the answer. Told apart here,
as the answer streams, so that stdout can carry the answer only and records keep the two apart.

The rules, which never take back what was already returned:
- a think block is recognised only at the very start of the output (after whitespace), or is open from the
  start when the prompt itself opened it (templates that inject `<think>`: the model then writes only
  `…</think>`);
- once the answer has begun, everything is answer: `<think>` inside a code block of the answer stays text;
- tags split across tokens are held back until they are complete (or turn out not to be tags);
- a block still open when the output ends (at -n) is all reasoning, and the answer is empty.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a think block the template opened for the model."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningSplitter:
    """Text in, (reasoning, answer) pieces out."""

    _START, _THINKING, _AFTER, _ANSWER = range(4)

    def __init__(self, open_at_start: bool = False):
        self._state = self._THINKING if open_at_start else self._START
        self._held = ""
        self._lead = open_at_start  # whitespace right after an opening tag is not shown

    @property
    def thinking(self) -> bool:
        """Inside the think block now (its opening seen, its closing not yet)."""
        return self._state == self._THINKING

    @property
    def answering(self) -> bool:
        """The answer has begun: nothing more can be reasoning."""
        return self._state == self._ANSWER

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that `text` completes (either may be empty)."""
        if self._state == self._ANSWER:
            return "", text
        buf = self._held + text
        self._held = ""
        reasoning = answer = ""
        while buf:
            if self._state == self._START:
                stripped = buf.lstrip()
                if not stripped:
                    self._held = buf
                    return reasoning, answer
                if stripped.startswith(OPEN):
                    buf = stripped[len(OPEN):]
                    self._state, self._lead = self._THINKING, True
                elif OPEN.startswith(stripped):
                    self._held = buf  # perhaps the start of a tag
                    return reasoning, answer
                else:
                    self._state = self._ANSWER
                    return reasoning, answer + buf
            elif self._state == self._THINKING:
                if self._lead:
                    buf = buf.lstrip()
                    if not buf:
                        return reasoning, answer
                    self._lead = False
                at = buf.find(CLOSE)
                if at >= 0:
                    reasoning += buf[:at]
                    buf = buf[at + len(CLOSE):]
                    self._state = self._AFTER
                    continue
                keep = partial_suffix(buf, CLOSE)
                self._held = buf[len(buf) - keep:] if keep else ""
                return reasoning + buf[: len(buf) - keep], answer
            elif self._state == self._AFTER:  # the blank lines between the block and the answer are not shown
                buf = buf.lstrip()
                if buf:
                    self._state = self._ANSWER
                    return reasoning, answer + buf
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back (a lone `<` or `</thi` is text of whichever part it was in)."""
        held, self._held = self._held, ""
        if self._state == self._THINKING:
            return held, ""
        if self._state == self._START:
            return "", held
        return "", ""


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (a tag, or a tool call's opening,
    still being streamed: held back until it is whole or is not the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


THINKING_SWITCHES = ("enable_thinking", "thinking")  # what reasoning models' templates read: Qwen3's, Granite's


def reads_thinking_switch(template_source: str) -> bool:
    """Whether a chat template reads --think/--no-think (one of THINKING_SWITCHES)."""
    return any(name in template_source for name in THINKING_SWITCHES)


def no_switch_notice(reads_switch: bool, think: bool | None) -> str | None:
    """What is said when --think/--no-think is given to a chat template that reads neither switch (None: it reads
    one, or neither was given)."""
    if think is None or reads_switch:
        return None
    return f"this model's chat template has no thinking switch: {'--think' if think else '--no-think'} changes nothing"
