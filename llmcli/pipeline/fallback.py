"""A warm server's answerer that never loses an answer to the server's state: if the server goes away before an
answer has begun (it crashed, or was stopped, after it was found), this process loads the model and answers, with
one notice; from then on the conversation goes on here. An answer the server had begun streaming cannot be taken
back from the terminal: that one ends as a network error (the next run starts a new server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from llmcli.answer.events import AnswerEvent, Notice, Prefill
from llmcli.answer.generation import GenerationOptions
from llmcli.chat.answerer import Answerer
from llmcli.remote.client import NetworkError

GONE = "the warm server went away before answering; this process answers instead (loading the model)"


class FallbackAnswerer:
    """Delegates to `warm` (the warm server's session) until it fails before an answer; then to the local session
    `open_local()` makes, once. `local_generation(options)`: the options as the local model needs them (a grammar
    the server compiled for itself is compiled here)."""

    def __init__(self, warm: Answerer, open_local: Callable[[], Any]):
        self._current: Any = warm
        self._open_local = open_local
        self._local: Any = None  # the local pipeline, once opened

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current, name)

    def ask(self, user_text: str | None, options: GenerationOptions,
            stable_text: str | None = None) -> Iterator[AnswerEvent]:
        begun = False
        try:
            for event in self._current.ask(user_text, options, stable_text):
                begun = begun or not isinstance(event, (Notice, Prefill))
                yield event
            return
        except NetworkError:
            if begun or self._local is not None:
                raise
        yield Notice(GONE)
        history, prompt = list(self._current.history), self._current.options
        self._local = self._open_local()
        self._current = self._local.session
        self._current.history, self._current.options = history, prompt
        local = self._local.generation
        options = dataclasses.replace(options, constraint=local.constraint, sampling=dataclasses.replace(
            options.sampling, grammar=local.sampling.grammar, grammar_origin=local.sampling.grammar_origin))
        yield from self._current.ask(user_text, options, stable_text)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
