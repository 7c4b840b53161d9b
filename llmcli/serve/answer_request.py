"""What every protocol asks of the answer loop, in llmcli's terms (`AnswerRequest`), and how it becomes what the
slots need (`prepare`: the prompt rendered and tokenized, the budget checked, the sampler configured) — validated
as `run` validates its flags. Each protocol (openai_api, ollama_api, anthropic_api, responses_api) only translates
its body into an AnswerRequest and llmcli's events into its own wire format. No HTTP here (llmcli/serve/app.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmcli.answer.answerer import RenderedPrompt
from llmcli.answer.constraint import Constraint
from llmcli.answer.context_budget import (
    MAX_CHARS_PER_TOKEN,
    answer_room,
    capped,
    overflow,
    truncated,
    truncation_notice,
)
from llmcli.answer.events import MAX_TOP_LOGPROBS
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.message import Message
from llmcli.answer.openai_wire import WireError
from llmcli.answer.sampling_config import SamplingConfig, check_grammar, resolve_logit_bias
from llmcli.answer.shared_prefix import shared_prefix
from llmcli.answer.tool_calls import ToolSpec, tool_spec
from llmcli.config.settings import SETTINGS, check_value
from llmcli.errors import LlmcliError
from llmcli.llama.schema_grammar import tool_grammar, with_grammar

MAX_STOPS = 16
MAX_LOGIT_BIASES = 1024  # tokens one request may bias
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
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options
    prompt_param: str = "messages"  # how this protocol names the prompt and the limit, for errors
    limit_param: str = "max_tokens"
    on_overflow: str = "error"  # llmcli's own field: "truncate" drops the start of the last message until it fits


@dataclass(frozen=True)
class Parsed:
    tokens: list[int]
    generation: GenerationOptions
    seed: int
    stream: bool
    include_usage: bool
    stable: int | None = None  # where the conversation's standing part ends (its KV state is kept there)
    notices: tuple[str, ...] = ()  # what the asker should know (run's words: the input truncated, -n capped)


def prepare(request: AnswerRequest, prompter: Prompter) -> Parsed:
    """The request rendered, tokenized and checked against the context: what a slot needs; ApiError otherwise."""
    rendered = _render(request, prompter)
    values = {**prompter.defaults, **request.settings}
    limits = prompter.limits
    notices: list[str] = []
    asked = request.max_tokens or values["max_tokens"]
    if request.on_overflow == "truncate" and len(rendered.tokens) + (asked or 1) > limits.n_ctx:
        request, rendered, cut = _truncated(request, prompter, asked)
        notices.append(cut)
    room = limits.n_ctx - len(rendered.tokens)
    if room < 1:  # (in run's words, with its hint: a warm run's error is an in-process run's)
        problem = overflow(len(rendered.tokens), request.max_tokens, limits.n_ctx, limits.n_ctx_train)
        raise ApiError(400, problem.message, param=request.prompt_param, code="context_length_exceeded", cause=problem)
    # As llama-server and Ollama do, an answer asked to be longer than fits is as long as fits (it ends `length`):
    # agents ask for 32,000 tokens whatever the model (Claude Code does); as run says, so does the answer's notices.
    cap = capped(asked, len(rendered.tokens), limits.n_ctx)[1]
    if cap is not None and request.on_overflow != "truncate":
        notices.append(cap)
    max_tokens = min(asked or limits.max_tokens, room, limits.max_tokens)
    stops = tuple(request.stops if request.stops is not None else values["stop"])
    constraint = request.constraint
    if not (constraint.grammar or constraint.json) and not (request.tools is not None and request.tools.active):
        constraint = prompter.constraint  # (the server's own, if it has one)
    try:
        if constraint.grammar is not None and constraint.origin == "grammar":  # a request's own GBNF
            prompter.check_grammar(constraint.grammar, "grammar")
    except LlmcliError as exc:
        raise ApiError(400, exc.message, param="grammar") from None
    try:
        biases = resolve_logit_bias(list(request.logit_bias), prompter.tokenize_piece, prompter.n_vocab)
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace("--logit-bias ", "logit_bias: ", 1), param="logit_bias",
                       cause=exc) from None
    try:
        sampling = SamplingConfig.from_settings(values, logit_bias=prompter.logit_bias + biases,
                                                grammar=constraint.grammar, grammar_origin=constraint.origin)
    except LlmcliError as exc:
        raise ApiError(400, exc.message) from None
    generation = GenerationOptions.from_settings(values, sampling, constraint, max_tokens=max_tokens, stops=stops,
                                                 max_draft=limits.max_draft, tools=request.tools,
                                                 logprobs=request.logprobs).for_prompt(rendered.text,
                                                                                        prompter.template_source)
    last = request.messages[-1] if request.messages else None
    generation = generation.for_turn(last.content if last is not None and last.role == "user" else None if last is not None
                                     else request.prompt if isinstance(request.prompt, str) else "")
    return Parsed(rendered.tokens, generation, sampling.effective_seed(), request.stream, request.include_usage,
                  _stable(request, prompter, rendered.tokens), tuple(notices))


def _truncated(request: AnswerRequest, prompter: Prompter, max_tokens: int | None) -> tuple[
        AnswerRequest, RenderedPrompt, str]:
    """`on_overflow: truncate` (run's --on-overflow truncate, through a warm server): the start of the last message
    (or of the prompt) dropped until the prompt and room for the answer fit, as run drops it; the request as cut,
    its prompt, and run's notice."""
    n_ctx = prompter.limits.n_ctx
    budget = n_ctx - answer_room(max_tokens, n_ctx)
    messages = request.messages or []
    last = messages[-1] if messages else None
    if last is not None and last.role == "user" and not last.images:
        whole = last.content

        def cut(kept: str) -> AnswerRequest:
            return dataclasses.replace(request, messages=[*messages[:-1], dataclasses.replace(last, content=kept)])
    elif request.messages is None and isinstance(request.prompt, str):
        whole = request.prompt

        def cut(kept: str) -> AnswerRequest:
            return dataclasses.replace(request, prompt=kept)
    else:
        raise ApiError(400, "on_overflow truncate cuts the text of a last user message (without images) or of a prompt",
                       param="on_overflow")
    best = truncated(whole[-n_ctx * MAX_CHARS_PER_TOKEN:], lambda kept: _render(cut(kept), prompter),
                     lambda prompt: len(prompt.tokens), budget)
    if best is None:
        empty = len(_render(cut(""), prompter).tokens)
        problem = overflow(empty, max_tokens, n_ctx, prompter.limits.n_ctx_train, can_truncate=False)
        raise ApiError(400, problem.message, param=request.prompt_param, code="context_length_exceeded", cause=problem)
    kept, rendered = best
    return cut(kept), rendered, truncation_notice(n_ctx, whole, kept, len(rendered.tokens))


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
        return RenderedPrompt(prompt or "", prompter.tokenize(prompt or ""))
    if not request.messages:
        raise ApiError(400, f"{request.prompt_param} must not be empty", param=request.prompt_param)
    if len(request.messages) > MAX_MESSAGES:
        raise ApiError(400, f"{request.prompt_param}: at most {MAX_MESSAGES} messages", param=request.prompt_param)
    try:
        return prompter.render_chat(request.messages, request.think, request.tools)
    except LlmcliError as exc:  # the template refused the conversation
        raise ApiError(400, exc.message, param=request.prompt_param) from None


# -- the pieces each protocol checks the same way ----------------------------------------------------------


# A reasoning effort's thinking budget (--think-budget): OpenAI's reasoning_effort and Ollama's think levels.
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}


