"""When a lazy grammar (a tools `auto` answer: free text until the model opens a call) begins to hold the answer.

llama.cpp's lazy grammar appends every token's text to a buffer and looks for each trigger pattern in the whole buffer,
with std::regex, at every token until one is found: the work a token grows with the answer (a 3,000-token story of
SmolLM2 with one tool took over ten minutes instead of 28 s; a 2,000-token answer of gemma3-270m under Claude Code's
tools ~0.5 s a pass, holding every slot's answers — the stalls of issue 60). So the answer's text is watched here
instead, each token's piece once, as llama.cpp reads the patterns: one written `^…$` must match the whole answer (the
opening's first token alone, at the start), any other is searched for anywhere. When one would be found, the sampler
makes the grammar then and feeds it the tokens that hold the match — all of them while the answer is short; past
that, the last few (only a pattern found anywhere can still fire, and a match of one of llmcli's is a few bytes long)
— so llama.cpp's own trigger fires on the same token, at the same place, with a buffer of a few tokens.
"""

from __future__ import annotations

import re

SHORT = 256  # bytes of an answer past its leading whitespace while it is kept whole (and `^…$` patterns looked at)


class LazyTrigger:
    """Watches an answer's tokens for the first that fires one of `patterns` (llama.cpp's trigger regexes, applied to
    the answer's bytes)."""

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = patterns
        whole = [p for p in patterns if p.startswith("^") and p.endswith("$")]
        self._anywhere_patterns = tuple(p for p in patterns if p not in whole)
        self._whole = [re.compile(p.encode(), re.DOTALL) for p in whole]
        self._anywhere = [re.compile(p.encode(), re.DOTALL) for p in self._anywhere_patterns]
        self._reach = 2 * max((len(p) for p in self._anywhere_patterns), default=0)  # (a match's bytes, and more)
        self._tokens: list[tuple[int, bytes]] = []
        self._text = b""
        self.short = True  # the whole answer is kept (else only its last few tokens)
        self.done = False  # fired, or can no longer fire

    def fires(self, token: int, piece: bytes) -> tuple[list[int], tuple[str, ...]] | None:
        """After the answer gained `token` (its text `piece`, special tokens written out, as llama.cpp's buffer has
        it): None, or the tokens to feed a new lazy grammar so that its trigger fires on this one, and the patterns
        to make it with."""
        if self.done:
            return None
        self._tokens.append((token, piece))
        self._text += piece
        if self.short and any(p.fullmatch(self._text) for p in self._whole):
            self.done = True
            return [t for t, _ in self._tokens], self.patterns
        if any(p.search(self._text) for p in self._anywhere):
            self.done = True
            return [t for t, _ in self._tokens], self.patterns if self.short else self._anywhere_patterns
        if self.short and len(self._text.lstrip()) > SHORT:
            self.short = False  # (a `^…$` pattern has had its chance)
            self.done = not self._anywhere
        while not self.short and len(self._tokens) > 1 and len(self._text) - len(self._tokens[0][1]) >= self._reach:
            self._text = self._text[len(self._tokens.pop(0)[1]):]  # (what is left still holds a match this ends)
        return None
