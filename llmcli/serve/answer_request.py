"""What every protocol asks of the answer loop, in llmcli's terms (`AnswerRequest`), and how it becomes what the
slots need (`prepare`: the prompt rendered and tokenized, the budget checked, the sampler configured); the fields a
request takes are checked as `run` checks its flags by llmcli/serve/request_fields.py. Each protocol (openai_api,
ollama_api, anthropic_api, responses_api) only translates its body into an AnswerRequest and llmcli's events into its
own wire format. No HTTP here (llmcli/serve/app.py)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer import preparation
from llmcli.answer.answerer import RenderedPrompt, exchange_starts, oldest_exchange_end
from llmcli.answer.constraint import Constraint
from llmcli.answer.context_budget import answer_room, dropped_notice
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.answer.openai_wire import WireError
from llmcli.answer.preparation import Context
from llmcli.answer.sampling_config import SamplingConfig, resolve_logit_bias
from llmcli.answer.shared_prefix import shared_prefix
from llmcli.answer.tool_calls import ToolSpec
from llmcli.errors import LlmcliError

MAX_MESSAGES = 2048  # a conversation's messages (an earlier response's count): more is refused before any is read

# HTTP status -> the kind of error, in OpenAI's and Anthropic's words (Ollama's errors have none)
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class ApiError(WireError):
    """An error response: its HTTP status, what went wrong, and where (each protocol writes it in its own shape). A
    body that is not its protocol's shape is a plain WireError: a 400."""

    def __init__(self, status: int, message: str, kind: str | None = None, param: str | None = None,
                 code: str | None = None, cause: LlmcliError | None = None):
        super().__init__(message, param)
        self.status, self.code = status, code
        self.kind = kind or KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.cause = cause  # llmcli's own error behind it: its hint and exit code go out with it (`llmcli_error`)


@dataclass(frozen=True)
class Limits:
    n_ctx: int  # a slot's context: prompt + answer
    max_tokens: int  # the most tokens an answer may ask for
    max_body_bytes: int
    max_draft: int = 16  # tokens a draft may have (speculative decoding: the server's --speculate, --draft-max)
    n_ctx_train: int = 0  # the context the model was trained on (0: it does not say): what a too-long prompt's hint says


@dataclass(frozen=True)
class Prompter:
    """How this server turns messages or a prompt into tokens (the model's template, its vocabulary)."""

    # messages, --think (None: as the server's), the tools
    render_chat: Callable[[list[Message], bool | None, ToolSpec | None], RenderedPrompt]
    tokenize: Callable[[str], list[int]]
    model_names: tuple[str, ...]  # what `model` may say (the first is the name the model lists show)
    defaults: Mapping[str, Any]  # the server's effective settings (its flags and config file)
    limits: Limits
    tool_format: str = "generic"  # how this model writes a call (its template's, or --tool-format)
    n_vocab: int = 0  # token ids a prompt may hold are below it
    check_grammar: Callable[[str, str], None] = lambda gbnf, origin: None  # LlmcliError if llama.cpp refuses it
    template_source: str = ""  # the model's chat template (what follows from a rendered prompt: GenerationOptions)
    split_min: int = 0  # a conversation this long is split where its standing part ends (0: never; the prompt cache)
    tokenize_piece: Callable[[str], list[int]] = lambda text: []  # a text's tokens, no BOS (a logit bias given as text)
    logit_bias: tuple[tuple[int, float], ...] = ()  # the server's own --logit-bias, before each request's
    constraint: Constraint = field(default_factory=Constraint)  # serve's --grammar, --json-schema, --format: the
    # constraint of a request that sets none (nor tools) of its own
    render_raw: Callable[[str, tuple[ImageInput, ...]], RenderedPrompt] | None = None  # a raw prompt with pictures
    detokenize: Callable[[list[int], bool], str] = lambda tokens, special: ""  # tokens -> text (control tokens' text
    # with `special`): an echoed prompt given as ids, /detokenize
    special_tokens: Mapping[str, Any] = field(default_factory=dict)  # bos_token, eos_token (their text), add_bos_token

    def check_model(self, model: Any, message: Callable[[str], str] | None = None) -> None:
        """404 unless `model` (when given) names this server's model."""
        if model is not None and model not in self.model_names:
            text = f"the model {model!r} does not exist here; this server has {self.model_names[0]!r}"
            raise ApiError(404, message(model) if message else text, param="model", code="model_not_found")