def think_budget_of(effort: Any) -> dict[str, Any]:
    """The settings an effort level sets: its thinking budget (none for high, or for a plain switch)."""
    budget = EFFORT_BUDGETS.get(effort) if isinstance(effort, str) else None
    return {"think_budget": budget} if budget is not None else {}


def checked(setting_name: str, value: Any, param: str) -> Any:
    """A request's value for a setting, checked as the setting's flag is; ApiError naming `param` otherwise."""
    setting = SETTINGS[setting_name]
    if setting.kind is bool:
        if not isinstance(value, bool):
            raise ApiError(400, f"{param} must be true or false", param=param)
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (setting.kind is float or isinstance(value, int))
    if not ok:
        raise ApiError(400, f"{param} must be {'an integer' if setting.kind is int else 'a number'}", param=param)
    value = float(value) if setting.kind is float else value
    try:
        check_value(setting, value, "request")
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace(setting.flag, param, 1), param=param) from None
    return setting.normalised(value)


def settings_of(body: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """The settings a body gives: `fields` maps its names to llmcli's settings."""
    return {name: checked(name, body[wire], wire) for wire, name in fields.items() if body.get(wire) is not None}


def stops_of(value: Any, param: str = "stop") -> list[str] | None:
    """A stop string or a list of them (None: not given)."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"{param} must be a string or a list of at most {MAX_STOPS} strings", param=param)
    return stops


def max_tokens_of(value: Any, param: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"{param} must be an integer of at least 1", param=param)
    return value


def constraint_of(kind: str | None, schema: Any = None, grammar: Any = None, param: str = "response_format") -> Constraint:
    """The answer's constraint: None/"text" (a GBNF `grammar`, or nothing), "json" (any JSON object) or "json_schema";
    its messages name the request's field (`param`), not a flag."""
    if grammar is not None and not isinstance(grammar, str):
        raise ApiError(400, "grammar must be a GBNF string", param="grammar")
    if kind in (None, "text"):
        if grammar:
            try:
                check_grammar(grammar, "grammar")  # before llama.cpp's parser sees it (prepare's check_grammar)
            except LlmcliError as exc:
                raise ApiError(400, exc.message, param="grammar") from None
        return Constraint(grammar, "grammar") if grammar else Constraint()
    if grammar is not None:
        raise ApiError(400, f"grammar and {param} cannot be combined", param="grammar")
    if kind == "json":
        return with_grammar(Constraint(None, param, json=True))
    if kind != "json_schema":
        raise ApiError(400, f"{param} is not a format this server knows", param=param)
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: the schema must be an object", param=param)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        return with_grammar(Constraint(None, param, json=True, schema=schema))
    except jsonschema.exceptions.SchemaError as exc:
        raise ApiError(400, f"{param}: not a valid JSON Schema: {exc.message}", param=param) from None
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace("--json-schema", param), param=param) from None


