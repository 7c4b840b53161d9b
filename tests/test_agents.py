"""Coding agents' requests (issue 36, first part): every field of the official request types is honoured, left on
purpose or refused with a reason — never "not a field this route takes"; Claude Code's and Codex's first requests as
they send them; schemas as clients write them; max_tokens clamped to what fits; long prefills keep streams alive."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import HTTP, LOGS, run_cli, start_server, stop_server


def _fields(typed: type) -> set[str]:
    found: set[str] = set()
    for base in typed.__mro__:
        found |= set(getattr(base, "__annotations__", {}))
    return found


def _official_fields() -> dict[str, set[str]]:
    """Per route, the fields of the installed SDKs' request types (Ollama's client's pydantic models)."""
    import ollama._types as ollama_types
    from anthropic.types import message_count_tokens_params, message_create_params
    from anthropic.types.beta import message_count_tokens_params as beta_count
    from anthropic.types.beta import message_create_params as beta_create
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    return {
        "/v1/chat/completions": _fields(chat_create_params.CompletionCreateParamsBase),
        "/v1/completions": _fields(completion_create_params.CompletionCreateParamsBase),
        "/v1/responses": _fields(response_create_params.ResponseCreateParamsBase) | {"client_metadata"},  # Codex's
        "/v1/embeddings": _fields(embedding_create_params.EmbeddingCreateParams),
        "/v1/messages": _fields(message_create_params.MessageCreateParamsBase)
        | _fields(beta_create.MessageCreateParamsBase),
        "/v1/messages/count_tokens": _fields(message_count_tokens_params.MessageCountTokensParams)
        | _fields(beta_count.MessageCountTokensParams),
        "/api/chat": set(ollama_types.ChatRequest.model_fields),
        "/api/generate": set(ollama_types.GenerateRequest.model_fields),
        "/api/embed": set(ollama_types.EmbedRequest.model_fields),
    }


HI = [{"role": "user", "content": "hi"}]
BASE = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1}, "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1}, "/v1/embeddings": {"input": "hi"},
    "/v1/messages": {"model": "smollm2", "messages": HI, "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": "smollm2", "messages": HI},
    "/api/chat": {"model": "smollm2", "messages": HI, "stream": False, "options": {"num_predict": 1}},
    "/api/generate": {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 1}},
    "/api/embed": {"model": "smollm2", "input": "hi"},
}


SERVER_LOG: list[Path] = []  # the module's server's stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("agents"), "-P", "2", "-c", "2048", "--temp", "0",
                             "--max-answer", "16", "--stream-keepalive", "0.05")
    SERVER_LOG.append(LOGS[proc.pid])
    yield url
    stop_server(proc)