@dataclass(frozen=True)
class AnswerRequest:
    """One answer, as any protocol asks for it: a conversation (`messages`) or a raw prompt (text or token ids)."""

    messages: list[Message] | None = None
    prompt: str | list[int] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)  # setting name -> value (checked), over the server's
    max_tokens: int | None = None  # None: the server's -n, else until the model stops or the context is full
    stops: Sequence[str] | None = None  # None: the server's --stop
    constraint: Constraint = field(default_factory=Constraint)  # a grammar or JSON format (see `constraint_of`)
    tools: ToolSpec | None = None
    think: bool | None = None  # None: as the server's --think
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # (token id or a token's text, bias; -inf bans)
    logprobs: int | None = None  # how many alternatives beside each token's logprob (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (a completion's echo; None: not scored)
    echo: bool = False  # a completion's text begins with its prompt (OpenAI's legacy `echo`)
    trace: int | None = None  # llmcli's own field: each token traced with this many candidates (a streamed answer)
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options
    prompt_param: str = "messages"  # how this protocol names the prompt and the limit, for errors
    limit_param: str = "max_tokens"
    on_overflow: str = "error"  # llmcli's own field: "truncate" drops the start of the last message until it fits
    grammar_origin: str | None = None  # llmcli's own field: the flag a warm run's grammar came from (its errors' words)
    split_reasoning: bool = True  # False (llama-server's reasoning_format "none"): a think block stays in the text
    fit_history: bool = False  # llmcli's own field (a warm chat): the oldest exchanges dropped until it fits
    images: tuple[ImageInput, ...] = ()  # a raw prompt's pictures (its markers say where; Ollama's raw generate)


@dataclass(frozen=True)
class Parsed:
    tokens: list[int]
    generation: GenerationOptions
    seed: int
    stream: bool
    include_usage: bool
    stable: int | None = None  # where the conversation's standing part ends (its KV state is kept there)
    notices: tuple[str, ...] = ()  # what the asker should know (run's words: the input truncated, -n capped)
    started: float = 0.0  # perf_counter when it was prepared: its answer's clock starts there (as a run's does)
    prompt_s: float = 0.0  # rendering and tokenizing it (part of the TTFT, as a run's)
    dropped: int = 0  # the conversation's oldest exchanges dropped to fit the context (fit_history)
    images: tuple[ImageInput, ...] = ()  # the pictures its prompt holds (the engine prepares them again)


