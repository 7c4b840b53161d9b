"""Sampling controls, constrained output, the context budget and settings precedence, on the real model."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st


def answer(*args: str) -> dict:
    result = run_cli("run", "--json", *args)
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)


def test_different_seeds_differ_and_same_seed_repeats():
    args = ("--temp", "1.0", "-n", "48", "Write a short poem about the sea.")
    a, b, c = answer("--seed", "1", *args), answer("--seed", "2", *args), answer("--seed", "1", *args)
    assert a["text"] == c["text"]
    assert a["text"] != b["text"]


@pytest.mark.parametrize("prompt", ["Describe a person.", "Invent a character for a novel.", "Who wrote Hamlet?"])
def test_json_schema_output_parses_and_validates(prompt):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    record = answer("--json-schema", json.dumps(schema), "--temp", "0", "-n", "64", prompt)
    value = json.loads(record["text"])
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


def test_json_schema_from_a_file(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    record = answer("--json-schema", str(schema), "--temp", "0", "-n", "32", "Is water wet?")
    assert isinstance(json.loads(record["text"])["ok"], bool)


def test_format_json_parses_or_says_why_not():
    """--format json: an answer that ends is valid JSON; one cut off (by -n, or as a loop) is exit 8 with the reason on
    stderr and in the record. (Whether a small model closes its JSON within -n depends on the model and on the CPU's
    rounding: both outcomes are llmcli's to get right.)"""
    for seed in ("1", "2", "3", "4"):
        result = run_cli("run", "--json", "--format", "json", "--temp", "0.7", "--seed", seed, "-n", "120",
                         "List three colors.")
        record = json.loads(result.stdout)
        if record["finish_reason"] == "stop":
            assert result.code == 0, result.stderr
            json.loads(record["text"])
        else:
            assert result.code == 8 and "Error: the answer is not valid JSON" in result.stderr, result.stderr
            assert record["format_error"].startswith("the answer is not valid JSON")


@pytest.mark.parametrize("prompt", ["Is the sky blue?", "Is fire cold?"])
def test_gbnf_grammar_restricts_to_yes_or_no(prompt):
    record = answer("--grammar", 'root ::= "yes" | "no"', "--temp", "0.8", "--seed", "5", prompt)
    assert record["text"] in ("yes", "no")


def test_grammar_file(tmp_path):
    grammar = tmp_path / "digits.gbnf"
    grammar.write_text('root ::= [0-9] [0-9] [0-9]\n')
    record = answer("--grammar-file", str(grammar), "--temp", "0", "How many days are in a year?")
    assert len(record["text"]) == 3 and record["text"].isdigit()


def test_logit_bias_banning_the_first_greedy_token_changes_it():
    first = answer("--temp", "0", "-n", "1", "hi")["text"]
    assert first
    banned = answer("--temp", "0", "-n", "1", "--logit-bias", f"{first}=-inf", "hi")["text"]
    assert banned != first


def test_repeat_penalty_and_mirostat_change_the_chain():
    prompt = "What is the capital of France?"
    plain = answer("--temp", "0", "-n", "40", prompt)["text"]
    penalised = answer("--temp", "0", "-n", "40", "--repeat-penalty", "1.5", prompt)["text"]
    assert plain != penalised

    # Mirostat replaces top-k/p: at a target surprise near 0 it keeps only the likeliest token (greedy at
    # temperature 1, whatever the seed); at a high target it samples, and a seed repeats the sample.
    story = "Write a story about a dragon."
    greedy = answer("--temp", "0", "-n", "24", story)["text"]
    for version, seed in (("1", "9"), ("2", "10")):
        focused = answer("--mirostat", version, "--mirostat-tau", "0.01", "--temp", "1", "--seed", seed, "-n", "24", story)
        assert focused["text"] == greedy, version
    free = [answer("--mirostat", "2", "--mirostat-tau", "8", "--temp", "1", "--seed", "9", "-n", "24", story)["text"]
            for _ in range(2)]
    assert free[0] == free[1] != greedy
    assert free[0] != answer("--temp", "1", "--seed", "9", "-n", "24", story)["text"]  # not the plain chain


def test_prompt_larger_than_the_context_is_refused_before_prefill(tmp_path):
    long_input = "word " * 400
    result = run_cli("run", "-c", "256", "Summarize:", input=long_input)
    assert result.code == 6
    line = result.stderr.splitlines()[0]
    assert line.startswith("Error: the prompt is ") and "the context holds 256" in line
    assert "--ctx-size" in result.stderr and "--on-overflow truncate" in result.stderr


def test_on_overflow_truncate_answers_and_reports_what_was_dropped():
    result = run_cli("run", "--json", "-c", "256", "-n", "16", "--on-overflow", "truncate", "--temp", "0",
                     "Summarize:", input="The sky is blue. " * 150)
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["usage"]["prompt_tokens"] + 16 <= 256
    assert "dropped" in record["notices"][0]
    assert "Warning: input truncated" in result.stderr
    import re

    dropped, whole, now = re.search(r"dropped the first ([\d,]+) of the message's ([\d,]+) characters; the prompt is "
                                    r"now (\d+) tokens", record["notices"][0]).groups()  # figures that add up
    message = "The sky is blue. " * 150 + "\n\nSummarize:"
    assert int(whole.replace(",", "")) == len(message.rstrip("\n")) or int(whole.replace(",", "")) == len(message)
    assert 0 < int(dropped.replace(",", "")) < int(whole.replace(",", "")) and int(now) == record["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--top-p", "1.5"], {}, "--top-p must be in (0, 1]"),
        (["--temp", "-0.5"], {}, "--temp must be >= 0"),
        ([], {"LLMCLI_TEMP": "-1"}, "--temp must be >= 0 (got -1.0, from env LLMCLI_TEMP)"),
        ([], {"LLMCLI_TOP_K": "many"}, "LLMCLI_TOP_K='many' is not a valid int"),
        (["--mirostat", "3"], {}, "--mirostat must be 0, 1 or 2"),
        (["--on-overflow", "wrap"], {}, "--on-overflow must be one of error, truncate"),
        (["-p", "nope"], {}, "unknown profile 'nope'"),
        (["--grammar", 'root ::= ("yes"'], {}, "rejected the grammar from --grammar"),
        (["--json-schema", "{not json"], {}, "--json-schema is not valid JSON"),
        (["--logit-bias", "Hello world=2"], {}, "is 2 tokens"),
        (["--logit-bias", "99999999=1"], {}, "outside the vocabulary"),
        (["--format", "yaml"], {}, "the only format is 'json'"),
        (["--grammar", "root ::= x", "--format", "json"], {}, "cannot be combined"),
    ],
)
def test_invalid_values_are_usage_errors_naming_the_flag(args, env, fragment):
    result = run_cli("run", *args, "hi", env=env)
    assert result.code == 2, result.stderr
    assert result.stderr.startswith("Error: ")
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def write_config(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return {"LLMCLI_CONFIG": str(path)}


def test_precedence_flag_env_profile_config_default(tmp_path):
    env = write_config(tmp_path, 'temp = 0.5\ntop_k = 20\nmin_p = 0.1\n[profiles.coder]\ntemp = 0.2\nsystem = "You code."\n')
    env["LLMCLI_TOP_K"] = "30"
    result = run_cli("config", "show", "--json", "-p", "coder", "--top-p", "0.9", env=env)
    assert result.code == 0, result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert settings["top_p"] == {"value": 0.9, "source": "flag --top-p"}
    assert settings["top_k"] == {"value": 30, "source": "env LLMCLI_TOP_K"}
    assert settings["temp"] == {"value": 0.2, "source": "profile coder (config.toml)"}
    assert settings["min_p"] == {"value": 0.1, "source": "config.toml"}
    assert settings["system"]["value"] == "You code."
    assert settings["repeat_penalty"] == {"value": 1.0, "source": "default"}
    # the flag beats everything, the env beats the profile
    again = json.loads(run_cli("config", "show", "--json", "-p", "coder", "--temp", "0.9", env=env).stdout)["settings"]
    assert again["temp"] == {"value": 0.9, "source": "flag --temp"}
    table = run_cli("config", "show", "-p", "coder", env=env).stdout
    assert "profile coder" in table and "env LLMCLI_TOP_K" in table


def test_profile_settings_reach_the_model(tmp_path):
    env = write_config(tmp_path, '[profiles.terse]\nsystem = "Answer in one word."\nmax_tokens = 3\n')
    shown = run_cli("run", "--show-prompt", "-p", "terse", "Hi", env=env)
    assert "Answer in one word." in shown.stdout
    record = json.loads(run_cli("run", "--json", "-p", "terse", "--temp", "0", "Tell me about the moon.", env=env).stdout)
    assert record["usage"]["completion_tokens"] <= 3


def test_model_defaults_from_gguf_metadata_rank_below_the_config_file(tmp_path, smollm2):
    from gguf_tools import rewrite_metadata

    model = rewrite_metadata(
        smollm2, tmp_path / "m.gguf", strings={"general.sampling.temp": 0.25, "general.sampling.top_k": 7}
    )
    env = write_config(tmp_path, "top_k = 11\n")
    settings = json.loads(run_cli("config", "show", "--json", "-m", str(model), env=env).stdout)["settings"]
    assert settings["temp"] == {"value": 0.25, "source": "model (general.sampling.temp)"}
    assert settings["top_k"] == {"value": 11, "source": "config.toml"}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("temp = = 1", "is not valid TOML"),
        ("tmep = 1", "unknown setting 'tmep'\nHint: Did you mean 'temp'? Known: model,"),
        ('temp = "hot"', "expected float"),
    ],
)
def test_bad_config_file_is_a_usage_error(tmp_path, text, fragment):
    result = run_cli("run", "hi", env=write_config(tmp_path, text))
    assert result.code == 2
    assert result.stderr.startswith("Error: config file") and fragment in result.stderr


