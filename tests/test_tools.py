"""Tool calling (issue 24): the parser of every format on recorded outputs and on any split of the stream; `llmcli
serve` with the official `openai` client (SmolLM2's own template — the generic format — and a Hermes-style template);
`run` and `chat` with `--functions`, locally and over `--endpoint`.

Sampled text differs between CPUs: no test expects particular words. The grammar makes every call parse on any CPU;
what is asserted is that calls parse, validate, carry ids, never leak into text, and that results reach the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from conftest import closed_after, interrupt_at_a_prompt, run_cli, spawn_terminal, start_server, stop_server
from hypothesis import given, settings
from hypothesis import strategies as st

from llmcli.answer.tool_call_parser import CallArguments, CallStarted, ToolCallParser, parse_calls
from llmcli.answer.tool_calls import tool_spec

MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
TOOLS = [MULTIPLY, WEATHER]
HERMES_TEMPLATE = Path(__file__).parent / "data" / "hermes-chatml.jinja"
QUESTION = "What is 12 times 7, and what is the weather in Paris?"
SAMPLED_CALLS = 4  # per format (issue 24 measured 50: 50/50 valid with the grammar, 0/50 without)

# -- the parser: recorded outputs, per format ----------------------------------------------------------------------

GOLDEN = {
    "hermes": [
        ('Let me check. <tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n</tool_call>',
         "Let me check. ", [("multiply", '{"a": 12, "b": 7}', None)]),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
         '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "", [("multiply", '{"a": 1, "b": 2}', None), ("weather", '{"city": "Paris"}', None)]),
        ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "weather"}</tool_call>',  # key order a grammar would fix
         "", [("weather", '{"city": "Oslo"}', None)]),
        ('<tool_call>{"name": "multiply", "arguments": {"a": "x", "b": 2}}</tool_call>',
         "", [("multiply", '{"a": "x", "b": 2}', "do not match its schema at a")]),
        ('<tool_call>{"name": "divide", "arguments": {}}</tool_call>', "", [("divide", "{}", "no tool is called")]),
        ('<tool_call>{"name": "weather", "arguments": {"city": "Par', "", [("weather", '{"city": "Par', "cut off")]),
        ("A plain answer with a < sign and <b>tags</b>.", "A plain answer with a < sign and <b>tags</b>.", []),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "multiply", '
         '"arguments": {"b": 2, "a": 1}}</tool_call><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
         "</tool_call>", "", [("multiply", '{"a": 1, "b": 2}', None)]),  # a repeated call: it and what follows go
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_call>{"name": "multiply", '
         '"arguments": {"a": 1, "b', "", [("multiply", '{"a": 1, "b": 2}', None)]),  # a copy cut off goes too
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "weather", '
         '"arguments": {"city": "Pa', "", [("multiply", '{"a": 1, "b": 2}', None), ("weather", '{"city": "Pa', "cut off")]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 12, "b": 7}}, {"name": "weather", "arguments": '
         '{"city": "Rome"}}]', "", [("multiply", '{"a": 12, "b": 7}', None), ("weather", '{"city": "Rome"}', None)]),
        ("No call [here].", "No call [here].", []),
    ],
    "llama3": [
        ('{"name": "multiply", "parameters": {"a": 3, "b": 4}}', "", [("multiply", '{"a": 3, "b": 4}', None)]),
        ('{"name": "multiply", "parameters": {"a": 3, "b": 4}}; {"name": "weather", "parameters": {"city": "Lima"}}',
         "", [("multiply", '{"a": 3, "b": 4}', None), ("weather", '{"city": "Lima"}', None)]),
        ("Twelve times seven is 84.", "Twelve times seven is 84.", []),
    ],
}
GOLDEN["generic"] = GOLDEN["hermes"][:3]
# Recorded: SmolLM2-135M's raw output under the grammar (required, temperature 1.0), its own template (generic) and
# the Hermes-style one. Fixed strings: they parse the same on any CPU.
GOLDEN["generic"] += [
    ('<tool_call>{"name": "multiply", "arguments": { "a": 12, "b": 7 }}  </tool_call>', "",
     [("multiply", '{ "a": 12, "b": 7 }', None)]),
    ('<tool_call> {"name": "weather", "arguments": { "city": "Paris" }}  </tool_call>', "",
     [("weather", '{ "city": "Paris" }', None)]),
]
GOLDEN["hermes"] += [
    ('<tool_call> { "name": "weather", "arguments": { "city": ": "} }  </tool_call> <tool_call> { "name": "multiply", '
     '"arguments": { "a": 2, "b": 7 } }  </tool_call> <tool_call> { "name": "weather", "arguments": { "city": "Paris" } }'
     "  </tool_call>", "", [("weather", '{ "city": ": "}', None), ("multiply", '{ "a": 2, "b": 7 }', None),
                            ("weather", '{ "city": "Paris" }', None)]),
]


def _calls(calls) -> list[tuple[str, str, str | None]]:
    return [(c.name, c.arguments, c.error) for c in calls]


@pytest.mark.parametrize("format_name", sorted(GOLDEN))
def test_each_format_parses_recorded_outputs(format_name):
    spec = tool_spec(TOOLS, "auto", format_name)
    for output, text, expected in GOLDEN[format_name]:
        shown, calls = parse_calls(output, spec)
        assert shown == text, output
        got = _calls(calls)
        assert [(n, a) for n, a, _ in got] == [(n, a) for n, a, _ in expected], output
        for (_, _, error), (_, _, want) in zip(got, expected, strict=True):
            assert (error is None) if want is None else (error is not None and want in error), (output, error)
        assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n</tool_call>'


@pytest.mark.parametrize("after, finish, calls", [
    ("", "tool_calls", 1),  # -n reached as the call closed
    (" \n<tool_c", "tool_calls", 1),  # an opening that nothing followed
    (' <tool_call>\n{"name": "multiply", "arguments": {"a": 1', "tool_calls", 1),  # a copy of the call, cut off
    (' <tool_call>\n{"name": "multiply", "arguments": {"a": 13', "length", 2),  # another call, cut off: not run
    (' <tool_call>\n{"name": "weather", "arg', "length", 2),
])
def test_a_limit_that_cuts_only_what_follows_the_calls_leaves_the_calls_standing(after, finish, calls):
    """A small model repeats its call until -n cuts the copy: the whole calls before it are the answer ("tool_calls",
    and they run), as when it repeats a whole call; a new call that the limit cut makes the answer "length"."""
    from llmcli.answer.generation import Answer, GenerationOptions
    from llmcli.answer.stats import Stats

    text = CALL + after
    pieces = [text[i : i + 3].encode() for i in range(0, len(text), 3)]  # a token every 3 characters
    answer = Answer(GenerationOptions(max_tokens=len(pieces), tools=tool_spec(TOOLS, "required", "hermes")), 10, 1000)
    for token, piece in enumerate(pieces):
        answer.add(token, False, piece)
    assert answer.finish == "length"
    answer.close()
    done = answer.done("length", Stats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    assert (done.finish_reason, len(done.tool_calls)) == (finish, calls)
    assert (done.tool_calls[0].name, done.tool_calls[0].error) == ("multiply", None)
    assert all(call.error for call in done.tool_calls[1:])


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True) if b > a]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from([(f, o) for f, cases in GOLDEN.items() for o, _, _ in cases]),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_split_of_the_stream_parses_to_the_same_calls(case, cuts):
    format_name, output = case
    spec = tool_spec(TOOLS, "auto", format_name)
    whole_text, whole_calls = parse_calls(output, spec)
    parser = ToolCallParser(spec)
    shown, events = [], []
    for piece in _split(output, cuts):
        text, more = parser.feed(piece)
        shown.append(text)
        events += more
    text, more = parser.finish()
    shown.append(text)
    events += more
    assert "".join(shown) == whole_text
    assert _calls(parser.calls) == _calls(whole_calls)
    # the events: each call's name first, then its arguments in pieces that join into them
    for index, call in enumerate(parser.calls):
        starts = [e for e in events if isinstance(e, CallStarted) and e.index == index]
        pieces = "".join(e.text for e in events if isinstance(e, CallArguments) and e.index == index)
        assert [s.name for s in starts] == [call.name] and starts[0].id == call.id and pieces == call.arguments


# -- llmcli serve and the openai client ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["generic", "hermes"])
def served(request, tmp_path_factory) -> Iterator[tuple[str, str]]:
    extra = ("--chat-template-file", str(HERMES_TEMPLATE)) if request.param == "hermes" else ()
    proc, url = start_server(tmp_path_factory.mktemp("serve"), "-P", "4", "-c", "1024", *extra)
    yield request.param, url
    stop_server(proc)


def _client(url: str):
    import openai

    return closed_after(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))


def _valid(call) -> bool:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return True


def test_sampled_required_calls_all_parse_and_validate(served):
    _, url = served
    client = _client(url)

    # max_tokens above what the grammar lets one call take (a city of 40 characters, each at most a 6-character
    # escape, integers of 16 digits, an optional space between JSON tokens: ~320 tokens, one token a character), so
    # that every answer ends in its call: at 120, one sample in some hundreds was cut off (slots' batches differ run
    # to run, and so do sampled answers); they take 36-70.
    def ask(seed: int):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=400).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, range(SAMPLED_CALLS)))
    calls = [c.message.tool_calls for c in choices]
    assert all(c.finish_reason == "tool_calls" for c in choices), [(c.finish_reason, c.message) for c in choices if c.finish_reason != "tool_calls"]
    assert all(len(found) == 1 and _valid(found[0]) for found in calls)
    ids = [found[0].id for found in calls]
    assert all(ids) and len(set(ids)) == SAMPLED_CALLS


def test_a_named_choice_calls_that_tool_and_auto_never_leaks_markup(served):
    _, url = served
    client = _client(url)
    named = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "weather" and _valid(call)
    for seed in range(2):
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], tools=TOOLS, tool_choice="auto",
            temperature=1.0, seed=seed, max_tokens=40, stream=True)
        content = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "<tool_call" not in content and "tool_call>" not in content and '"arguments"' not in content


def test_streamed_calls_reassemble_to_the_whole_answer_and_never_repeat_a_call(served):
    _, url = served
    client = _client(url)
    # SmolLM2's end of generation (<|im_end|>, token 2) banned: the grammar lets the answer end only after a call, so
    # parallel calls (parallel_tool_calls, the default) follow one another until max_tokens cuts the last one, or the
    # model repeats a call it made (a small model's habit): the answer ends there, without it (issue 40).
    request = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
               "tool_choice": "required", "temperature": 1.0, "max_tokens": 80, "logit_bias": {"2": -100}}
    # Both answers of a seed start from the same slot state: the prompt already cached. (A prompt evaluated whole and
    # one resumed from a cached prefix differ in the last bits of their logits, and a sampled answer can follow them.)
    client.chat.completions.create(**{**request, "max_tokens": 1}, seed=0)
    for seed in range(2):
        whole = client.chat.completions.create(**request, seed=seed).choices[0]
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**request, seed=seed, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == whole.finish_reason
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert all(c["id"].startswith("call_") for c in calls.values())
        made = []
        for call in whole.message.tool_calls or ():
            try:
                made.append((call.function.name, json.loads(call.function.arguments)))
            except ValueError:
                pass  # (the last call, cut by max_tokens)
        assert calls and all(made.count(call) == 1 for call in made)  # later calls come out whole, none twice


def test_bad_tools_are_400s_naming_what_is_wrong(served):
    import openai

    _, url = served
    client = _client(url)
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError, match="parameters of f"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], tools=[bad_schema])
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'nothing'"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nothing"}})
    unexpressible = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    with pytest.raises(openai.BadRequestError, match="cannot be turned into a grammar"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                       tools=[unexpressible], tool_choice="required")


def test_a_tool_schema_with_local_refs_is_enforced(served):
    _, url = served
    parameters = {"type": "object", "properties": {"size": {"$ref": "#/$defs/size"}}, "required": ["size"],
                  "$defs": {"size": {"type": "string", "enum": ["small", "large"]}}}
    tool = {"type": "function", "function": {"name": "order", "description": "Order a coffee.", "parameters": parameters}}
    reply = _client(url).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A large coffee, please."}], tools=[tool],
        tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=0, max_tokens=100)
    # (one call: a second is the model's choice, and could be cut off; 100 tokens: more than the grammar lets this
    # call take, ~80 at one token a character)
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_a_tool_result_goes_back_and_the_conversation_goes_on(served):
    _, url = served
    client = _client(url)
    first = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is 12 times 7?"}],
                                           tools=[MULTIPLY], tool_choice="required", temperature=0, max_tokens=60)
    (call,) = first.choices[0].message.tool_calls
    follow = client.chat.completions.create(model="smollm2", tools=[MULTIPLY], temperature=0, max_tokens=20, messages=[
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "84"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


# -- run and chat with --functions --------------------------------------------------------------------------------

FUNCTIONS = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def fail(code: int) -> str:
    """Always fails."""
    raise RuntimeError(f"failure {code}")
'''


@pytest.fixture
def functions(tmp_path) -> str:
    path = tmp_path / "tools.py"
    path.write_text(FUNCTIONS)
    return str(path)


def test_run_calls_a_function_and_feeds_its_result_back(functions):
    result = run_cli("run", "--functions", functions, "--tool-choice", "required", "--tools-debug", "--temp", "0",
                     "-n", "100", "--json", "What is 12 times 7?")
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    first = record["tool_calls"][0]
    assert first["name"] == "multiply" and first["error"] is None
    arguments = json.loads(first["arguments"])
    assert first["result"] == str(arguments["a"] * arguments["b"]) and first["result_is_error"] is False
    assert f"tool call multiply({first['arguments']})" in result.stderr
    prompt = result.stderr.split("next prompt ends: …", 1)[1]
    assert f"<tool_response>\n{first['result']}\n</tool_response>" in prompt  # the result is in the next prompt
    assert "<tool_call>" not in record["text"]
    call_only = json.loads(run_cli("run", "--functions", functions, "--tool-choice", "required", "--chain-limit", "0",
                                   "--temp", "0", "-n", "100", "--json", "What is 12 times 7?").stdout)
    assert record["usage"]["completion_tokens"] > call_only["usage"]["completion_tokens"]  # the rounds add up
    assert record["usage"]["completion_tokens"] <= 100  # -n bounds the whole answer, every round of it
    limit = call_only["usage"]["completion_tokens"] + 3  # the call, then 3 tokens for the answer after it
    bounded = json.loads(run_cli("run", "--functions", functions, "--tool-choice", "required", "--temp", "0", "-n",
                                 str(limit), "--json", "What is 12 times 7?").stdout)
    assert bounded["usage"]["completion_tokens"] <= limit and bounded["finish_reason"] in ("length", "stop")
    assert bounded["tool_calls"][0]["result"] == first["result"]  # (the call ran; its round left the rest 3 tokens)


def test_run_continue_after_a_tool_call_keeps_the_call_and_its_result(functions):
    """One conversation record (issue 35): the log keeps what an exchange added — the call and its result — and
    `run -C` continues the conversation as it was, not as a plain question and answer."""
    first = run_cli("run", "--functions", functions, "--tool-choice", "multiply", "--temp", "0", "-n", "40", "--json",
                    "What is 12 times 7?")
    assert first.code == 0, first.stderr
    (call,) = json.loads(first.stdout)["tool_calls"]
    (logged,) = json.loads(run_cli("logs", "--json").stdout)
    assert [m["role"] for m in logged["messages"]][:3] == ["user", "assistant", "tool"]
    assert logged["messages"][1]["tool_calls"][0]["name"] == "multiply"
    shown = run_cli("run", "-C", "--show-prompt", "And 3 times that?")
    assert shown.code == 0, shown.stderr
    assert '"name": "multiply"' in shown.stdout and f"<tool_response>\n{call['result']}\n</tool_response>" in shown.stdout


def test_a_tool_call_cut_off_by_its_limit_is_never_run(functions):
    """A call the answer's limit cut off is said to be cut off (a notice) and never runs; exit 8, as an answer that
    is not the JSON asked for (issue 36)."""
    result = run_cli("run", "--functions", functions, "--tool-choice", "multiply", "--tools-debug", "--temp", "0",
                     "-n", "12", "--json", "What is 12 times 7?")
    assert result.code == 8, result.stderr
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "length" and record["tool_calls"][0]["error"]
    assert record["tool_calls"][0].get("result") is None
    assert "the tool call was cut off before it ended" in result.stderr and "tool result" not in result.stderr


def test_a_failing_tool_the_chain_limit_and_approval_without_a_terminal(functions):
    failed = run_cli("run", "--functions", functions, "--tool-choice", "fail", "--tools-debug", "--temp", "0", "-n", "40",
                     "--chain-limit", "1", "--json", "Try it.")
    assert failed.code == 0, failed.stderr
    call = json.loads(failed.stdout)["tool_calls"][0]
    assert call["name"] == "fail" and call["result_is_error"] and call["result"].startswith("Error: RuntimeError: failure")
    assert "Traceback" not in failed.stderr and "tool result fail: Error: RuntimeError" in failed.stderr
    limited = run_cli("run", "--functions", functions, "--tool-choice", "required", "--chain-limit", "0", "--temp", "0",
                      "-n", "100", "--json", "What is 12 times 7?")
    record = json.loads(limited.stdout)
    assert record["finish_reason"] == "tool_calls" and "result" not in record["tool_calls"][0]
    assert "--chain-limit 0 reached" in limited.stderr
    shown = run_cli("run", "--functions", functions, "--show-prompt", "What is 12 times 7?")  # as the model sees it
    assert shown.code == 0 and '"name": "multiply", "description": "Multiply two integers."' in shown.stdout
    refused = run_cli("run", "--functions", functions, "--tools-approve", "hi")
    assert refused.code == 2 and "--tools-approve asks before each call on a terminal" in refused.stderr
    broken = run_cli("run", "--functions", "def f(:\n  pass", "hi")
    assert broken.code == 2 and broken.stderr.startswith("Error: --functions")


def test_run_over_an_endpoint_runs_the_same_loop(functions, tmp_path):
    proc, url = start_server(tmp_path, "-c", "1024")
    try:
        args = ("--functions", functions, "--tool-choice", "required", "--temp", "0", "-n", "40", "--json",
                "What is 12 times 7?")
        remote = json.loads(run_cli("run", "--endpoint", f"{url}/v1", *args).stdout)
    finally:
        stop_server(proc)
    local = json.loads(run_cli("run", "--no-prompt-cache", *args).stdout)
    strip = [{k: v for k, v in c.items() if k != "id"} for c in local["tool_calls"]]
    assert [{k: v for k, v in c.items() if k != "id"} for c in remote["tool_calls"]] == strip
    assert remote["text"] == local["text"]


def test_chat_keeps_calls_in_its_history_and_resumes_them(functions):
    """One conversation record (issue 35): what `chat --resume` and `run -C` read is the same — the calls and their
    results, the system prompt and the /set changes of the chat."""
    first = run_cli("chat", "--functions", functions, "--tool-choice", "required", "--temp", "0", "-n", "40", "-q",
                    input="/set system You are terse.\n/set top_k 7\nWhat is 12 times 7?\n/history\n")
    assert first.code == 0, first.stderr
    assert "[assistant] → multiply(" in first.stderr and "[tool] " in first.stderr
    resumed = run_cli("chat", "--resume", "last", "-q", input="/history\n")
    assert "[assistant] → multiply(" in resumed.stderr and "[tool] " in resumed.stderr
    shown = run_cli("run", "-C", "--show-prompt", "And 3 times that?")
    assert shown.code == 0, shown.stderr
    assert "You are terse." in shown.stdout and '"name": "multiply"' in shown.stdout and "<tool_response>" in shown.stdout
    again = run_cli("run", "-C", "--temp", "0", "-n", "4", "And 3 times that?")
    assert again.code == 0, again.stderr
    newest = json.loads(run_cli("logs", "--json", "-n", "1").stdout)[0]
    assert newest["settings"]["top_k"] == 7 and newest["system"] == "You are terse."  # the chat's /set, kept


def test_approval_on_a_terminal_and_ctrl_c_during_a_tool(tmp_path):
    import pexpect

    slow = tmp_path / "slow.py"
    slow.write_text("import time\n\ndef wait() -> str:\n    \"\"\"Wait.\"\"\"\n    time.sleep(60)\n"
                    "    return 'done'\n")
    child = spawn_terminal("run", "--functions", str(slow), "--tool-choice", "wait", "--tools-approve", "--tools-debug",
                           "--temp", "0", "-n", "30", "-q", "Wait.", timeout=120, encoding="utf-8", env={"NO_COLOR": "1"})
    child.expect(r"run wait\(")
    child.sendline("n")  # refused: the model reads that it was not allowed, and the run goes on
    child.expect("the user did not allow this call")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    asked = spawn_terminal("run", "--functions", str(slow), "--tool-choice", "wait", "--tools-approve", "--temp", "0",
                           "-n", "30", "-q", "Wait.", timeout=30, encoding="utf-8", env={"NO_COLOR": "1"})
    asked.expect(r"\[y/N\] ")
    interrupt_at_a_prompt(asked, pexpect.EOF)  # Ctrl-C at the question ends the run at once (issue 57: it waited for
    # Enter)
    asked.close()
    assert asked.exitstatus == 130 or asked.signalstatus == 2, (asked.exitstatus, asked.signalstatus)
    from conftest import ctrl_c_when

    code, err = ctrl_c_when(["run", "--functions", str(slow), "--tool-choice", "wait", "--tools-debug", "--temp",
                             "0", "-n", "30", "Wait."], b"tool call wait(", timeout=20)  # not the 60 s the tool sleeps
    assert code == 130 and b"Traceback" not in err


def test_the_prefill_line_is_gone_before_a_call_is_asked_about_and_says_the_prompt_s_own_figures(monkeypatch):
    """An answer that begins with a call: the prefill line (rich redraws it 4 times a second) was never stopped, and
    drew over --tools-approve's question; it stops at the first event that is not the prefill's. Its figures: the
    tokens evaluated of those to evaluate, and the whole prompt when some of it was cached."""
    import io

    from rich.console import Console

    from llmcli.answer.events import Prefill
    from llmcli.answer.tool_call_parser import CallStarted
    from llmcli.cli import output
    from llmcli.cli.stream import AnswerSink, show_answer

    seen: list[str] = []

    class Recorder(output.PrefillStatus):
        def update(self, evaluated: int, total: int, prompt: int = 0) -> None:
            super().update(evaluated, total, prompt)
            seen.append(self.__rich__().plain.split(" · ")[1])

        def stop(self) -> None:
            super().stop()
            seen.append("stopped")

    def events():
        yield Prefill(0, 10, 318)
        yield Prefill(9, 10, 318)
        yield CallStarted(0, "call-1", "multiply")
        seen.append("asked")  # (the tool loop runs the call, and asks, after the call's events)

    monkeypatch.setattr(output, "PrefillStatus", Recorder)
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    show_answer(events(), AnswerSink(io.StringIO()), console, quiet=False)
    assert seen[:4] == ["0 / 10 tokens (of 318: the rest was cached)", "9 / 10 tokens (of 318: the rest was cached)",
                        "stopped", "asked"]


def test_run_with_functions_against_llama_cpp_python_s_own_server(functions, smollm2, tmp_path):
    """The loop is the client's: a server's own tool calling (llama-cpp-python's chatml-function-calling, which
    streams a named choice) works through it as llmcli serve's does."""
    from conftest import start_llama_cpp_server

    proc, url = start_llama_cpp_server(smollm2, tmp_path / "llama-server.log", "--n_ctx", "1024",
                                       "--chat_format", "chatml-function-calling")
    try:
        result = run_cli("run", "--endpoint", url, "--functions", functions, "--tool-choice",
                         "multiply", "--temp", "0", "-n", "60", "--json", "What is 12 times 7?")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert result.code == 0, result.stderr
    (call, *_) = json.loads(result.stdout)["tool_calls"]
    arguments = json.loads(call["arguments"])
    assert call["name"] == "multiply" and call["result"] == str(arguments["a"] * arguments["b"])