def prepare(request: AnswerRequest, prompter: Prompter) -> Parsed:
    """The request as a slot needs it — its options from its fields over the server's settings, its prompt rendered
    and fitted as every path fits one (llmcli/answer/preparation.py) — or ApiError."""
    started = time.perf_counter()
    values = {**prompter.defaults, **request.settings}
    limits = prompter.limits
    asked = request.max_tokens or values["max_tokens"]
    generation = _options(request, prompter, values, asked)
    rendered = _render(request, prompter)
    notices: list[str] = []
    dropped = 0
    if request.fit_history and request.messages is not None:
        request, rendered, dropped = _fitted(request, prompter, rendered, asked)
        if dropped:
            notices.append(dropped_notice(dropped))
    text, render, cuttable = _message(request, prompter)
    truncate = request.on_overflow == "truncate"
    try:
        prepared = preparation.prepare(render, text, generation, Context(limits.n_ctx, limits.n_ctx_train),
                                       truncate=truncate and cuttable, template_source=prompter.template_source,
                                       count=lambda whole: len(prompter.tokenize_piece(whole)))
    except LlmcliError as exc:
        if truncate and not cuttable:
            raise ApiError(400, "on_overflow truncate cuts the text of a last user message (without images) or of a "
                           "prompt", param="on_overflow") from None
        raise ApiError(400, exc.message, param=request.prompt_param, code="context_length_exceeded", cause=exc) from None
    if prepared.truncated:
        request = _with_message(request, prepared.text or "")
    room = limits.n_ctx - len(prepared.prompt.tokens)
    # As llama-server and Ollama do, an answer asked to be longer than fits is as long as fits (it ends `length`):
    # agents ask for 32,000 tokens whatever the model (Claude Code does); as run says, so does the answer's notices.
    max_tokens: int | None = min(asked or limits.max_tokens, room, limits.max_tokens)
    if asked is None and room <= limits.max_tokens:
        max_tokens = None  # (no -n: until the context is full, which the answer's end says: context_full, as run's)
    if request.max_tokens == 0:  # (a completion's echo that only scores its prompt)
        max_tokens = 0
    generation = dataclasses.replace(prepared.generation, max_tokens=max_tokens)
    tokens = prepared.prompt.tokens
    stable = _stable(request, prompter, tokens)
    images = (*request.images, *(image for message in request.messages or () for image in message.images))
    return Parsed(tokens, generation, generation.sampling.effective_seed(), request.stream, request.include_usage,
                  stable, (*notices, *prepared.notices), started, time.perf_counter() - started, dropped,
                  images if any(token < 0 for token in tokens) else ())


def _options(request: AnswerRequest, prompter: Prompter, values: Mapping[str, Any],
             max_tokens: int | None) -> GenerationOptions:
    """What the request's fields over the server's settings ask of the answer (its sampler, constraint, stops,
    tools...): a run's flags over its config are the same settings (GenerationOptions.from_settings)."""
    stops = tuple(request.stops if request.stops is not None else values["stop"])
    constraint = request.constraint
    if not (constraint.grammar or constraint.json) and not (request.tools is not None and request.tools.active):
        constraint = prompter.constraint  # (the server's own, if it has one)
    try:
        if constraint.grammar is not None and constraint.origin == "grammar":  # a request's own GBNF
            prompter.check_grammar(constraint.grammar, request.grammar_origin or "grammar")
    except LlmcliError as exc:
        raise ApiError(400, exc.message, param="grammar", cause=exc) from None
    try:
        biases = resolve_logit_bias(list(request.logit_bias), prompter.tokenize_piece, prompter.n_vocab)
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace("--logit-bias ", "logit_bias: ", 1), param="logit_bias",
                       cause=exc) from None
    try:
        sampling = SamplingConfig.from_settings(values, logit_bias=prompter.logit_bias + biases,
                                                grammar=constraint.grammar, grammar_origin=constraint.origin)
    except LlmcliError as exc:
        raise ApiError(400, exc.message, cause=exc) from None
    generation = GenerationOptions.from_settings(values, sampling, constraint, max_tokens=max_tokens, stops=stops,
                                                 max_draft=prompter.limits.max_draft, tools=request.tools,
                                                 logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs,
                                                 trace=request.trace)
    return generation if request.split_reasoning else dataclasses.replace(generation, reasoning=False)


def _message(request: AnswerRequest, prompter: Prompter) -> tuple[str | None, preparation.Render, bool]:
    """The text of the request's new message (the last user message, or a text prompt; None: it has none), the
    request rendered with that text in its place, and whether the text may be cut (--on-overflow truncate: not a
    message with pictures, whose markers sit in it)."""
    messages = request.messages or []
    last = messages[-1] if messages else None
    if request.messages is None and isinstance(request.prompt, str):
        text, cuttable = request.prompt, not request.images
    elif last is not None and last.role == "user":
        text, cuttable = last.content, not last.images
    else:
        return None, lambda _: _render(request, prompter), False

    def render(kept: str | None) -> RenderedPrompt:
        return _render(request if kept is None or kept == text else _with_message(request, kept), prompter)

    return text, render, cuttable


