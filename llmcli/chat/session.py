"""Step 2 and the conversation around it, on a local model: messages -> chat template -> tokens -> the scheduler.

A `Session` is the local `Answerer` (llmcli/answer/answerer.py): it holds the loaded engine, its scheduler, the
template, the system prompt and the history; `ask` renders the conversation with the new message, tokenizes it
and lets the scheduler evaluate only what the KV cache does not hold yet; `batch` answers many prompts in slots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from llmcli.answer import preparation
from llmcli.answer.answerer import (
    ContextInfo,
    ProgressCallback,
    PromptOptions,
    RenderedPrompt,
    ResultCallback,
    Resumed,
    exchange_starts,
    oldest_exchange_end,
    with_system,
)
from llmcli.answer.batch_jsonl import BatchItem, Summary
from llmcli.answer.context_budget import answer_room, overflow
from llmcli.answer.events import AnswerEvent, Done, Notice
from llmcli.answer.finish import REPETITION_NOTICE
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.image_bytes import read_image
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message, user_message
from llmcli.answer.preparation import Context, Prepared
from llmcli.answer.shared_prefix import shared_prefix
from llmcli.answer.stats import AnswerClock
from llmcli.answer.tool_calls import ToolSpec, detect_format
from llmcli.config.settings import default
from llmcli.decode import batch_run, one_answer
from llmcli.decode.kept_states import KEPT_MIB
from llmcli.decode.prompt_cache import PromptCache
from llmcli.decode.scheduler import Scheduler
from llmcli.decode.serving import SlotServer
from llmcli.decode.speculative import Speculation
from llmcli.errors import UsageError
from llmcli.interrupt import Cancellation
from llmcli.llama.engine import Engine
from llmcli.prompt import chat_template as templates
from llmcli.prompt.chat_template import ChatTemplate
from llmcli.prompt.rendering import find_template, render_prompt

# Checks that a KV cache of this many cells fits in memory before --batch makes it (raises ResourceError).
KVCheck = Callable[[int], None]


class Session:
    def __init__(self, engine: Engine, options: PromptOptions | None = None, prompt_cache: PromptCache | None = None,
                 split_min: int = default("prompt_cache_min"), speculation: Speculation | None = None,
                 check_kv: KVCheck | None = None):
        self.engine = engine
        self.speculation = speculation or Speculation()  # a chat's answers share its cost model: it learns across turns
        self.scheduler = Scheduler(engine, 1, self.speculation)
        self.check_kv = check_kv
        self.prompt_cache = prompt_cache  # saved KV states of long prompts, across runs
        # Prompts at least this long are split where their stable part ends (prompt cache on or off: the
        # same numbers either way); shorter ones are never saved, and evaluated in one go.
        self.split_min = split_min
        self.options = options = options or PromptOptions()
        self.history: list[Message] = []
        self.notices: list[str] = []  # warnings for the user, printed by the CLI
        self.template = self._find_template()
        self._load_s = engine.load_s  # reported once, with the first answer
        self._last_prompt_tokens = 0  # the length of the last prompt asked

    def _find_template(self) -> ChatTemplate | None:
        template, notices = find_template(self.engine.header, self.options)
        self.notices += notices
        return template

    @property
    def raw(self) -> bool:
        return self.template is None

    @property
    def where(self) -> str:
        return str(self.engine.path)

    @property
    def local(self) -> Session:
        """A Session is the model in this process: it renders, fits, shifts and keeps its conversation itself."""
        return self

    @property
    def template_source(self) -> str | None:
        return self.template.source if self.template is not None else None

    not_sent: frozenset[str] = frozenset()

    def tool_format(self, setting: str = "auto") -> str:
        """How this model writes a tool call: --tool-format, else what its chat template shows."""
        return detect_format(self.template_source) if setting == "auto" else setting

    @property
    def template_system(self) -> str | None:
        if self.template is None:
            return None
        return templates.default_system(self.template, self.engine.vocab.bos_text, self.engine.vocab.eos_text)

    def context(self) -> ContextInfo:
        if not self.history and not self.options.system:
            return ContextInfo(self.engine.n_ctx, 0, 0)
        tokens = self.render_history().tokens
        return ContextInfo(self.engine.n_ctx, len(tokens), self.engine.kv.shared_prefix(tokens))

    def render_history(self) -> RenderedPrompt:
        """The conversation so far (the system prompt and the history), as the model sees it before a new message."""
        return render_prompt(self.template, self.engine.vocab, with_system(self.options.system, list(self.history)),
                             self.options, vision=self.engine.load_vision)

    def fit(self, user_text: str, max_tokens: int | None, images: tuple[ImageInput, ...] = ()) -> int:
        room = self.answer_room(max_tokens)
        dropped = 0
        while len(self.render(user_text, images=images).tokens) + room > self.engine.n_ctx:
            if not exchange_starts(self.history):  # nothing older to drop
                if self.options.on_overflow == "truncate":
                    return dropped  # ask() truncates the message itself
                raise overflow(len(self.render(user_text, [], images=images).tokens), max_tokens, self.engine.n_ctx,
                               self.engine.n_ctx_train, reserve=room)
            del self.history[: oldest_exchange_end(self.history)]
            dropped += 1
        return dropped

    def close(self) -> None:
        self.scheduler.close()

    def batch(self, items: list[BatchItem], generation: GenerationOptions, parallel: int, cancel: Cancellation,
              on_result: ResultCallback, on_progress: ProgressCallback | None = None) -> Summary:
        """--batch: every prompt rendered, the KV cache sized to the work (checked against memory first), the answers
        decoded together in `parallel` slots of one scheduler."""
        if self.speculation.draft_model is not None:
            raise UsageError("--batch drafts from each prompt and its answer (prompt lookup), not with --draft-model",
                             hint="Use --speculate auto or lookup with --batch; a draft model drafts for run and chat.")
        def prepare(item: BatchItem) -> Prepared:  # (as run prepares its prompt: -n capped, --on-overflow truncate)
            images = tuple(read_image(reference) for reference in item.images)
            return self.prepare_alone(item.prompt or "", generation, images)

        plan = batch_run.plan(items, prepare, self.engine, generation, parallel)
        if self.check_kv is not None:
            self.check_kv(plan.cells)
        self.scheduler.close()
        self.engine.resize(plan.cells, plan.n_sequences)
        try:
            summary = batch_run.BatchRun(self.engine, plan, generation, cancel, on_result, self.speculation,
                                         prepare).run(on_progress)
        finally:
            self.scheduler = Scheduler(self.engine, 1, self.speculation)
        summary.parallel = parallel
        return summary

    def messages_with(self, user_text: str | None, history: list[Message] | None = None,
                      images: tuple[ImageInput, ...] = ()) -> list[Message]:
        """The conversation and the new message (None: the history ends with tool results; the model goes on)."""
        new = [user_message(user_text, images)] if user_text is not None else []
        return with_system(self.options.system, [*(self.history if history is None else history), *new])

    def render(self, user_text: str | None, history: list[Message] | None = None,
               tools: ToolSpec | None = None, images: tuple[ImageInput, ...] = ()) -> RenderedPrompt:
        """The exact text and tokens the model will see for this new message (after `history`, else the session's)."""
        return render_prompt(self.template, self.engine.vocab, self.messages_with(user_text, history, images),
                             self.options, tools, self.engine.load_vision)

    def prepare_alone(self, text: str, generation: GenerationOptions, images: tuple[ImageInput, ...] = ()) -> Prepared:
        """A prompt asked on its own (no history; a --batch item): rendered and fitted as every answer's is."""
        return preparation.prepare(lambda kept: self.render(kept, [], images=images), text, generation,
                                   self._context(), truncate=self.options.on_overflow == "truncate",
                                   template_source=self.template_source, count=self._count)

    def _context(self) -> Context:
        return Context(self.engine.n_ctx, self.engine.n_ctx_train)

    def _count(self, text: str) -> int:
        return len(self.engine.vocab.tokenize(text, add_special=False))

    def render_conversation(self, messages: list[Message], think: bool | None = None,
                            tools: ToolSpec | None = None) -> RenderedPrompt:
        """The exact prompt of a whole conversation as a request gives it (serve): this session's template, system
        prompt and options, `think` given (None: the session's)."""
        options = self.options if think is None else dataclasses.replace(self.options, think=think)
        return render_prompt(self.template, self.engine.vocab, with_system(options.system, messages), options, tools,
                             self.engine.load_vision)

    def render_raw(self, text: str, images: tuple[ImageInput, ...]) -> RenderedPrompt:
        """A raw prompt with pictures as a request gives it (serve): as `run --raw --image` renders it here."""
        return render_prompt(None, self.engine.vocab, [user_message(text, images)],
                             dataclasses.replace(self.options, raw=True), vision=self.engine.load_vision)

    def slot_server(self, n_slots: int, queue_size: int, kept_mib: int = KEPT_MIB) -> SlotServer:
        """This session's model answering requests in `n_slots` slots (serve): the same engine, speculation and
        prompt store as its own answers; split where a long conversation's standing part ends when the store is on;
        what a slot held when another request took it kept in `kept_mib` MiB."""
        return SlotServer(self.engine, n_slots, queue_size, speculation=self.speculation, prompt_cache=self.prompt_cache,
                          kept_mib=kept_mib)

    def answer_room(self, max_tokens: int | None) -> int:
        """Tokens kept free for the answer: -n, else a quarter of the context (at most 256)."""
        return answer_room(max_tokens, self.engine.n_ctx)

    def ask(self, user_text: str | None, options: GenerationOptions,
            stable_text: str | None = None, images: tuple[ImageInput, ...] = (),
            answer_prefix: str = "") -> Iterator[AnswerEvent]:
        """Answer `user_text` (None: the history ends with tool results, the model goes on); the exchange joins the
        history when the answer is done (the reply with its tool calls). `answer_prefix`: the start of the answer,
        already shown (a warm server began it, then went away): this answer goes on from it, and its Done's text
        holds it.

        `stable_text`: the start of `user_text` that later messages are likely to share (a piped document),
        given by a one-shot run. The prompt is evaluated in two parts, split where that text ends, with or
        without the prompt cache: a state saved there and a later prompt evaluated from it give the same
        numbers (and greedy answers) as evaluating everything."""
        started = time.perf_counter()
        begun = None
        if answer_prefix:  # (its tokens after the prompt, as the server had sampled them, near enough)
            begun = RenderedPrompt(answer_prefix, self.engine.vocab.tokenize(answer_prefix, add_special=False))
        prepared = preparation.prepare(
            lambda text: self.render(text, tools=options.tools, images=images), user_text, options,
            self._context(), truncate=self.options.on_overflow == "truncate", template_source=self.template_source,
            begun=begun, count=self._count)
        for notice in prepared.notices:
            yield Notice(notice)
        user_text, prompt, options = prepared.text, prepared.prompt, prepared.generation
        if prepared.truncated:
            stable_text = None  # the document's start is gone: the next question cuts it elsewhere
        self._last_prompt_tokens = len(prompt.tokens) - (len(begun.tokens) if begun is not None else 0)
        stable = None if stable_text is None or len(prompt.tokens) < self.split_min else (
            len(prompt.tokens) - 1 if stable_text == user_text else self._stable_tokens(prompt.tokens, stable_text))
        prompt_s = time.perf_counter() - started
        self.scheduler.reserve(len(prompt.tokens) + self.answer_room(options.max_tokens))  # (a cache sized to its work)
        restored, restore_s = self._restore(prompt.tokens, stable)
        yield from self._cache_notices()
        load_s, self._load_s = self._load_s, 0.0
        seed = options.sampling.effective_seed()
        done: Done | None = None
        clock = AnswerClock(started, load_s, prompt_s)
        for event in one_answer.answer(self.scheduler, prompt.tokens, options, seed, clock, split_at=stable):
            if isinstance(event, Done):
                event = dataclasses.replace(event, text=answer_prefix + event.text) if answer_prefix else event
                self.history += [*([user_message(user_text, images)] if user_text is not None else []),
                                 Message("assistant", event.text, tool_calls=event.tool_calls)]
                if restored:
                    event = dataclasses.replace(event, stats=dataclasses.replace(
                        event.stats, restored_tokens=min(restored, event.stats.cached_tokens), restore_s=restore_s))
                done = event
            yield event
            if isinstance(event, Done) and event.finish_reason == "repetition":
                yield Notice(REPETITION_NOTICE)
            if isinstance(event, Done) and (busy := self.engine.take_busy_notice()):
                yield Notice(busy, advisory=True)
        if self.prompt_cache is not None and done is not None and done.finish_reason != "interrupted":
            self.prompt_cache.save(done.stats.prefill_tokens, stable=stable)  # after the answer, off the TTFT path
            yield from self._cache_notices()

    def _stable_tokens(self, prompt: list[int], stable_text: str) -> int:
        """How many tokens of `prompt` a message that starts with `stable_text` shares, at most all but the
        last one (a state that ends there also serves the same prompt again)."""
        return min(shared_prefix(self.render(stable_text).tokens, prompt), len(prompt) - 1)

    def _restore(self, tokens: list[int], limit: int | None = None) -> tuple[int, float]:
        """Start from the prompt cache's longest saved prefix of `tokens` (of its first `limit`):
        (tokens restored, seconds)."""
        if self.prompt_cache is None:
            return 0, 0.0
        started = time.perf_counter()
        restored = self.prompt_cache.restore(tokens, limit, make_room=self.scheduler.reserve)
        return restored, time.perf_counter() - started

    def _cache_notices(self) -> Iterator[Notice]:
        for text in self.take_notices():
            yield Notice(text)

    def take_notices(self) -> list[str]:
        """What the prompt cache has to tell the user (damaged files removed, saves skipped), once."""
        return self.prompt_cache.take_notices() if self.prompt_cache is not None else []

    def shift_for(self, user_text: str) -> bool | None:
        """After the oldest exchanges were dropped: cut their tokens out of the KV cache and move the rest
        back (a context shift), so the next turn evaluates only what is new. True: shifted; False: this
        model's cache cannot shift (the next turn evaluates the conversation again); None: nothing to cut."""
        engine = self.engine
        prompt = self.render(user_text).tokens
        start = engine.kv.shared_prefix(prompt)
        span = _dropped_span(engine.kv.tokens, prompt, start)
        if span is None:
            return None
        return engine.kv.cut(start, start + span)

    def resume(self) -> Resumed:
        """A resumed conversation: load the KV state of its history from the prompt cache now, before the
        next message (none saved: the next turn evaluates the history again)."""
        if not self.history:
            return Resumed()
        tokens = self.render("").tokens
        restored = self._restore(tokens)[0]
        notices = tuple(self.take_notices())
        if restored:
            return Resumed(restored, notices=notices)
        if self.prompt_cache is None:
            return Resumed(0, "the prompt cache is off")
        least = self.prompt_cache.config.min_tokens
        if len(tokens) < least:  # (too short to be worth a saved state: said so, not "none is saved")
            return Resumed(0, f"{len(tokens)} tokens: states are saved from --prompt-cache-min {least}", notices)
        return Resumed(0, "none is saved or it was not valid", notices)

    def keep_state(self) -> list[str]:
        """The conversation ends: save its KV state (if not saved already) for `chat --resume`; the prompt cache's
        notices."""
        if self.prompt_cache is not None:
            self.prompt_cache.keep(self._last_prompt_tokens)
        return self.take_notices()


_PROBE = 16  # tokens after the kept prefix that must be found again further on to locate the dropped span


def _dropped_span(cached: list[int], prompt: list[int], start: int) -> int | None:
    """How many tokens of `cached` after `start` the new `prompt` no longer has: the smallest d with
    cached[start + d:] continuing as prompt[start:] does (for at least _PROBE tokens), else None."""
    probe = prompt[start : start + _PROBE]
    if len(probe) < _PROBE:
        return None
    first = probe[0]
    for position in range(start + 1, len(cached) - _PROBE + 1):
        if cached[position] == first and cached[position : position + _PROBE] == probe:
            return position - start
    return None
