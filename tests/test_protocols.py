"""`llmcli serve` speaks what local clients speak (issue 26): Ollama's API through the official `ollama` client,
Anthropic Messages through the official `anthropic` client, OpenAI Responses, logprobs and completions lists through
the official `openai` client — on the real SmolLM2, greedy (the server's --temp 0: Anthropic's SDK sends no
temperature any more).

Greedy text differs between CPUs: no test expects particular words. Each protocol's answer is compared with `llmcli
run`'s, or with the same request through another protocol, on this machine; calls are forced by tool_choice or
compared across protocols. Every request goes to 127.0.0.1 only; every loop is bounded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import HTTP, closed_after, run_cli, start_server, stop_server
from hypothesis import given
from hypothesis import strategies as st

KEY = "protocol-key"
PROMPT = "Say hi."
LONG_PROMPT = "Write a long story about a dragon who learns to bake bread."
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}
THINKING_TEMPLATE = Path(__file__).parent / "data" / "thinking-chatml.jinja"  # opens <think> for the model
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("protocols"), "-P", "4", "-c", "1024", "--temp", "0",
                             "--api-key", KEY)
    yield url
    stop_server(proc)


def run_json(*args: str) -> dict:
    result = run_cli("run", "--json", "--temp", "0", "--no-prompt-cache", "-c", "1024", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def ollama_client(url: str, key: str | None = KEY):
    import ollama

    headers = {"Authorization": f"Bearer {key}"} if key else None
    return closed_after(ollama.Client(host=url, headers=headers, timeout=120))


def anthropic_client(url: str, key: str = KEY):
    import anthropic

    return closed_after(anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120))


def openai_client(url: str, key: str = KEY):
    from openai import OpenAI

    return closed_after(OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120))


def warm(url: str, **request) -> None:
    """Answer a request once (one token), so that the two requests compared next both find its prompt in a slot's
    cache: a prompt evaluated whole and one whose last token alone is evaluated differ in the last bits, and greedy
    answers can part after a few dozen tokens."""
    openai_client(url).chat.completions.create(model="smollm2", max_tokens=1, **request)


# -- Ollama ----------------------------------------------------------------------------------------------------------


def test_ollama_chat_generate_stream_format_list_show_ps(server):
    import ollama

    client = ollama_client(server)
    (listed,) = client.list().models
    assert listed.model == "smollm2:latest" and listed.details.format == "gguf" and listed.size > 0
    assert listed.details.quantization_level == "Q4_0" and listed.details.family == "llama"
    shown = client.show("smollm2")
    assert {"completion", "tools", "embedding"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == 8192 and "{%" in shown.template
    assert client.ps().models[0].context_length == 1024

    expected = run_json("-n", "16", PROMPT)
    whole = client.chat(model="smollm2", messages=[{"role": "user", "content": PROMPT}], options={"num_predict": 16})
    assert whole.message.content == expected["text"]
    assert whole.done_reason == "length" and whole.eval_count == 16 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0  # nanoseconds, from llmcli's timings
    lines = list(client.chat(model="smollm2:latest", messages=[{"role": "user", "content": PROMPT}],
                             options={"num_predict": 16}, stream=True))
    assert "".join(line.message.content for line in lines) == expected["text"]
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True] and lines[-1].eval_count == 16

    generated = client.generate(model="smollm2", prompt=PROMPT, options={"num_predict": 16})
    assert generated.response == expected["text"]  # not raw: the chat template, as `run` applies it
    raw = client.generate(model="smollm2", prompt="The capital of France is", raw=True, options={"num_predict": 8})
    assert raw.response == run_json("--raw", "-n", "8", "The capital of France is")["text"]
    assert client.generate(model="smollm2", prompt="").done_reason == "load"  # Ollama's way to load a model

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "legs": {"type": "integer"}}, "required": ["name", "legs"]}
    shaped = client.chat(model="smollm2", messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                         format=schema, options={"num_predict": 160, "temperature": 0.8, "seed": 3})  # (> the bound)
    jsonschema.validate(json.loads(shaped.message.content), schema)

    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3", messages=[{"role": "user", "content": PROMPT}])
    assert missing.value.status_code == 404 and missing.value.error.startswith("model 'llama3' not found")
    headers = {"Authorization": f"Bearer {KEY}"}
    image = HTTP.post(f"{server}/api/chat", headers=headers, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "What is this?", "images": ["aGk="]}]})
    assert image.status_code == 400 and set(image.json()) == {"error"} and "images" in image.json()["error"]
    unknown = HTTP.post(f"{server}/api/generate", headers=headers,
                          json={"model": "smollm2", "prompt": "x", "options": {"temperature": "hot"}})
    assert unknown.status_code == 400 and "temperature" in unknown.json()["error"]
    assert HTTP.get(f"{server}/api/tags").status_code == 401  # the key guards Ollama's routes too
    with pytest.raises(ollama.ResponseError, match="--allow-pull") as refused:
        client.pull("hf.co/someone/Smol-GGUF")  # (with it: test_model_pool.py)
    assert refused.value.status_code == 403
    assert HTTP.get(f"{server}/api/version").json()["version"]


def test_ollama_s_curl_examples_answer_and_a_page_s_form_gets_a_415(server):
    """Ollama's documented `curl URL -d '{…}'` sends a form's Content-Type (no -H): read as JSON, as Ollama reads it.
    The same request with a browser's Origin (a page posting a form) is refused, in Ollama's shape."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")

    def curl_d(path: str, body: dict, *headers: str) -> tuple[int, str]:
        sent = [item for header in (f"Authorization: Bearer {KEY}", *headers) for item in ("-H", header)]
        done = subprocess.run([curl, "-sS", "-w", "\n%{http_code}", f"{server}{path}", *sent, "-d", json.dumps(body)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        text, _, status = done.stdout.rpartition("\n")
        return int(status), text

    status, text = curl_d("/api/generate", {"model": "smollm2", "prompt": PROMPT, "stream": False,
                                            "options": {"num_predict": 8}})
    answer = json.loads(text)
    assert status == 200 and answer["done"] is True and answer["eval_count"] == 8 and answer["response"]
    status, text = curl_d("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}],
                                        "options": {"num_predict": 8}})  # streamed: Ollama's default
    lines = [json.loads(line) for line in text.splitlines()]
    assert status == 200 and lines[-1]["done"] is True and lines[-1]["eval_count"] == 8
    assert "".join(line["message"]["content"] for line in lines)

    status, text = curl_d("/api/generate", {"model": "smollm2", "prompt": PROMPT}, "Origin: https://page.example")
    assert status == 415 and set(json.loads(text)) == {"error"} and "application/json" in json.loads(text)["error"]


def test_ollama_tools_answer_as_openai_s_and_embed_equals_llmcli_embed(server):
    client, openai = ollama_client(server), openai_client(server)
    # as the ollama client sends a tool (its model keeps type, description, enum and items of a property, in its order)
    plain_city = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "A city."}}}
    tool = {"type": "function", "function": {**WEATHER, "parameters": plain_city}}
    warm(server, messages=[{"role": "user", "content": QUESTION}], tools=[tool])
    through_ollama = client.chat(model="smollm2", messages=[{"role": "user", "content": QUESTION}], tools=[tool],
                                 options={"num_predict": 60})
    through_openai = openai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                    tools=[tool], max_tokens=60).choices[0].message
    ollama_calls = [(c.function.name, dict(c.function.arguments)) for c in through_ollama.message.tool_calls or []]
    openai_calls = [(c.function.name, json.loads(c.function.arguments)) for c in through_openai.tool_calls or []]
    assert ollama_calls == openai_calls and (through_ollama.message.content or "") == (through_openai.content or "")
    for _, arguments in ollama_calls:
        jsonschema.validate(arguments, plain_city)

    # a call and its result (Ollama names the tool, not the call) read as the model reads OpenAI's
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    openai_messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "Sunny, 21 C"}]
    warm(server, messages=openai_messages, tools=[tool])
    after_ollama = client.chat(model="smollm2", tools=[tool], options={"num_predict": 24}, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}])
    after_openai = openai.chat.completions.create(model="smollm2", tools=[tool], max_tokens=24,
                                                  messages=openai_messages)
    assert after_ollama.message.content == after_openai.choices[0].message.content

    texts = ["The lighthouse keeper climbed the stairs.", "A recipe for bread."]
    local = [json.loads(line)["embedding"] for line in run_cli("embed", input="\n".join(texts) + "\n").stdout.splitlines()]
    normalized = [json.loads(line)["embedding"] for line in
                  run_cli("embed", "--normalize", input="\n".join(texts) + "\n").stdout.splitlines()]
    embedded = client.embed(model="smollm2", input=texts)  # Ollama's /api/embed: unit vectors
    assert embedded.prompt_eval_count > 0
    for remote, mine in zip(embedded.embeddings, normalized, strict=True):
        assert max(abs(a - b) for a, b in zip(remote, mine, strict=True)) < 1e-5
    legacy = client.embeddings(model="smollm2", prompt=texts[0]).embedding  # the older /api/embeddings: as they are
    assert max(abs(a - b) for a, b in zip(legacy, local[0], strict=True)) < 1e-5