def tools_of(tools: Any, choice: Any, prompter: Prompter, parallel: Any = True, param: str = "tools",
             grammar: bool = True) -> ToolSpec | None:
    """Function tools (OpenAI's objects, or their inner `{name, description, parameters}`), a choice (auto, none,
    required, a tool's name) and whether calls may come several at once, as one spec (None without tools); `grammar`:
    check now that their calls' grammar can be made (counting tokens needs none)."""
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, f"{param} must be a list of function tools", param=param)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    try:
        spec = tool_spec(tools, choice, prompter.tool_format, parallel)
        if not spec.tools and spec.choice.mode == "required":
            raise LlmcliError("tool_choice required needs tools")
        if spec.active and grammar:
            tool_grammar(spec)  # a schema no grammar can hold is this request's 400, not a failed slot
    except LlmcliError as exc:
        raise ApiError(400, exc.message.replace("tools", param, 1),
                       param="tool_choice" if "tool_choice" in exc.message else param) from None
    return spec


def logit_bias_of(value: Any) -> tuple[tuple[int | str, float], ...]:
    """OpenAI's `{"TOKEN_ID": bias}`, or llama-server's `[[TOKEN_ID or "text", bias or false], …]` (a text is one
    token of the model's vocabulary; false bans the token): resolved against the vocabulary in `prepare`."""
    if value is None:
        return ()
    shape = "logit_bias must map token ids to numbers, or list [token id or text, number or false] pairs"
    if isinstance(value, dict):
        pairs: list[Any] = list(value.items())
        if not all(isinstance(token, str) and token.strip().lstrip("-").isdigit() for token, _ in pairs):
            raise ApiError(400, shape, param="logit_bias")
        pairs = [(int(token), bias) for token, bias in pairs]
    elif isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in value):
        pairs = [tuple(pair) for pair in value]
    else:
        raise ApiError(400, shape, param="logit_bias")
    if len(pairs) > MAX_LOGIT_BIASES:
        raise ApiError(400, f"logit_bias: at most {MAX_LOGIT_BIASES} tokens", param="logit_bias")
    biases: list[tuple[int | str, float]] = []
    for token, bias in pairs:
        ok_token = (isinstance(token, int) and not isinstance(token, bool)) or (isinstance(token, str) and 0 < len(token) <= 256)
        if not ok_token or not (bias is False or (isinstance(bias, (int, float)) and not isinstance(bias, bool))):
            raise ApiError(400, shape, param="logit_bias")
        if bias is not False and not -100 <= bias <= 100:
            raise ApiError(400, "logit_bias values must be in [-100, 100] (false bans the token)", param="logit_bias")
        biases.append((token, -math.inf if bias is False else float(bias)))
    return tuple(biases)


def top_logprobs_of(wanted: Any, top: Any, param: str = "top_logprobs") -> int | None:
    """`logprobs: true` and `top_logprobs: N` (OpenAI's chat, Ollama) -> N alternatives, or None for no logprobs."""
    if wanted in (None, False):
        if top not in (None, 0):
            raise ApiError(400, f"{param} needs logprobs: true", param=param)
        return None
    if wanted is not True:
        raise ApiError(400, "logprobs must be true or false", param="logprobs")
    return count_of(top or 0, param)


def count_of(value: Any, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be an integer in [0, {MAX_TOP_LOGPROBS}]", param=param)
    return value


def count_tokens(request: AnswerRequest, prompter: Prompter) -> int:
    """The tokens the request's prompt has, as the model will read it (Anthropic's count_tokens)."""
    return len(_render(request, prompter).tokens)


def check_fields(body: Mapping[str, Any], taken: frozenset[str], refused: Mapping[str, str] = {}) -> None:
    """Every field a request gives is honoured, read and left on purpose (both in `taken`), or a 400 naming it:
    `refused` says why a field of the protocol is not supported here; any other is unknown."""
    for name, value in body.items():
        if name in refused and value not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported here ({refused[name]})", param=name)
        if name not in taken and name not in refused:
            raise ApiError(400, f"{name} is not a field this route takes", param=name)