def test_no_field_of_an_official_request_type_is_refused_as_unknown(server):
    unknown = []
    for path, fields in _official_fields().items():
        for name in sorted(fields - set(BASE[path])):
            reply = HTTP.post(f"{server}{path}", json={**BASE[path], name: None}, timeout=60)
            if reply.status_code >= 400 and "not a field this route takes" in reply.text:
                unknown.append((path, name))
    assert unknown == []
    refused = HTTP.post(f"{server}/v1/chat/completions", json={**BASE["/v1/chat/completions"], "frobnicate": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frobnicate"  # typos stay caught


def test_claude_code_s_first_request_is_answered(server):
    tools = [{"name": "Bash", "description": "Run a command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"description": "ms, optional"},
                                         "extra": True}, "required": ["command"]}, "cache_control": {"type": "ephemeral"}}]
    body = {"model": "smollm2", "max_tokens": 32000, "stream": False, "tools": tools,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "The user is in /tmp."}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "x"}}
    reply = HTTP.post(f"{server}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=120)
    assert reply.status_code == 200, reply.text[:500]
    assert reply.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")  # 32000 clamped to what fits
    counted = HTTP.post(f"{server}/v1/messages/count_tokens", json={
        "model": "smollm2", "messages": body["messages"], "system": body["system"],
        "tools": [{**tools[0], "input_schema": {"type": "object", "properties": {"x": {"type": "string", "minLength": 5000}}}}]})
    assert counted.status_code == 200, counted.text  # counting builds no grammar (this one would need 5000 repeats)
    assert counted.json()["input_tokens"] > 10
    closed = HTTP.post(f"{server}/v1/messages", json={**body, "tools": [{**tools[0], "input_schema": {
        "type": "object", "properties": {"never": False}, "required": ["never"]}}], "tool_choice": {"type": "any"}})
    assert closed.status_code == 400 and "false" in closed.json()["error"]["message"]
    assert "object has no attribute" not in closed.text and "Traceback" not in closed.text


def test_codex_s_responses_request_and_a_chat_client_s_new_fields_are_answered(server):
    codex = {"model": "smollm2", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                               "text": "hi"}]}],
             "instructions": "You are Codex.", "store": False, "stream": False, "max_output_tokens": 8,
             "include": ["reasoning.encrypted_content"], "client_metadata": {"x": "y"}, "prompt_cache_key": "k",
             "reasoning": {"effort": "low", "summary": "auto"}, "text": {"verbosity": "low"}, "truncation": "auto",
             "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
    reply = HTTP.post(f"{server}/v1/responses", json=codex, timeout=120)
    assert reply.status_code == 200 and reply.json()["status"] in ("completed", "incomplete"), reply.text
    chat = {"messages": HI, "max_tokens": 4, "modalities": ["text"], "verbosity": "low", "store": False,
            "prompt_cache_key": "k", "safety_identifier": "s", "metadata": {"a": "b"}, "max_completion_tokens": 100000}
    assert HTTP.post(f"{server}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    audio = HTTP.post(f"{server}/v1/chat/completions", json={**chat, "modalities": ["text", "audio"]}, timeout=60)
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"
    (card,) = HTTP.get(f"{server}/v1/models", timeout=30).json()["data"][:1]
    assert card["max_model_len"] == 2048  # the real limit, which a larger max_tokens is clamped to
    assert "num_ctx 2048" in HTTP.post(f"{server}/api/show", json={"model": "smollm2"}, timeout=30).json()["parameters"]
    said = SERVER_LOG[0].read_text()  # one line per answer on the server's stderr, as run's stats line
    assert re.search(r"POST /v1/responses req_\w+ · prompt ", said) and re.search(
        r"POST /v1/chat/completions req_\w+ · prompt ", said)  # (each request's line, with its id)
    assert " · TTFT " in said and "stop: max tokens" in said


def test_a_long_prompt_keeps_each_stream_alive_in_its_protocol_s_way(server):
    def long(word: str) -> str:  # ~150 tokens: several keep-alive intervals (0.05 s) of prefill on one thread
        return f"Read this {word} carefully. " * 30

    cases = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": long("chat")}], "max_tokens": 2,
                                  "stream": True}, ": keep-alive"),
        "/v1/messages": ({"model": "smollm2", "messages": [{"role": "user", "content": long("message")}],
                          "max_tokens": 2, "stream": True}, "event: ping"),
        "/v1/responses": ({"input": long("response"), "max_output_tokens": 2, "stream": True},
                          "event: response.in_progress"),
    }
    for path, (body, keepalive) in cases.items():
        with HTTP.stream("POST", f"{server}{path}", json=body, timeout=120) as stream:
            lines = [line for line in stream.iter_lines()]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:") and "delta" in line
                          or line.startswith("event: content_block") or line.startswith("event: response.output"))
        assert sum(line.startswith(keepalive) for line in lines[:first_data]) >= 2, (path, lines[:12])
        assert lines[-1] in ("data: [DONE]", "") or json.loads(lines[-1].removeprefix("data: "))  # still ends as usual