# -- Anthropic -------------------------------------------------------------------------------------------------------


def test_anthropic_messages_whole_streamed_count_tokens_and_errors(server):
    import anthropic

    client = anthropic_client(server)  # the key as x-api-key, as Anthropic's clients send it
    expected = run_json("-n", "16", "--system", "Answer briefly.", PROMPT)
    message = client.messages.create(model="smollm2", max_tokens=16, system="Answer briefly.",
                                     messages=[{"role": "user", "content": PROMPT}])
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == expected["text"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 16
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model="smollm2", system="Answer briefly.",
                                           messages=[{"role": "user", "content": PROMPT}])
    assert counted.input_tokens == expected["usage"]["prompt_tokens"]

    with client.messages.stream(model="smollm2", max_tokens=16, system="Answer briefly.",
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected["text"] and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:kinds.index("content_block_start")] == []  # (the SDK does not surface pings)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1

    stopped = client.messages.create(model="smollm2", max_tokens=16, stop_sequences=[expected["text"].split()[1]],
                                     system="Answer briefly.", messages=[{"role": "user", "content": PROMPT}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == expected["text"].split()[1]

    no_limit = HTTP.post(f"{server}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                           json={"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}]})
    assert no_limit.status_code == 400 and no_limit.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4", max_tokens=8, messages=[{"role": "user", "content": PROMPT}])
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic_client(server, "wrong").messages.create(model="smollm2", max_tokens=8,
                                                          messages=[{"role": "user", "content": PROMPT}])
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_anthropic_tool_use_round_trip_streamed_and_not(server):
    client, openai = anthropic_client(server), openai_client(server)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": CITY}
    question = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(model="smollm2", max_tokens=60, messages=question, tools=[tool],
                                     tool_choice={"type": "any"})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, CITY)
    with client.messages.stream(model="smollm2", max_tokens=60, messages=question, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [uses[0].input]  # input_json_delta, joined

    as_openai = [*question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": uses[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 21 C"}]
    openai_tools = [{"type": "function", "function": WEATHER}]
    warm(server, messages=as_openai, tools=openai_tools)
    answer = client.messages.create(model="smollm2", max_tokens=24, tools=[tool], messages=[
        *question, {"role": "assistant", "content": [u.model_dump(include={"type", "id", "name", "input"}) for u in uses]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    same = openai.chat.completions.create(model="smollm2", max_tokens=24, tools=openai_tools, messages=as_openai)
    assert "".join(b.text for b in answer.content if b.type == "text") == same.choices[0].message.content


LA = "la " * 70  # (a call's argument forced by its schema: any CPU writes it, and it loops for the repetition guard)
WRITE = {"name": "write", "description": "Write a text.", "parameters": {
    "type": "object", "properties": {"text": {"const": LA}}, "required": ["text"], "additionalProperties": False}}


def test_a_forced_call_that_repeats_itself_parses_or_is_marked_cut_on_every_route(server):
    """Issue 60: Claude Code's forced `Write` arrived as invalid JSON under an ordinary stop reason (`end_turn`,
    `stop`): the repetition guard cut the call, whose text loops. A call a grammar holds is never cut by a stop llmcli
    adds: it parses on /v1/messages (streamed) and /v1/chat/completions (whole); one the limit cuts is marked so
    in every protocol, whole and streamed (`length`, `max_tokens`, an `incomplete` item; Ollama, which cannot force a call, in the test
    below). The requests of each limit go at once (the server's slots decode them together)."""
    from concurrent.futures import ThreadPoolExecutor

    anthropic, openai = anthropic_client(server), openai_client(server)
    question = [{"role": "user", "content": "Write la 70 times."}]
    tool = {"name": "write", "description": WRITE["description"], "input_schema": WRITE["parameters"]}
    functions = [{"type": "function", "function": WRITE}]

    def messages(max_tokens: int, stream: bool) -> Any:
        asked = dict(model="smollm2", max_tokens=max_tokens, messages=question, tools=[tool],
                     tool_choice={"type": "tool", "name": "write"})
        if not stream:
            return anthropic.messages.create(**asked)
        with anthropic.messages.stream(**asked) as streamed:
            return streamed.get_final_message()

    def chat(max_tokens: int, stream: bool) -> tuple[str | None, str]:
        asked = dict(model="smollm2", max_tokens=max_tokens, messages=question, tools=functions, tool_choice="required")
        if not stream:
            choice = openai.chat.completions.create(**asked).choices[0]
            return choice.finish_reason, choice.message.tool_calls[0].function.arguments
        pieces = list(openai.chat.completions.create(**asked, stream=True))
        return next(c.choices[0].finish_reason for c in pieces if c.choices and c.choices[0].finish_reason), "".join(
            c.choices[0].delta.tool_calls[0].function.arguments or "" for c in pieces
            if c.choices and c.choices[0].delta.tool_calls)

    def responses(max_tokens: int) -> Any:
        return openai.responses.create(model="smollm2", input=question[0]["content"], max_output_tokens=max_tokens,
                                       tools=[{"type": "function", **WRITE}], tool_choice="required")

    with ThreadPoolExecutor(5) as pool:  # (the long calls once a route, streamed on one and whole on the other)
        whole = [pool.submit(messages, 300, True), pool.submit(chat, 300, False)]
        cut = [pool.submit(messages, 30, False), pool.submit(messages, 30, True), pool.submit(chat, 30, False),
               pool.submit(chat, 30, True), pool.submit(responses, 30)]
        whole_found, cut_found = [f.result() for f in whole], [f.result() for f in cut]
    answer = whole_found[0]
    assert answer.stop_reason == "tool_use" and answer.content[-1].input == {"text": LA}, answer.model_dump_json()
    finish, arguments = whole_found[1]
    assert finish == "tool_calls" and json.loads(arguments) == {"text": LA}
    assert [answer.stop_reason for answer in cut_found[:2]] == ["max_tokens", "max_tokens"]
    for finish, arguments in cut_found[2:4]:
        assert finish == "length" and not arguments.endswith("}")  # (what was written, and the limit said as the end)
    assert cut_found[4].status == "incomplete" and cut_found[4].output[-1].status == "incomplete"


def test_ollama_lists_no_call_the_limit_cut_whole_or_streamed():
    """Ollama's clients run every call in `message.tool_calls`: one the limit cut (its arguments no object) is left
    out, whole and streamed, and `done_reason: "length"` says the answer was cut; a whole call is listed."""
    from llmcli.answer.events import Done
    from llmcli.answer.stats import Stats
    from llmcli.answer.tool_calls import ToolCall
    from llmcli.serve.answer_request import AnswerRequest
    from llmcli.serve.ollama_api import OllamaReply

    stats = Stats(0.0, 0.0, 10, 4, 6, 0.1, 0.2, 30, 30, 0.3, 0.5)
    whole = ToolCall("call_1", "write", json.dumps({"text": LA}))
    cut = ToolCall("call_2", "write", '{"text": "la la', "the call was cut off before it ended")
    reply = OllamaReply(True, "smollm2", [AnswerRequest()])
    for calls, finish, listed in (((whole,), "tool_calls", [{"text": LA}]), ((cut,), "length", []),
                                  ((whole, cut), "length", [{"text": LA}])):
        done = Done(finish, stats, tool_calls=calls)
        found = reply.whole([done])
        streamed = [line for _, line in reply.on_event(0, done)]
        assert [c["function"]["arguments"] for c in found["message"].get("tool_calls", [])] == listed
        assert [c["function"]["arguments"] for line in streamed for c in line["message"].get("tool_calls", [])] == listed
        assert found["done_reason"] == streamed[-1]["done_reason"] == ("stop" if finish == "tool_calls" else "length")


# -- OpenAI: Responses, logprobs, completions lists --------------------------------------------------------------------


def test_openai_responses_whole_streamed_continued_and_with_tools(server):
    import openai as openai_module

    client = openai_client(server)
    expected = run_json("-n", "16", PROMPT)
    response = client.responses.create(model="smollm2", input=PROMPT, max_output_tokens=16)
    assert response.output_text == expected["text"] and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 16
    events = list(client.responses.create(model="smollm2", input=PROMPT, max_output_tokens=16, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected["text"]
    assert [e.sequence_number for e in events] == list(range(len(events)))

    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": response.output_text},
               {"role": "user", "content": "Say it again."}]
    warm(server, messages=history)
    follow = client.responses.create(model="smollm2", input="Say it again.", previous_response_id=response.id,
                                     max_output_tokens=12)
    continued = client.chat.completions.create(model="smollm2", max_tokens=12, messages=history)
    assert follow.output_text == continued.choices[0].message.content
    with pytest.raises(openai_module.BadRequestError, match="is not kept here"):
        client.responses.create(model="smollm2", input="x", previous_response_id="resp_unknown")

    tool = {"type": "function", **WEATHER}
    called = client.responses.create(model="smollm2", input=QUESTION, tools=[tool], tool_choice="required",
                                     max_output_tokens=60)
    (call,) = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    streamed = list(client.responses.create(model="smollm2", input=QUESTION, tools=[tool], tool_choice="required",
                                            max_output_tokens=60, stream=True))
    pieces = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert pieces == call.arguments and streamed[-1].response.output[-1].arguments == call.arguments
    # A call max_output_tokens cut is not one to run (issue 57: it was an item `completed` in an `incomplete` response)
    cut = client.responses.create(model="smollm2", input=QUESTION, tools=[tool], tool_choice="required",
                                  max_output_tokens=14)
    assert cut.status == "incomplete" and not [i for i in cut.output if i.type == "function_call" and i.status == "completed"]
    cut_streamed = list(client.responses.create(model="smollm2", input=QUESTION, tools=[tool], tool_choice="required",
                                                max_output_tokens=14, stream=True))
    done_items = [e.item for e in cut_streamed if e.type == "response.output_item.done"]
    assert cut_streamed[-1].type == "response.incomplete" and done_items[-1].type == "function_call"
    assert done_items[-1].status == "incomplete"
    assert cut_streamed[-1].response.output[-1].status == "incomplete"
    answered = client.responses.create(model="smollm2", tools=[tool], max_output_tokens=24, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert answered.status in ("completed", "incomplete") and answered.output_text
    # Codex's tools: a namespace's tools are offered as NAMESPACE__NAME and called back in their namespace; a hosted
    # tool (web_search, run by OpenAI's servers) is left out of the prompt; a custom tool (free-form) is refused.
    namespaced = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=60, tool_choice="required",
                                         tools=[{"type": "web_search"}, {"type": "namespace", "name": "crm",
                                                                        "description": "The CRM.", "tools": [tool]}])
    (called,) = [item for item in namespaced.output if item.type == "function_call"]
    assert (called.namespace, called.name) == ("crm", tool["name"])
    back = client.responses.create(model="smollm2", max_output_tokens=8, tools=[{"type": "namespace", "name": "crm",
                                                                                 "description": "The CRM.", "tools": [tool]}],
                                   input=[{"role": "user", "content": QUESTION},
                                          {"type": "function_call", "call_id": called.call_id, "name": called.name,
                                           "namespace": "crm", "arguments": called.arguments},
                                          {"type": "function_call_output", "call_id": called.call_id, "output": "Sunny"}])
    assert back.status in ("completed", "incomplete")
    with pytest.raises(openai_module.BadRequestError, match="only function and namespace tools"):
        client.responses.create(model="smollm2", input="x", tools=[{"type": "custom", "name": "apply_patch"}])


def test_logprobs_equal_run_s_and_completions_take_lists_and_token_ids(server):
    client = openai_client(server)
    local = run_json("-n", "6", "--logprobs", "3", PROMPT)
    whole = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=6, logprobs=True, top_logprobs=3)
    served = whole.choices[0].logprobs.content
    assert [t.token for t in served] == [t["token"] for t in local["logprobs"]]
    assert "".join(t.token for t in served) == whole.choices[0].message.content == local["text"]
    for remote, mine in zip(served, local["logprobs"], strict=True):
        assert abs(remote.logprob - mine["logprob"]) < 1e-3 and remote.bytes == mine["bytes"]
        assert [t.token for t in remote.top_logprobs] == [t["token"] for t in mine["top_logprobs"]]
        assert remote.logprob <= 0 and remote.top_logprobs[0].logprob >= remote.top_logprobs[-1].logprob
    chunks = list(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=6, logprobs=True, top_logprobs=3, stream=True))
    assert [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        [t.token for t in served]

    ids = json.loads(run_cli("tokenize", "--json", "The capital of France is").stdout)["ids"]
    listed = client.completions.create(model="smollm2", prompt=["The capital of France is", ids], max_tokens=8,
                                       logprobs=2)
    assert [c.index for c in listed.choices] == [0, 1] and listed.choices[0].text == listed.choices[1].text
    assert listed.choices[0].text == run_json("--raw", "-n", "8", "The capital of France is")["text"]
    assert len(listed.choices[0].logprobs.tokens) == 8 and listed.usage.completion_tokens == 16
    import openai as openai_module

    with pytest.raises(openai_module.BadRequestError, match="token ids"):
        client.completions.create(model="smollm2", prompt=[10**9], max_tokens=2)


# -- every protocol at once ------------------------------------------------------------------------------------------


def test_an_ollama_an_anthropic_and_an_openai_answer_share_the_slots(server):
    """Three clients at once: the server's own count of steps that advanced three answers together grows, and the
    three answers, each in its own slot, are the same (a neighbour never changes an answer)."""
    ollama, anthropic, openai = ollama_client(server), anthropic_client(server), openai_client(server)
    messages = [{"role": "user", "content": LONG_PROMPT}]

    def through_ollama() -> str:
        return "".join(c.message.content for c in ollama.chat(model="smollm2", messages=messages, stream=True,
                                                              options={"num_predict": 64}))

    def through_anthropic() -> str:
        with anthropic.messages.stream(model="smollm2", max_tokens=64, messages=messages) as stream:
            return stream.get_final_text()

    def through_openai() -> str:
        stream = openai.chat.completions.create(model="smollm2", messages=messages, max_tokens=64, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    before = HTTP.get(f"{server}/health").json()["steps_by_busy"].get("3", 0)
    results: dict[str, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def one(name: str, ask) -> None:
        try:
            start.wait(timeout=30)
            results[name] = ask()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=item) for item in
               (("ollama", through_ollama), ("anthropic", through_anthropic), ("openai", through_openai))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    after = HTTP.get(f"{server}/health").json()["steps_by_busy"].get("3", 0)
    assert after > before  # steps in which all three answers advanced together
    assert results["ollama"] == results["anthropic"] == results["openai"] != ""


def test_thinking_comes_apart_in_every_protocol(tmp_path):
    """A template that opens the think block (as Qwen3's does): what the model writes before `</think>` is each
    protocol's thinking — Ollama's `thinking`, Anthropic's thinking block (and thinking_delta), a Responses reasoning
    item, OpenAI's reasoning_content — the same text in each, and `run --json`'s `reasoning`."""
    proc, url = start_server(tmp_path, "-c", "512", "--temp", "0", "--chat-template-file", str(THINKING_TEMPLATE))
    try:
        messages = [{"role": "user", "content": PROMPT}]
        local = run_json("-n", "24", "--chat-template-file", str(THINKING_TEMPLATE), PROMPT)
        assert local["reasoning"]  # (24 tokens: the block is still open, all of it is thinking)
        through_ollama = ollama_client(url, None).chat(model="smollm2", messages=messages, options={"num_predict": 24})
        client = anthropic_client(url)
        message = client.messages.create(model="smollm2", max_tokens=24, messages=messages)
        with client.messages.stream(model="smollm2", max_tokens=24, messages=messages) as stream:
            deltas = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                             and e.delta.type == "thinking_delta")
        openai = openai_client(url, "none")
        response = openai.responses.create(model="smollm2", input=PROMPT, max_output_tokens=24)
        chat = openai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24).choices[0].message
        thinking = [b.thinking for b in message.content if b.type == "thinking"]
        reasoning = [c.text for item in response.output if item.type == "reasoning" for c in item.content]
        assert through_ollama.message.thinking.strip() == local["reasoning"] == thinking[0] == reasoning[0].strip()
        assert deltas.strip() == local["reasoning"] and chat.model_extra["reasoning_content"] == local["reasoning"]
    finally:
        stop_server(proc)


BAD_BODIES = [[], "text", 7, {}, {"model": 7}, b"{not json", b""]  # bad for every route
ODD_BODIES = [{"model": "smollm2", "messages": "hi"}, {"model": "smollm2", "messages": [7]},  # bad for most
              {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]},
              {"model": "smollm2", "messages": [{"role": "user", "content": {"x": 1}}]},
              {"model": "smollm2", "prompt": 7, "input": 7, "messages": [{"role": "user", "content": "x"}],
               "max_tokens": -3, "options": [], "tools": "x"}]
SHAPES = {"/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/responses": "openai",
          "/v1/embeddings": "openai", "/v1/messages": "anthropic", "/v1/messages/count_tokens": "anthropic",
          "/api/chat": "ollama", "/api/generate": "ollama", "/api/embed": "ollama", "/api/embeddings": "ollama",
          "/api/show": "ollama", "/api/pull": "ollama"}


def assert_shape(shape: str, error: dict, where: object) -> None:
    if shape == "openai":
        assert set(error) == {"error"} and isinstance(error["error"]["message"], str), (where, error)
    elif shape == "anthropic":
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, (where, error)
    else:
        assert set(error) == {"error"} and isinstance(error["error"], str), (where, error)


def test_bad_bodies_get_a_4xx_in_each_protocol_s_shape_never_a_500(server):
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for path, shape in SHAPES.items():
        for body in [*BAD_BODIES, *ODD_BODIES]:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = HTTP.post(f"{server}{path}", headers=headers, content=content, timeout=60)
            assert reply.status_code < 500, (path, body, reply.text)
            if body in BAD_BODIES:
                assert 400 <= reply.status_code < 500, (path, body, reply.status_code, reply.text)
            if reply.status_code >= 400:
                assert_shape(shape, reply.json(), (path, body))
    for path, shape in (("/api/nothing", "ollama"), ("/v1/messages/nothing", "anthropic"), ("/v1/nothing", "openai")):
        missing = HTTP.get(f"{server}{path}", headers=headers)
        assert missing.status_code == 404
        assert_shape(shape, missing.json(), path)


def test_every_finish_reason_has_each_protocol_s_word_in_one_table():
    """One FinishReason table (issue 35) instead of five: each of llmcli's reasons maps into each protocol's own
    vocabulary, and the `--endpoint` client reads an OpenAI server's word back."""
    from llmcli.answer.finish import REASONS, described, finish_reason, from_openai

    assert set(REASONS) == {"stop", "stop_sequence", "length", "context_full", "repetition", "interrupted", "tool_calls"}
    for reason in REASONS.values():
        assert reason.openai in {"stop", "length", "tool_calls", "abort"}
        assert reason.ollama in {"stop", "length", "abort"}
        assert reason.anthropic in {"end_turn", "stop_sequence", "max_tokens", "tool_use", "pause_turn"}
        assert reason.responses in {None, "max_output_tokens", "interrupted"}
        assert from_openai(reason.openai) in REASONS
    assert [from_openai(finish_reason(name).openai) for name in ("stop", "length", "tool_calls")] == \
        ["stop", "length", "tool_calls"]
    assert described("stop_sequence", "\n\n") == "stop sequence '\\n\\n'" and finish_reason("unknown").name == "stop"


# -- the OpenAI wire, both ways: what serve writes is what the --endpoint client reads --------------------------------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def _answers(draw: st.DrawFn) -> list:
    """An answer's events as the engine yields them: reasoning pieces, text pieces, calls in pieces, then a Done."""
    from llmcli.answer.events import Done, Token
    from llmcli.answer.stats import Stats
    from llmcli.answer.tool_call_parser import CallArguments, CallStarted
    from llmcli.answer.tool_calls import ToolCall

    events: list = [Token(t, reasoning=True) for t in draw(st.lists(_TEXT, max_size=3))]
    events += [Token(t) for t in draw(st.lists(_TEXT, max_size=5))]
    calls = []
    for index in range(draw(st.integers(0, 2))):
        name, pieces = draw(st.sampled_from(["multiply", "weather"])), draw(st.lists(_TEXT, min_size=1, max_size=3))
        events += [CallStarted(index, f"call_{index}", name), *(CallArguments(index, p) for p in pieces)]
        calls.append(ToolCall(f"call_{index}", name, "".join(pieces)))
    reason = "tool_calls" if calls else draw(st.sampled_from(["stop", "length", "stop_sequence", "repetition",
                                                              "context_full", "interrupted"]))
    stats = Stats(0.0, 0.0, 10, 4, 6, 0.1, 0.2, len(events), len(events), 0.3, 0.5)
    text = "".join(e.text for e in events if isinstance(e, Token) and not e.reasoning)
    events.append(Done(reason, stats, "\n\n" if reason == "stop_sequence" else None, text=text, tool_calls=tuple(calls)))
    return events


@given(events=_answers())
def test_the_openai_wire_round_trips_from_serve_to_the_endpoint_client(events):
    """Events → serve's OpenAI chunks (llmcli/serve/openai_api.py over llmcli/answer/openai_wire.py) → the --endpoint
    client's events (openai_wire's ChunkReader): the same text, reasoning, calls and finish reason, with no HTTP and no
    model."""
    from llmcli.answer.events import Done, Token
    from llmcli.answer.openai_wire import ChunkReader
    from llmcli.answer.tool_call_parser import CallArguments, CallStarted
    from llmcli.serve.answer_request import AnswerRequest
    from llmcli.serve.openai_api import Reply

    reply = Reply.new(True, "smollm2", [AnswerRequest(stream=True)])
    client = ChunkReader((), time.perf_counter())
    read: list = []
    for event in events:
        for _, chunk in reply.on_event(0, event):
            read += list(client.events(json.loads(json.dumps(chunk)), chat=True))
    _, done = client.done(interrupted=False)
    sent = events[-1]
    assert isinstance(sent, Done)
    assert done.text == sent.text and (done.reasoning or "") == "".join(
        e.text for e in events if isinstance(e, Token) and e.reasoning).strip()
    assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [(c.id, c.name, c.arguments) for c in sent.tool_calls]
    assert done.finish_reason == sent.finish_reason  # llmcli serve says its own reason in `timings`
    assert [e for e in read if isinstance(e, (CallStarted, CallArguments))] == \
        [e for e in events if isinstance(e, (CallStarted, CallArguments))]