# -- the lazy grammar of `auto` (issue 60: the stalls): fed only when the answer opens a call -------------------------

def _fires_whole_text(patterns: tuple[str, ...], text: bytes) -> bool:
    """llama.cpp's own reading of its trigger patterns on the whole answer: `^…$` matched whole, others searched."""
    import re

    return any(re.fullmatch(p.encode(), text, re.DOTALL) if p.startswith("^") and p.endswith("$")
               else re.search(p.encode(), text, re.DOTALL) for p in patterns)


@given(st.lists(st.sampled_from(["The sea ", "is ", "{", " ", "\n", "<", "tool", "_call", ">", "<tool_call>", "é",
                                 "calm. " * 20, "x" * 300]), max_size=60))
@settings(max_examples=300, deadline=None)
def test_the_trigger_fires_where_llama_cpp_s_patterns_first_match_the_whole_answer(pieces):
    """LazyTrigger, token by token, against the patterns applied to the whole answer each time (what llama.cpp does,
    at a cost that grows with the answer): the same first token, and the tokens it hands the grammar hold the match."""
    from llmcli.llama.lazy_trigger import LazyTrigger

    for patterns in ((r"[\s\S]*?(<tool_call>)[\s\S]*", r"^\s*(<)$"), (r"\s*(\{)[\s\S]*",), (r"^\s*(\{)$",)):
        trigger, text = LazyTrigger(patterns), b""
        for i, piece in enumerate(p.encode() for p in pieces):
            text += piece
            fired = trigger.fires(i, piece)
            assert (fired is not None) == _fires_whole_text(patterns, text), (patterns, pieces[:i + 1])
            if fired is not None:
                tokens, kept = fired
                held = b"".join(pieces[t].encode() for t in tokens)
                assert tokens[-1] == i and text.endswith(held) and _fires_whole_text(kept, held), (patterns, pieces)
                break


