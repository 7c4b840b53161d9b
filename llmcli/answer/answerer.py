"""The one interface every model answers through — a local model (llmcli/chat/session.py) and a server
(--endpoint, llmcli/remote/session.py) alike — and the prompt options both read. As `llm`'s
`Model.execute()` is one contract for every model, `run`, `chat` and `--batch` ask every model the same way; what
only a model in this process can do (its template, its context, its KV state) is one optional part, `local`.

Imports no llama.cpp: `--endpoint` loads none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmcli.answer.batch_jsonl import BatchItem, Record, Summary
from llmcli.answer.events import AnswerEvent
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.answer.tool_calls import ToolSpec
from llmcli.config.settings import default
from llmcli.interrupt import Cancellation


@dataclass(frozen=True)
class PromptOptions:
    system: str | None = None
    raw: bool = False  # send the text as-is: no template (base models)
    template_file: Path | None = None  # overrides the template stored in the model
    on_overflow: str = default("on_overflow")  # or "truncate": drop the start of the message until it fits
    think: bool | None = None  # --think / --no-think: passed to the template; None: its default


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    tokens: list[int]


@dataclass(frozen=True)
class ContextInfo:
    """What a local model can tell of its context (a server tells none of it; a warm server its size)."""

    n_ctx: int  # tokens one answer's prompt and answer may take (0: the server does not say)
    used: int  # tokens the conversation takes now: the system prompt and the history, rendered
    cached: int  # tokens of the KV cache that hold the conversation (evaluated, reusable by the next turn)
    last_answer: bool = False  # through a server: `used` is the last answer's prompt and answer, `cached` how much of
    # that prompt came from the server's cache


@dataclass(frozen=True)
class ServedFacts:
    """What a warm server says of its model that a local model's answerer would tell itself: its context, its chat
    template's sha256 and the system prompt the template adds when none is given (chat's /show, the record)."""

    n_ctx: int
    template_sha256: str | None = None
    template_system: str | None = None


@dataclass(frozen=True)
class Resumed:
    """A resumed conversation's KV state: the tokens restored, or why none were (None: nothing to say); what the
    prompt cache had to say on the way (a damaged entry removed)."""

    restored: int = 0
    missing: str | None = None
    notices: tuple[str, ...] = ()


def with_system(system: str | None, messages: list[Message]) -> list[Message]:
    """The messages a template renders: the system prompt first, when there is one and the messages bring none."""
    if not system or (messages and messages[0].role == "system"):
        return list(messages)
    return [Message("system", system), *messages]


def exchange_starts(history: list[Message]) -> list[int]:
    """Where each exchange of a history begins: at each user message (an exchange is the message, the replies, and
    the tool calls and results between them)."""
    return [index for index, message in enumerate(history) if message.role == "user"]


def oldest_exchange_end(history: list[Message]) -> int:
    """How many messages the oldest exchange takes (what dropping it removes)."""
    starts = exchange_starts(history)
    return starts[1] if len(starts) > 1 else len(history)


def last_exchange_start(history: list[Message]) -> int | None:
    """Where the last exchange begins (what /undo removes); None for no exchange."""
    starts = exchange_starts(history)
    return starts[-1] if starts else None


ResultCallback = Callable[[int, Record], None]
ProgressCallback = Callable[[int, int, float], None]


class LocalModel(Protocol):
    """What only a model loaded in this process can do: render its chat template, tell its context, fit and shift a
    conversation in it, keep and restore its KV state. A server does all of this itself: its answerer has none."""

    @property
    def template_source(self) -> str | None:
        """The chat template's source (None: raw)."""
        ...

    @property
    def template_system(self) -> str | None:
        """The system prompt the chat template adds when none is given (None: it adds none)."""
        ...

    def tool_format(self, setting: str = "auto") -> str:
        """How this model writes a tool call."""
        ...

    def render(self, user_text: str | None, history: list[Message] | None = None,
               tools: ToolSpec | None = None, images: tuple[ImageInput, ...] = ()) -> RenderedPrompt:
        """The exact prompt of this new message (None: of the history as it is)."""
        ...

    def context(self) -> ContextInfo:
        """The context and what the conversation takes of it."""
        ...

    def fit(self, user_text: str, max_tokens: int | None, images: tuple[ImageInput, ...] = ()) -> int:
        """Drop the oldest exchanges until the prompt of `user_text` and room for the answer fit; how many."""
        ...

    def shift_for(self, user_text: str) -> bool | None:
        """After `fit` dropped exchanges: move the KV cache instead of evaluating it again (None: nothing to do)."""
        ...

    def resume(self) -> Resumed:
        """A resumed conversation: its KV state loaded now, before the next message."""
        ...

    def keep_state(self) -> list[str]:
        """The conversation ends: keep its KV state for `chat --resume`; what the prompt cache had to say."""
        ...


class Answerer(Protocol):
    """Asks a model: a conversation (`history`, `options`) and its answers as events; `--batch`; notices. What only a
    local model has is `local` (None for a server). (Whoever opens one closes it: the pipeline's resources.)"""

    options: PromptOptions
    history: list[Message]

    @property
    def notices(self) -> list[str]:
        """For the user, printed by the CLI."""
        ...

    @property
    def not_sent(self) -> frozenset[str]:
        """Settings this answerer cannot use (a server decides them itself)."""
        ...

    @property
    def where(self) -> str:
        """Where the model is: its file, or the server's URL."""
        ...

    @property
    def local(self) -> LocalModel | None:
        """The model in this process (None: a server renders, keeps and fits the conversation itself)."""
        ...

    def ask(self, user_text: str | None, options: GenerationOptions,
            stable_text: str | None = None, images: tuple[ImageInput, ...] = ()) -> Iterator[AnswerEvent]:
        """Answer `user_text` (with `images`) after the history (None: the history ends with tool results and the
        model goes on); the exchange joins the history when the answer is done."""
        ...

    def batch(self, items: list[BatchItem], generation: GenerationOptions, parallel: int, cancel: Cancellation,
              on_result: ResultCallback, on_progress: ProgressCallback | None = None) -> Summary:
        """Every item answered, `parallel` at a time, each result as it finishes (any order)."""
        ...


def tool_format(answerer: Answerer, setting: str = "auto") -> str:
    """How the model writes a tool call: a server parses its own model's calls (`generic` on the wire)."""
    return answerer.local.tool_format(setting) if answerer.local is not None else "generic"


def template_source(answerer: Answerer) -> str | None:
    """The chat template's source (None: raw, or rendered by a server)."""
    return answerer.local.template_source if answerer.local is not None else None