def _with_message(request: AnswerRequest, text: str) -> AnswerRequest:
    """The request with `text` as its new message's (the last user message's, or the prompt)."""
    if request.messages is None:
        return dataclasses.replace(request, prompt=text)
    *earlier, last = request.messages
    return dataclasses.replace(request, messages=[*earlier, dataclasses.replace(last, content=text)])


def _fitted(request: AnswerRequest, prompter: Prompter, rendered: RenderedPrompt, max_tokens: int | None) -> tuple[
        AnswerRequest, RenderedPrompt, int]:
    """`fit_history` (a chat through its warm server): the oldest exchanges after the system messages dropped, as
    chat drops them in this process, until the prompt and room for the answer fit or the last exchange is left; the
    request as fitted, its prompt, and how many exchanges went."""
    budget = prompter.limits.n_ctx - answer_room(max_tokens, prompter.limits.n_ctx)
    messages = list(request.messages or [])
    lead = len(list(itertools.takewhile(lambda message: message.role == "system", messages)))
    dropped = 0
    while len(rendered.tokens) > budget and len(exchange_starts(messages[lead:])) > 1:
        messages = messages[:lead] + messages[lead:][oldest_exchange_end(messages[lead:]):]
        dropped += 1
        request = dataclasses.replace(request, messages=messages)
        rendered = _render(request, prompter)
    return request, rendered, dropped


def _stable(request: AnswerRequest, prompter: Prompter, tokens: list[int]) -> int | None:
    """Where a long conversation's standing part ends — its system prompt and tools, which an agent sends first in
    every session: the tokens the prompt shares with the same request whose conversation is one placeholder message
    (its user header included). None for a short or raw prompt, or when the prompt cache is off."""
    if not prompter.split_min or request.messages is None or len(tokens) < prompter.split_min:
        return None
    leading = list(itertools.takewhile(lambda message: message.role == "system", request.messages))
    try:
        probe = prompter.render_chat([*leading, Message("user", "\ue000")], request.think, request.tools)
    except LlmcliError:
        return None
    stable = min(shared_prefix(probe.tokens, tokens), len(tokens) - 1)
    return stable if stable >= prompter.split_min else None


def _render(request: AnswerRequest, prompter: Prompter) -> RenderedPrompt:
    if request.messages is None:
        prompt = request.prompt
        if isinstance(prompt, list):  # token ids
            if not prompt or any(not 0 <= t < prompter.n_vocab for t in prompt):
                raise ApiError(400, f"{request.prompt_param}: token ids are in [0, {prompter.n_vocab})",
                               param=request.prompt_param)
            return RenderedPrompt("", list(prompt))
        if request.images:  # (as `run --raw --image` renders it: the text, each picture's tokens where it is)
            if prompter.render_raw is None:
                raise ApiError(400, "this model does not see images", param="images")
            try:
                return prompter.render_raw(prompt or "", request.images)
            except LlmcliError as exc:
                raise ApiError(400, exc.message, param="images", cause=exc) from None
        return RenderedPrompt(prompt or "", prompter.tokenize(prompt or ""))
    if not request.messages:
        raise ApiError(400, f"{request.prompt_param} must not be empty", param=request.prompt_param)
    if len(request.messages) > MAX_MESSAGES:
        raise ApiError(400, f"{request.prompt_param}: at most {MAX_MESSAGES} messages", param=request.prompt_param)
    try:
        return prompter.render_chat(request.messages, request.think, request.tools)
    except LlmcliError as exc:  # the template refused the conversation
        raise ApiError(400, exc.message, param=request.prompt_param, cause=exc) from None  # (a warm run's: run's words)


def prompt_tokens(request: AnswerRequest, prompter: Prompter) -> list[int]:
    """The tokens of the request's prompt, as the model will read it (Anthropic's count_tokens, vLLM's /tokenize):
    rendered as an answer's is, with its limits and errors."""
    return _render(request, prompter).tokens


def count_tokens(request: AnswerRequest, prompter: Prompter) -> int:
    """How many tokens the request's prompt has (Anthropic's count_tokens)."""
    return len(prompt_tokens(request, prompter))