# -- JSON answers: bounds enforced in the grammar, the whole schema checked afterwards (issue 12, defect 4) ----

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "population": {"type": "integer", "minimum": 1000, "maximum": 50000000},
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "rank": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 11},
    },
    "required": ["population", "city", "rank"],
}


def test_json_schema_answers_validate_over_ten_seeds():
    import jsonschema

    prompt = "Describe a French city as JSON."
    lines = "".join(json.dumps({"prompt": "A French city as JSON:", "seed": seed}) + "\n" for seed in range(10))  # a seed a line
    batch = run_cli("run", "--batch", "-", "--raw", "-P", "4", "--json-schema", json.dumps(CITY_SCHEMA), "--temp", "1",
                    "-n", "48", input=lines)
    assert batch.code == 0, batch.stderr
    records = [json.loads(line) for line in batch.stdout.splitlines()]
    assert [r["timings"]["seed"] for r in records] == list(range(10))
    assert len({r["text"] for r in records}) > 5  # sampled: different answers
    for record in records:
        if record["format_error"] is None:
            jsonschema.validate(json.loads(record["text"]), CITY_SCHEMA)
        else:  # only a cut-off answer may fail, and the record says why
            assert record["finish_reason"] == "length" and "cut off by -n" in record["format_error"]
    for seed in (0, 7):  # and through `run`, which exits 0 only for an answer that validates
        result = run_cli("run", "--json", "--json-schema", json.dumps(CITY_SCHEMA), "--seed", str(seed), "--temp", "1",
                         "-n", "48", prompt)
        record = json.loads(result.stdout)
        assert result.code == (0 if record["format_error"] is None else 8), result.stderr
        if result.code == 0:
            jsonschema.validate(json.loads(record["text"]), CITY_SCHEMA)


