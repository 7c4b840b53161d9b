"""What one answer may be (GenerationOptions) and the one rule for when it ends (Answer).

The scheduler (llmcli/decode/scheduler.py) feeds every sampled token of every slot to its `Answer`, which
turns it into events (the answer's text and its reasoning, apart), decides the finish reason, and makes the
`Done` that carries the whole answer. Pure: no llama.cpp here.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.answer_text import AnswerText
from llmcli.answer.constraint import Constraint
from llmcli.answer.events import Done, Token, TokenLogprob
from llmcli.answer.reasoning import ReasoningSplitter, opens_thinking
from llmcli.answer.sampling_config import SamplingConfig
from llmcli.answer.stats import Stats
from llmcli.answer.tool_call_parser import CallEvent, ToolCallParser
from llmcli.answer.tool_calls import ToolSpec, relevance
from llmcli.config.settings import default

SPECULATE_MODES = ("auto", "lookup", "draft", "off")


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    constraint: Constraint = field(default_factory=Constraint)  # what the finished answer must be
    repetition_guard: bool = default("repetition_guard")  # stop an answer caught in a loop
    speculate: str = "off"  # auto, lookup, draft or off: several tokens a pass when a draft is right
    max_draft: int = 16  # tokens a draft may have
    reasoning: bool = True  # tell a leading <think> block apart from the answer (False: all of it is the answer)
    thinking_open: bool = False  # the prompt opened a think block: the output starts inside it
    special: bool = default("special")  # control tokens' text is answer text (--special)
    tools: ToolSpec | None = None  # what the answer may call, and how (tool calls are parsed out of its text)
    logprobs: int | None = None  # each answer token's logprob and this many most likely alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (a completion's echo: the
    # whole prompt evaluated again, none of it reused)
    think_budget: int | None = None  # tokens of thinking before the think block is closed (None: no limit)
    call_preference: float = default("call_preference")  # tool_choice auto: the call's opening favoured this much
    call_gain: float = default("call_gain")  # and this much more for a question wholly about what the tools do
    fit_history: bool = False  # a conversation's oldest exchanges may be dropped to fit (chat; a server does it)
    trace: int | None = None  # each sampled token traced with this many candidates (run --trace; None: off)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], sampling: SamplingConfig, constraint: Constraint | None = None,
                      **given: Any) -> GenerationOptions:
        """The options effective settings describe: the one place settings become GenerationOptions, for run, chat,
        --batch, the warm path, --endpoint and serve alike (-n, --stop, the repetition guard, --speculate,
        --reasoning, --special, --logprobs); `given` sets what the caller knows better (a request's own -n, stops,
        tools or logprobs; the draft limit)."""
        found = cls(sampling, values["max_tokens"], tuple(values["stop"]), constraint or Constraint(),
                    values["repetition_guard"], values["speculate"], reasoning=values["reasoning"] != "stdout",
                    special=values["special"], logprobs=values["logprobs"], think_budget=values["think_budget"],
                    call_preference=values["call_preference"], call_gain=values["call_gain"])
        return dataclasses.replace(found, **given) if given else found

    def for_turn(self, question: str | None) -> GenerationOptions:
        """--call-preference favours a call in the answer to the user's message (`question`), the more the more of it
        is about what the tools do (--call-gain × `relevance`); after tool results (None) the model reads them, and
        its own choice decides whether it calls again (favoured, a small model calls until its limit)."""
        if not self.call_preference:
            return self
        if question is None or self.tools is None:
            return dataclasses.replace(self, call_preference=0.0)
        bonus = self.call_gain * relevance(question, self.tools.offered)
        return dataclasses.replace(self, call_preference=self.call_preference + bonus)

    def for_prompt(self, prompt_text: str, template_source: str | None) -> GenerationOptions:
        """These options for one rendered prompt — the one place run, chat, --batch and serve decide it: a template
        that opened a think block starts the answer inside it (`thinking_open`), and a reasoning model (its template
        knows <think>) may think before a forced tool call (`think_first`)."""
        options = self
        if options.reasoning and opens_thinking(prompt_text):
            options = dataclasses.replace(options, thinking_open=True)
        if options.tools is not None and options.reasoning and "<think>" in (template_source or ""):
            options = dataclasses.replace(options, tools=dataclasses.replace(options.tools, think_first=True))
        return options


# The repetition guard: an answer is caught in a loop when its last LOOP_SPAN tokens (or LOOP_REPEATS
# periods, if longer) repeat one run of at most LOOP_PERIOD tokens exactly. Looked for every LOOP_EVERY tokens.
LOOP_SPAN, LOOP_REPEATS, LOOP_PERIOD, LOOP_EVERY = 64, 3, 128, 8


class Answer:
    """Sampled tokens in, events out; `finish` is set once the answer is over:

    `stop` (end of generation), `stop_sequence`, `length` (-n reached), `context_full`
    (the token just sampled has no cell left in the context to be decoded in) or `repetition`
    (the answer is caught in a loop, when the guard is on).
    """

    def __init__(self, options: GenerationOptions, n_prompt: int, n_ctx: int):
        splitter = ReasoningSplitter(options.thinking_open) if options.reasoning else None
        self.splitter = splitter
        self.think_budget = options.think_budget
        self.thought_tokens = 0  # tokens sampled inside the think block
        self.calls = ToolCallParser(options.tools) if options.tools is not None and options.tools.active else None
        self.stream = AnswerText(options.stops, splitter, self.calls)  # token bytes -> printable text and calls
        self.limit = options.max_tokens if options.max_tokens is not None else sys.maxsize
        self.room = n_ctx - n_prompt  # tokens of answer that fit after the prompt
        self.n_out = 0  # tokens of the answer (an end-of-generation token is not counted)
        self.finish: str | None = None
        self.constraint = options.constraint
        self.parts: list[str] = []  # the answer's text so far
        self.thought: list[str] = []  # the reasoning so far
        self.tokens: list[int] | None = [] if options.repetition_guard else None
        self.logprobs: list[TokenLogprob] = []  # of the tokens in the answer's text so far
        self._unsent: list[TokenLogprob] = []  # of tokens whose text is held back

    def add(self, token: int, end_of_generation: bool, piece: bytes,
            logprob: TokenLogprob | None = None) -> tuple[Token | CallEvent, ...]:
        """One sampled token (its id, its bytes and, when asked for, its logprob): the text it completes, as events
        (none while held back)."""
        if end_of_generation:
            self.finish = "stop"
            return ()
        self.n_out += 1
        if logprob is not None:
            self._unsent.append(logprob)
        thinking = self.splitter is not None and self.splitter.thinking
        events = self._events(self.stream.feed(piece))
        if thinking or (self.splitter is not None and self.splitter.thinking):
            self.thought_tokens += 1
        tokens = self.tokens
        if tokens is not None:
            tokens.append(token)
        if self.stream.stop is not None:
            self.finish = "stop_sequence"
        elif self.calls is not None and self.calls.repeated:
            self.finish = "stop"  # (a call the answer had made already: it ends there, as "tool_calls")
        elif self.n_out >= self.limit:
            self.finish = "length"
        elif self.n_out > self.room:
            self.finish = "context_full"
        elif tokens is not None and self.n_out % LOOP_EVERY == 0 and not (self.calls is not None and self.calls.in_call) \
                and looping(tokens):  # (a call is never cut into invalid JSON: its grammar and -n end it)
            self.finish = "repetition"
        return events

    @property
    def thinking_spent(self) -> bool:
        """The think block is still open and has had its --think-budget of tokens: the decode loop closes it."""
        return self.think_budget is not None and self.splitter is not None and self.splitter.thinking \
            and self.thought_tokens >= self.think_budget

    def close(self) -> tuple[Token | CallEvent, ...]:
        """No more tokens: release what was held back (a stop sequence completing now ends it there)."""
        events = self._events(self.stream.finish())
        if self.stream.stop is not None:
            self.finish = "stop_sequence"
        elif self.finish in ("length", "context_full") and self.calls is not None and self.calls.ended_after_calls:
            self.finish = "stop"  # (the limit cut no call: the answer is its calls, as "tool_calls")
        return events

    def _events(self, text: str) -> tuple[Token | CallEvent, ...]:
        events: tuple[Token | CallEvent, ...] = self._text_events(text)
        if self.stream.call_events:
            events += tuple(self.stream.call_events)
            self.stream.call_events = []
            self._unsent.clear()  # a call's markup is not answer text
        return events

    def _text_events(self, text: str) -> tuple[Token, ...]:
        reasoning = self.stream.reasoning
        thought: tuple[Token, ...] = ()
        if reasoning:
            self.stream.reasoning = ""  # taken: a later piece of pure answer must not bring it again
            self.thought.append(reasoning)
            thought = (Token(reasoning, reasoning=True),)
        if not text:
            if reasoning:
                self._unsent.clear()  # the reasoning's tokens: no answer text of theirs to carry them
            return thought
        self.parts.append(text)
        if not self._unsent:  # (logprobs not asked for: nothing more to do for this token)
            return (*thought, Token(text))
        logprobs = tuple(self._unsent)
        self.logprobs.extend(logprobs)
        self._unsent.clear()
        return (*thought, Token(text, logprobs=logprobs))

    def done(self, finish: str, stats: Stats) -> Done:
        """The Done of this answer: why it ended (its own finish rule first, else `finish`), and the answer."""
        reason = self.finish or finish
        calls = tuple(self.calls.calls) if self.calls is not None else ()
        if calls and reason == "stop":
            reason = "tool_calls"
        return Done(reason, stats, self.stream.stop, self.constraint.problem(self.content, reason), self.content,
                    self.reasoning, calls, logprobs=tuple(self.logprobs))

    @property
    def content(self) -> str:
        """The text of the answer so far."""
        return "".join(self.parts)

    @property
    def reasoning(self) -> str | None:
        """The model's reasoning (its think block), or None when it wrote none."""
        return "".join(self.thought).strip() or None


def looping(tokens: list[int]) -> bool:
    """Whether the end of `tokens` repeats one run of tokens over and over (see LOOP_SPAN)."""
    last = tokens[-1]
    for period in range(1, min(LOOP_PERIOD, len(tokens) // LOOP_REPEATS) + 1):
        span = max(LOOP_SPAN, LOOP_REPEATS * period)
        if span > len(tokens):
            break
        # periodic: each token of the span equals the one `period` later (the last token first: cheap)
        if tokens[-1 - period] == last and tokens[-span:-period] == tokens[-span + period:]:
            return True
    return False
