"""A warm server's answerer that never loses an answer to the server's state: if the server goes away (it crashed,
or was stopped after it was found), this process loads the model and answers, with one notice; from then on the
conversation goes on here. An answer the server had begun goes on where it was: a sampled one from the text already
shown (its tokens after the prompt: one answer, never a second one after the first's start); a greedy one is made
again, its text held back while it repeats what was shown (it is the same here), and should it part from it, a
notice says the answer starts again. The final record is the answer given here, whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from llmcli.answer.answerer import Answerer, LocalModel, ProgressCallback, PromptOptions, ResultCallback
from llmcli.answer.batch_jsonl import BatchItem, Summary
from llmcli.answer.events import AnswerEvent, Notice, Token
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.interrupt import Cancellation
from llmcli.remote.client import NetworkError

if TYPE_CHECKING:
    from llmcli.pipeline import Pipeline

GONE = "the warm server went away; this process answers instead (it has loaded the model)"
PARTED = "the answer given here parts from what the warm server had begun: it starts again"


class FallbackAnswerer:
    """Delegates to `warm` (the warm server's session) until it fails; then to the local session `open_local()`
    makes, once."""

    def __init__(self, warm: Answerer, open_local: Callable[[], Pipeline[Answerer]]):
        self._current: Answerer = warm
        self._open_local = open_local
        self._local: Pipeline[Answerer] | None = None  # the local pipeline, once opened

    # The conversation is the current answerer's: the warm server's, then (with what it held) the local model's.
    @property
    def options(self) -> PromptOptions:
        return self._current.options

    @options.setter
    def options(self, value: PromptOptions) -> None:
        self._current.options = value

    @property
    def history(self) -> list[Message]:
        return self._current.history

    @history.setter
    def history(self, value: list[Message]) -> None:
        self._current.history = value

    @property
    def notices(self) -> list[str]:
        return self._current.notices

    @property
    def not_sent(self) -> frozenset[str]:
        return self._current.not_sent

    @property
    def where(self) -> str:
        return self._current.where

    @property
    def local(self) -> LocalModel | None:
        return self._current.local

    def batch(self, items: list[BatchItem], generation: GenerationOptions, parallel: int, cancel: Cancellation,
              on_result: ResultCallback, on_progress: ProgressCallback | None = None) -> Summary:
        return self._current.batch(items, generation, parallel, cancel, on_result, on_progress)

    def ask(self, user_text: str | None, options: GenerationOptions,
            stable_text: str | None = None, images: tuple[ImageInput, ...] = ()) -> Iterator[AnswerEvent]:
        shown: list[str] = []  # the answer's text already delivered
        thought = False  # (and reasoning: an answer that thought is not resumed from its text alone)
        try:
            for event in self._current.ask(user_text, options, stable_text, images):
                if isinstance(event, Token):
                    thought = thought or event.reasoning
                    if not event.reasoning:
                        shown.append(event.text)
                yield event
            return
        except NetworkError:
            if self._local is not None:
                raise
        history, prompt = list(self._current.history), self._current.options
        self._local = self._open_local()  # (a model that will not load says so as in this process, with no notice first)
        yield Notice(GONE)
        self._current = self._local.session
        self._current.history, self._current.options = history, prompt  # the conversation goes on here
        local = self._local.generation
        options = dataclasses.replace(options, constraint=local.constraint, sampling=dataclasses.replace(
            options.sampling, grammar=local.sampling.grammar, grammar_origin=local.sampling.grammar_origin))
        begun = "".join(shown)
        from llmcli.chat.session import Session  # (loaded now: the model is in this process)

        if begun and not options.sampling.greedy and options.tools is None and not thought and \
                isinstance(self._current, Session):  # a sampled answer goes on from what was shown (a greedy one
            yield from self._current.ask(user_text, options, stable_text, images, answer_prefix=begun)  # is the same)
            return
        yield from _after(self._current.ask(user_text, options, stable_text, images), begun)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()


def _after(events: Iterator[AnswerEvent], shown: str) -> Iterator[AnswerEvent]:
    """The events of an answer whose first `shown` characters are on the screen already: those held back while
    the answer repeats them; if it parts from them, a notice, then everything."""
    held: list[Token] = []
    text = ""
    for event in events:
        if not shown or not isinstance(event, Token) or event.reasoning:
            yield event
            continue
        held.append(event)
        text += event.text
        if not shown.startswith(text[: len(shown)]):  # it parted: show it whole
            yield Notice(PARTED)
            yield from held
            shown, held = "", []
        elif len(text) >= len(shown):  # it went past what was shown: the rest of it
            if len(text) > len(shown):
                yield Token(text[len(shown):], logprobs=event.logprobs)
            shown, held = "", []
