"""The fields every protocol's request takes and checks the same way, as `run` checks its flags: settings,
stops, limits, a format or grammar, tools, logit biases, logprobs, a reasoning effort, and the fields a route takes at
all — each a 400 naming the field (ApiError) when it is wrong. What a request then becomes is
llmcli/serve/answer_request.py's (`prepare`). No HTTP here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from llmcli.answer.constraint import Constraint
from llmcli.answer.events import MAX_TOP_LOGPROBS
from llmcli.answer.sampling_config import check_grammar
from llmcli.answer.tool_calls import ToolSpec, tool_spec
from llmcli.config.settings import SETTINGS, check_value
from llmcli.errors import LlmcliError
from llmcli.llama.schema_grammar import tool_grammar, with_grammar
from llmcli.serve.answer_request import ApiError, Prompter

MAX_STOPS = 16
MAX_LOGIT_BIASES = 1024  # tokens one request may bias


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
                raise ApiError(400, exc.message, param="grammar", cause=exc) from None
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
        raise ApiError(400, exc.message.replace("--json-schema", param), param=param, cause=exc) from None


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
                       param="tool_choice" if "tool_choice" in exc.message else param, cause=exc) from None
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


def check_fields(body: Mapping[str, Any], taken: frozenset[str], refused: Mapping[str, str] = {}) -> None:
    """Every field a request gives is honoured, read and left on purpose (both in `taken`), or a 400 naming it:
    `refused` says why a field of the protocol is not supported here; any other is unknown."""
    for name, value in body.items():
        if name in refused and value not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported here ({refused[name]})", param=name)
        if name not in taken and name not in refused:
            raise ApiError(400, f"{name} is not a field this route takes", param=name)