def test_a_long_answer_that_calls_nothing_feeds_the_lazy_grammar_nothing_and_a_call_arms_it_as_llama_cpp_would(
        smollm2, monkeypatch):
    """A tools `auto` answer on SmolLM2: the free text (150 tokens) never reaches llama.cpp's lazy grammar (which matched its
    trigger patterns against all of it at every token: a long answer slowed to a stall), and once a call opens, the
    grammar made then holds the same candidates as one fed the whole answer from its first token."""
    import ctypes
    import dataclasses

    import llama_cpp
    import numpy as np

    from llmcli.answer.sampling_config import SamplingConfig
    from llmcli.answer.tool_calls import tool_spec as spec_of
    from llmcli.llama import sampler_chain
    from llmcli.llama.engine import Engine
    from llmcli.llama.engine_config import EngineConfig
    from llmcli.llama.schema_grammar import with_tool_grammar

    accepted: list[int] = []
    real_accept = llama_cpp.llama_sampler_accept
    monkeypatch.setattr(sampler_chain.llama_cpp, "llama_sampler_accept",
                        lambda sampler, token: (accepted.append(ctypes.cast(sampler, ctypes.c_void_p).value),
                                                real_accept(sampler, token))[1])
    with Engine(smollm2, EngineConfig(n_ctx=1024, n_threads=1)) as engine:
        vocab, n_vocab = engine.vocab, engine.vocab.n_tokens
        # No end, no "<" (no call opens): a story of 150 tokens on any CPU. The grammar checked alone; in the chain.
        quiet = tuple((vocab.tokenize(text, add_special=False)[0], float("-inf"))
                      for text in ("<", " <", "<|im_end|>", "<|im_start|>", "<|endoftext|>"))
        for options in ({"temp": 0}, {"temp": 0, "repeat_penalty": 1.2}):
            config = with_tool_grammar(SamplingConfig(**options, logit_bias=quiet), spec_of([WEATHER]), preference=2.0,
                                       vocab=vocab)
            assert config.grammar_triggers and config.first_token_bias
            prompt = vocab.tokenize("<|im_start|>user\nWrite a long story about the sea.<|im_end|>\n"
                                    "<|im_start|>assistant\n")
            engine.kv.clear()
            assert engine.prefill(prompt)
            with engine.sampler(dataclasses.replace(config, first_token_bias=()), 1) as sampler:
                grammars = {ctypes.cast(h, ctypes.c_void_p).value for h in (sampler.grammar, sampler.constrained) if h}
                accepted.clear()
                answer = []
                for _ in range(150):  # (~600 bytes: past what is kept whole)
                    token = sampler.sample()
                    answer.append(token)
                    assert engine.decode_one(token) == "ok"
                assert not sampler.armed, vocab.detokenize(answer)  # (a story, no call)
                assert not grammars & set(accepted)  # (before: the grammar and its chain took every token)
                stages = [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(sampler.chain, i))
                          for i in range(llama_cpp.llama_sampler_chain_n(sampler.chain))]
                assert b"grammar" not in stages, stages  # (before: in the chain from the start, fed every token)

            def masked(grammar) -> set[int]:
                data = (llama_cpp.llama_token_data * n_vocab)()
                rows = np.ctypeslib.as_array(data)
                rows["id"], rows["logit"] = np.arange(n_vocab), 0.0
                llama_cpp.llama_sampler_apply(grammar, ctypes.byref(llama_cpp.llama_token_data_array(data, n_vocab, -1,
                                                                                                   False)))
                return set(np.flatnonzero(rows["logit"] == -np.inf).tolist())

            text = (" The sea was calm {and grey}, < and the boats <tool came home. " * 12
                    + 'Let me look: <tool_call>{"name": "weather", "arguments": {"city": "Par')
            forced = vocab.tokenize(text, add_special=False)
            with engine.sampler(config, 1) as sampler:
                reference = sampler_chain._new_grammar(config, vocab.handle)  # (llama.cpp's own, fed everything)
                try:
                    opened = None
                    for i, token in enumerate(forced):
                        sampler.accept(token)
                        real_accept(reference, token)
                        if sampler.armed and opened is None:
                            opened = i
                            assert vocab.detokenize(forced[:i + 1]).endswith("<tool_call>")
                        if opened is not None and (i == opened or i % 4 == 0 or i == len(forced) - 1):
                            live = sampler.grammar if sampler.grammar is not None else next(
                                stage for stage in (llama_cpp.llama_sampler_chain_get(sampler.chain, n) for n in
                                                    range(llama_cpp.llama_sampler_chain_n(sampler.chain)))
                                if llama_cpp.llama_sampler_name(stage) == b"grammar")
                            assert masked(live) == masked(reference) and masked(reference), (options, i)
                        elif opened is None:
                            assert not masked(reference), i  # (llama.cpp's is still waiting too)
                    assert opened is not None
                finally:
                    llama_cpp.llama_sampler_free(reference)