def test_an_answer_that_is_not_the_json_asked_for_exits_8_with_the_reason():
    cut = run_cli("run", "--json", "--format", "json", "-n", "4", "--temp", "0", "Give me a JSON object about cats.")
    assert cut.code == 8
    record = json.loads(cut.stdout)  # still one valid record, with the reason
    assert record["finish_reason"] == "length" and "not valid JSON (cut off by -n)" in record["format_error"]
    assert "Error: the answer is not valid JSON (cut off by -n)" in cut.stderr
    # a bound the grammar does not express (a float's maximum) is caught by the check
    loose = {"type": "object", "properties": {"x": {"type": "number", "maximum": 0.5}}, "required": ["x"]}
    outcomes = set()
    for seed in range(4):
        result = run_cli("run", "-q", "--json-schema", json.dumps(loose), "--seed", str(seed), "--temp", "1", "-n", "80",
                         "Give me a number as JSON.")  # (-n above the grammar's bound: a number has at most 52 characters)
        outcomes.add(result.code)
        if result.code == 8:
            assert "does not match the --json-schema at x" in result.stderr
    assert outcomes <= {0, 8}
    bad_schema = run_cli("run", "--json-schema", '{"type": "integer", "minimum": "ten"}', "hi")
    assert bad_schema.code == 2 and "not a valid JSON Schema" in bad_schema.stderr


@settings(max_examples=200, deadline=None, derandomize=True)
@given(low=st.one_of(st.none(), st.integers(-10**7, 10**7)), span=st.one_of(st.none(), st.integers(0, 10**7)),
       probes=st.lists(st.integers(-2 * 10**7, 2 * 10**7), min_size=20, max_size=20))
def test_integer_range_patterns_match_exactly_the_range(low, span, probes):
    import re

    from llmcli.llama.schema_grammar import integer_range

    high = None if span is None else (span if low is None else low + span)
    as_regex = re.sub(r'"(-?\d*)"', r"\1", integer_range(low, high)).replace(" ", "")  # GBNF literals -> regex
    pattern = re.compile(as_regex)
    edges = [v for v in (low, high) if v is not None]
    for n in [*probes, *edges, *(v + 1 for v in edges), *(v - 1 for v in edges), 0, -1, 1]:
        assert bool(pattern.fullmatch(str(n))) == ((low is None or n >= low) and (high is None or n <= high)), n
    for malformed in ("01", "-01", "+1", "1.0"):
        assert not pattern.fullmatch(malformed)


def test_a_grammar_checked_after_sampling_gives_the_grammar_first_greedy_answer():
    """With a grammar, the token is sampled, then checked; a penalty keeps the grammar first (the old way)."""
    schema = json.dumps(CITY_SCHEMA)
    checked = answer("--temp", "0", "-n", "48", "--json-schema", schema, "Tell me about Lyon in JSON.")
    first = answer("--temp", "0", "-n", "48", "--repeat-penalty", "1.000001", "--json-schema", schema, "Tell me about Lyon in JSON.")
    assert checked["text"] == first["text"] and checked["format_error"] is None