def test_requests_sent_at_once_with_one_long_prefix_evaluate_it_once(server):
    """An agent sends several requests at once with one system prompt: the first evaluates it, the others wait for
    its cells and are given them (each reports them as cached), and answer as that one does."""
    system = " ".join(f"Note {i}: the lighthouse keeper logs the weather at dusk." for i in range(12))  # ~170 tokens

    def ask(question: str) -> dict:
        reply = HTTP.post(f"{server}/v1/chat/completions", timeout=120, json={
            "max_tokens": 8, "temperature": 0, "messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": question}]})
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(2) as pool:  # (the module's server has two slots)
        first, second = pool.map(ask, ["What does note 3 say?"] * 2)
    prompt = first["usage"]["prompt_tokens"]
    cached = sorted(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second))
    assert cached == [0, prompt - 1]  # one evaluated it all; the other all but its last token, copied
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])  # a full KV cache, and a sliding-window one
def test_an_agent_s_long_prefix_is_evaluated_once_across_slots_sessions_and_restarts(tmp_path, model, gemma3):
    """Issue 36: the standing part of a long prompt (an agent's system prompt and tools) is kept in the prompt store
    where it ends: a second conversation — in the other slot, or after `serve` restarted — restores it instead of
    evaluating it, and answers as the first did."""
    system = " ".join(f"Rule {i}: keep the file tidy and name things plainly." for i in range(30))  # ~430 tokens
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    flags = ("-m", str(gemma3) if model == "gemma3-270m" else model, "-P", "2", "-c", "2048", "--temp", "0", "--prompt-cache-min", "64")

    def ask(url: str, question: str) -> dict:
        reply = HTTP.post(f"{url}/v1/chat/completions", timeout=120, json={
            "max_tokens": 6, "tools": tools, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": question}]})
        assert reply.status_code == 200, reply.text
        return reply.json()

    proc, url = start_server(tmp_path, *flags)  # (its prompt store: tmp_path/cache)
    try:
        cold = ask(url, "What is rule 3?")
        second = ask(url, "Which rule is about names?")
        both = [ask(url, "What is rule 3?"), ask(url, "Say hi.")]
    finally:
        stop_server(proc)
    prompt = cold["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    standing = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt - 20 < standing < prompt  # the system prompt and tools, up to the question
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= standing for r in both)
    proc, url = start_server(tmp_path, *flags)
    try:
        warm = ask(url, "What is rule 3?")
    finally:
        stop_server(proc)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == standing  # from the prompt store, on disk
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]  # the same greedy answer
    listed = run_cli("cache", "list", env={"LLMCLI_CACHE_DIR": str(tmp_path / "cache")})
    assert model in listed.stdout, listed.stdout + listed.stderr


def test_a_conversation_whose_slot_another_took_goes_on_from_its_kept_cells(tmp_path):
    """Three agents' conversations on two slots: each one's first turn takes a slot from another's, whose cells are
    kept in memory first; each second turn is given its own back — its whole history cached, none evaluated again —
    and answers as on a server of three slots, where nothing was ever taken."""
    topics = ("the sea and its tides", "a mountain village in winter", "the history of the printing press")
    firsts = [" ".join(f"Note {i} about {topic}: write plainly, keep every name and date." for i in range(4))
              for topic in topics]  # (~80 tokens each, sharing only the template's first ones)

    def turns(url: str) -> list[dict]:
        replies: list[dict] = []
        histories = [[{"role": "user", "content": first}] for first in firsts]
        for turn in range(2):
            for history in histories:
                reply = HTTP.post(f"{url}/v1/chat/completions", timeout=120, json={
                    "messages": history, "max_tokens": 4, "temperature": 0}).json()
                replies.append(reply)
                history += [reply["choices"][0]["message"], {"role": "user", "content": f"Go on ({turn})."}]
        return replies

    proc, url = start_server(tmp_path, "-m", "smollm2", "-P", "2", "-c", "256", "--no-prompt-cache")
    try:
        taken = turns(url)
        kept = HTTP.get(f"{url}/health", timeout=10).json().get("kept", {})
    finally:
        stop_server(proc)
    proc, url = start_server(tmp_path, "-m", "smollm2", "-P", "3", "-c", "256", "--no-prompt-cache")
    try:
        never_taken = turns(url)
    finally:
        stop_server(proc)
    for first, second in zip(taken[:3], taken[3:], strict=True):  # each second turn: the whole first prompt cached
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"], taken
    assert [r["choices"][0]["message"] for r in taken] == [r["choices"][0]["message"] for r in never_taken]
    assert kept.get("given_back", 0) >= 2 and 0 < kept["bytes"] <= 1024 * 2**20, kept  # (--cache-ram's default: 1024 MiB)


def test_kept_states_stay_within_their_budget_and_the_longest_match_is_given_back():
    """kept_states.py alone (synthetic states: no model): a state these tokens go on from is given up for them; past
    the budget the least recently kept or used goes first; a state larger than the budget is not kept; the longest
    match of at least the tokens asked is found."""
    from llmcli.decode.kept_states import KeptStates

    def state(n: int) -> memoryview:
        return memoryview(bytearray(n))

    kept = KeptStates(300)
    first = list(range(100))
    assert kept.keep(first[:50], state(100)) and kept.keep(first, state(100))  # (the second holds all the first held)
    assert len(kept) == 1 and kept.held_bytes == 100 and kept.best(first[:50] + [7], 40)[2] == 50
    assert kept.keep([7] * 60, state(100)) and kept.keep([8] * 60, state(100)) and kept.held_bytes == 300
    key, found, shared = kept.best([7] * 45 + [1], 32)
    assert found.tokens == (7,) * 60 and shared == 45 and kept.best([7] * 31, 32) is None
    kept.used(key, whole=False)  # (kept, now the most recently used)
    assert kept.keep([9] * 40, state(100))  # (full: the least recently kept or used goes — `first`)
    assert kept.best(first, 1) is None and kept.best([7] * 60, 60) is not None and kept.held_bytes == 300
    assert kept.keep([6] * 40, state(100)) and kept.best([8] * 60, 1) is None  # (then [8] * 60; [7] * 60 stays)
    assert kept.best([7] * 60, 60) is not None
    key, _, _ = kept.best([6] * 40, 40)
    kept.used(key, whole=True)  # (the slot holds all of it: given up here)
    assert kept.best([6] * 40, 1) is None and kept.held_bytes == 200 and kept.given_back == 2
    assert not kept.keep([5] * 10, state(301)) and kept.held_bytes == 200  # (larger than the whole budget)
