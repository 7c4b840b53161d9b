"""One product on every path (issue 57): the conformance matrix. Every setting of the table (llmcli/config/settings.py)
and every option of `run` that shapes an answer has a row; each row that can be asked of an answer is run on every
path — in-process `run`, the warm `run` (the default), `chat` (warm), `run --batch`, and `--endpoint` to `llmcli serve` — and gives
the in-process answer (the same greedy text, tokens, logprobs, finish reason, notices, seed, rendered prompt), or a
refusal that names the option (exit 2), or, where a server decides, a notice naming it: never silence. `llmcli serve`
is asked each row through Anthropic's and Ollama's official clients too, where the protocol can say all of its options
(the same text, finish reason, token counts and logprobs; neither protocol has a field for a notice or the seed).

A new setting fails `test_every_setting_has_a_row` until it is given a row. `pytest -s -n0 tests/test_conformance.py`
prints the matrix and its counts."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import run_cli, start_server, stop_server

from llmcli.config.settings import SETTINGS

PROMPT = "Is the sea blue? Answer briefly."
YES_NO = 'root ::= "yes" | "no"'
SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}'
WARM_NOTICES = ("stays loaded",)  # the warm server's own first-start notice: said once, on the warm path only

# Where each setting acts. "answer": it shapes the answer (a row below runs it on every path); "load": it is fixed
# when the model loads (a warm server is started with it: another server for another value; --endpoint's server
# decides, named in a notice); "client": it acts in the client alone (how the answer is shown, logged, where the
# model comes from), the same code on every path.
WHERE = {
    "model": "client", "mmproj": "load", "system": "answer", "think": "answer", "think_budget": "answer",
    "reasoning": "client", "temp": "answer", "top_k": "answer", "top_p": "answer", "min_p": "answer",
    "typical_p": "answer", "repeat_penalty": "answer", "repeat_last_n": "answer", "presence_penalty": "answer",
    "frequency_penalty": "answer", "mirostat": "answer", "mirostat_tau": "answer", "mirostat_eta": "answer",
    "dry_multiplier": "answer", "dry_base": "answer", "dry_allowed_length": "answer", "dry_penalty_last_n": "answer",
    "xtc_probability": "answer", "xtc_threshold": "answer", "seed": "answer", "max_tokens": "answer", "stop": "answer",
    "repetition_guard": "answer", "on_overflow": "answer", "keep_alive": "client", "max_models": "client",
    "endpoint": "client", "endpoint_timeout": "client", "hub_timeout": "client", "call_preference": "answer",
    "call_gain": "answer",
    "tool_format": "load", "ctx_size": "load", "threads": "load", "batch_size": "load", "mlock": "load", "mmap": "load",
    "speculate": "load", "draft_model": "load", "draft_max": "load", "flash_attn": "load", "kv_type": "load",
    "markdown": "client", "answer_color": "client", "special": "load", "logprobs": "answer", "log": "client",
    "prompt_cache": "load", "prompt_cache_min": "load", "prompt_cache_size": "load",
}

# The rows run on every path: (name, the settings and options it covers, its arguments). "{yes}" is the id of the
# token "yes" (looked up with `llmcli tokenize`). A row holds several options where each one's effect stays seen (a
# grammar under a bias: free text where either is dropped); each row costs ~1.5 s of CPU over its paths.
ROWS = [
    ("defaults", (), []),
    ("system", ("system",), ["-s", "You answer with one word."]),
    ("sampling, dry, xtc", ("temp", "seed", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
                            "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
                            "dry_penalty_last_n", "xtc_probability", "xtc_threshold"),
     ["--temp", "0.9", "--seed", "3", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.02", "--typical-p", "0.95",
      "--repeat-penalty", "1.2", "--repeat-last-n", "32", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
      "--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3", "--dry-penalty-last-n", "64",
      "--xtc-probability", "0.5", "--xtc-threshold", "0.1"]),
    ("mirostat", ("mirostat", "mirostat_tau", "mirostat_eta"),
     ["--temp", "0.8", "--seed", "5", "--mirostat", "2", "--mirostat-tau", "4", "--mirostat-eta", "0.2"]),
    ("--stop, --no-think, guard", ("stop", "think", "think_budget", "repetition_guard", "call_preference", "call_gain"),
     ["--grammar", 'root ::= "alpha beta gamma"', "--stop", " beta", "--no-think", "--think-budget", "8",
      "--no-repetition-guard", "--call-preference", "1", "--call-gain", "2"]),
    ("--json-schema", ("--json-schema",), ["--json-schema", SCHEMA, "-n", "32"]),
    ("--format", ("--format",), ["--format", "json", "-n", "24"]),
    ("--grammar, --logit-bias TEXT", ("--grammar", "--logit-bias"), ["--grammar", YES_NO, "--logit-bias", "yes=-inf"]),
    ("--grammar, --logit-bias ID", ("--grammar", "--logit-bias"), ["--grammar", YES_NO, "--logit-bias", "{yes}=-inf"]),
    ("--logprobs, -n", ("logprobs", "max_tokens"), ["--logprobs", "2", "-n", "3"]),
    ("--raw", ("--raw",), ["--raw"]),
    ("-n past the context", ("max_tokens",), ["-n", "5000"]),
    ("tools, auto's lead", ("--functions", "call_preference", "call_gain"),  # (a warm run dropped the lead)
     ["--functions", "{functions}", "--tool-choice", "auto", "--call-preference", "30", "--call-gain", "0",
      "--chain-limit", "0", "-n", "160"]),  # (the call: ~50 tokens on AVX2, its room on any CPU)
]
FUNCTIONS = 'def lookup(word: str) -> str:\n    """Look a word up."""\n    return word\n'
PATHS = ("in-process", "warm", "chat", "--batch", "--endpoint serve")
PROTOCOLS = ("Anthropic", "Ollama")  # `llmcli serve` asked through the official clients, where a row can be said

# Each protocol's words for run's options (a row that uses any other is not expressible in it): the field, and how
# the flag's text becomes its value. Anthropic's SDK 2.x has no `temperature` argument: it goes in the body as
# the API takes it.
FLAG = {"--temp": float, "--seed": int, "--top-k": int, "--top-p": float, "--min-p": float, "--typical-p": float,
        "--repeat-penalty": float, "--repeat-last-n": int, "--presence-penalty": float, "--frequency-penalty": float,
        "--mirostat": int, "--mirostat-tau": float, "--mirostat-eta": float, "-n": int}
OLLAMA_OPTIONS = {"--temp": "temperature", "--seed": "seed", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
                  "--typical-p": "typical_p", "--repeat-penalty": "repeat_penalty", "--repeat-last-n": "repeat_last_n",
                  "--presence-penalty": "presence_penalty", "--frequency-penalty": "frequency_penalty",
                  "--mirostat": "mirostat", "--mirostat-tau": "mirostat_tau", "--mirostat-eta": "mirostat_eta",
                  "-n": "num_predict"}
ANTHROPIC_FIELDS = {"--temp": "temperature", "--top-k": "top_k", "--top-p": "top_p", "-n": "max_tokens"}
SWITCHES = ("--raw", "--no-think", "--no-repetition-guard")
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "stop": "stop", "length": "length"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2):
    """Each path's environment: one warm server (its own runtime dir) and one `llmcli serve` for --endpoint, shared by
    the module's rows and ended after it."""
    runtime = tempfile.mkdtemp(prefix="llmcli-rt-", dir="/tmp")
    warm = {"LLMCLI_RUNTIME_DIR": runtime, "LLMCLI_KEEP_ALIVE": ""}
    server, url = start_server(tmp_path_factory.mktemp("serve"), "-m", str(smollm2), "-P", "1")
    try:
        yield {"in-process": {"LLMCLI_KEEP_ALIVE": "0"}, "warm": warm, "chat": warm, "--endpoint serve": {"LLMCLI_ENDPOINT": url}}
    finally:
        run_cli("stop", env=warm)
        shutil.rmtree(runtime, ignore_errors=True)
        stop_server(server)


def _answer(env: dict[str, str], args: list[str], path: str) -> tuple[int, dict | None, str]:
    common = ["--temp", "0", "-n", "8", "--no-prompt-cache", "--json"]
    if path == "--batch":
        result = run_cli("run", *common, *args, "--batch", "-", input=json.dumps({"prompt": PROMPT}) + "\n",
                         env={"LLMCLI_KEEP_ALIVE": "0"})
        record = json.loads(result.stdout.splitlines()[0]) if result.code == 0 and result.stdout else None
        return result.code, record, result.stderr
    if path == "chat":  # (the default: warm) one message, its reply's record
        result = run_cli("chat", "--no-save", *common, *args, input=PROMPT + "\n", env=env)
        record = json.loads(result.stdout.splitlines()[0]) if result.code == 0 and result.stdout.strip() else None
        return (result.code if record is not None or result.code else 1), record, result.stderr
    result = run_cli("run", *common, *args, PROMPT, env=env)
    return result.code, json.loads(result.stdout) if result.code == 0 else None, result.stderr


def _same_answer(record: dict, reference: dict, named_by_server: bool = False) -> list[str]:
    """Where `record` parts from the in-process answer (nothing: the same answer); `named_by_server`: the model is
    named as the server lists it (--endpoint), a --batch record names none."""
    if "error" in record:  # (a batch's record of a prompt it refused)
        return [f"error: {record['error']}"]
    differences = [key for key in ("text", "finish_reason", "stop_sequence", "format_error", "model")
                   if record.get(key) != reference.get(key) and (key != "model" or "model" in record and not named_by_server)]
    calls = [[(c["name"], json.loads(c["arguments"])) for c in r.get("tool_calls") or ()] for r in (record, reference)]
    if calls[0] != calls[1]:
        differences.append(f"tool_calls {calls[0]} != {calls[1]}")
    counted = ("prompt_tokens",) if calls[1] else ("prompt_tokens", "completion_tokens")  # (a call's JSON is held by
    differences += [f"usage.{key}" for key in counted  # its grammar, which any tokenization spells: slots and one
                    if record["usage"][key] != reference["usage"][key]]  # sequence round differently)
    if "seed" in record["timings"] and record["timings"]["seed"] != reference["timings"].get("seed"):
        differences.append("timings.seed")  # (a record without the key: a protocol's reply, which says no seed)
    notices = [[n for n in r.get("notices", []) if not n.startswith(WARM_NOTICES)] for r in (record, reference)]
    if "notices" in record and notices[0] != notices[1]:  # (nor a notice)
        differences.append(f"notices {notices[0]} != {notices[1]}")
    mine, theirs = record.get("logprobs") or [], reference.get("logprobs") or []
    if [lp["token"] for lp in mine] != [lp["token"] for lp in theirs] or not all(
            math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3) for a, b in zip(mine, theirs, strict=False)):
        differences.append("logprobs")
    return differences


def test_every_setting_has_a_row():
    """A setting joins the matrix by being in the table: one added without saying where it acts fails here."""
    assert set(WHERE) == set(SETTINGS), f"give these settings a row: {sorted(set(SETTINGS) - set(WHERE))}"
    covered = {name for _, names, _ in ROWS for name in names}
    answer_settings = {name for name, where in WHERE.items() if where == "answer"}
    assert answer_settings - {"on_overflow"} <= covered, sorted(answer_settings - covered)  # (on_overflow: its own test)


@pytest.mark.long
def test_every_path_gives_the_in_process_answer(paths, capsys, tmp_path):
    yes = json.loads(run_cli("tokenize", "--json", "yes").stdout)["ids"]
    assert len(yes) == 1
    functions = tmp_path / "functions.py"
    functions.write_text(FUNCTIONS)
    cells: dict[tuple[str, str], str] = {}
    wrong = []
    for name, _, template in ROWS:
        args = [a.replace("{yes}", str(yes[0])).replace("{functions}", str(functions)) for a in template]
        code, reference, err = _answer(paths["in-process"], args, "in-process")
        assert code == 0, f"{name}: {err}"
        cells[name, "in-process"] = "same"
        for path in PATHS[1:]:
            code, record, err = _answer(paths.get(path, {}), args, path)
            if code == 2 and "Error:" in err:
                cells[name, path] = "refused"
                continue
            if code != 0 or record is None:
                wrong.append(f"{name} on {path}: exit {code}: {err.strip()[-300:]}")
                continue
            differences = _same_answer(record, reference, named_by_server=path == "--endpoint serve")
            cells[name, path] = "same" if not differences else "DIFFERS"
            if differences:
                wrong.append(f"{name} on {path}: {differences}")
        for protocol in PROTOCOLS:
            answer = _ask(protocol, paths["--endpoint serve"]["LLMCLI_ENDPOINT"], ["-n", "8", *args])
            if answer is None:
                cells[name, protocol] = "not expressible"
                continue
            differences = _same_answer(answer, reference, named_by_server=True)
            cells[name, protocol] = "same" if not differences else "DIFFERS"
            if differences:
                wrong.append(f"{name} through {protocol}: {differences}")
    _print_matrix(capsys, cells)
    assert not wrong, "\n".join(wrong)


def _ask(protocol: str, url: str, args: list[str]) -> dict | None:
    """The row asked of `llmcli serve` through `protocol`'s official client, as a run's --json record (its text, why
    it ended, its token counts, its logprobs); None when the protocol cannot say one of the row's options."""
    import anthropic
    import ollama

    given: dict[str, object] = {"--temp": 0.0}
    flags = iter(args)
    for flag in flags:
        given[flag] = True if flag in SWITCHES else FLAG.get(flag, str)(next(flags))
    messages = [*([{"role": "system", "content": given.pop("-s")}] if "-s" in given else []),
                {"role": "user", "content": PROMPT}]
    if protocol == "Ollama":
        if set(given) - set(OLLAMA_OPTIONS) - {"--json-schema", "--format", "--raw", "--logprobs"}:
            return None
        options = {OLLAMA_OPTIONS[flag]: value for flag, value in given.items() if flag in OLLAMA_OPTIONS}
        shape = json.loads(str(given["--json-schema"])) if "--json-schema" in given else given.get("--format")
        top = int(str(given["--logprobs"])) if "--logprobs" in given else None
        logprobs = {"logprobs": True, "top_logprobs": top} if top is not None else {}
        with ollama.Client(host=url, timeout=120) as client:  # (its connections closed after: none left to the GC)
            if given.get("--raw"):
                reply = client.generate(model="smollm2", prompt=PROMPT, raw=True, options=options, format=shape,
                                        **logprobs)
                text = reply.response
            else:
                reply = client.chat(model="smollm2", messages=messages, options=options, format=shape, **logprobs)
                text = reply.message.content
        return {"text": text, "finish_reason": FINISH[reply.done_reason], "usage": {
            "prompt_tokens": reply.prompt_eval_count, "completion_tokens": reply.eval_count},
            "logprobs": [{"token": lp.token, "logprob": lp.logprob} for lp in reply.logprobs or ()], "timings": {}}
    if set(given) - set(ANTHROPIC_FIELDS) - {"--json-schema"}:
        return None
    body: dict[str, object] = {"temperature": given.pop("--temp")}
    if "--json-schema" in given:
        body["output_config"] = {"format": {"type": "json_schema", "schema": json.loads(str(given.pop("--json-schema")))}}
    fields = {ANTHROPIC_FIELDS[flag]: value for flag, value in given.items()}
    system = [m["content"] for m in messages if m["role"] == "system"]
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        message = client.messages.create(model="smollm2", messages=messages[-1:],
                                         **({"system": system[0]} if system else {}), **fields, extra_body=body)
    return {"text": "".join(block.text for block in message.content if block.type == "text"),
            "finish_reason": FINISH[message.stop_reason or ""], "timings": {},
            "usage": {"prompt_tokens": message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
                      "completion_tokens": message.usage.output_tokens}}  # (input_tokens: those not read from a cache)


def _print_matrix(capsys, cells: dict[tuple[str, str], str]) -> None:
    counts: dict[str, int] = {}
    with capsys.disabled():
        print("\n" + "row".ljust(26) + "".join(path.ljust(18) for path in (*PATHS, *PROTOCOLS)))
        for name, _, _ in ROWS:
            row = [cells.get((name, path), "-") for path in (*PATHS, *PROTOCOLS)]
            for cell in row:
                counts[cell] = counts.get(cell, 0) + 1
            print(name.ljust(26) + "".join(cell.ljust(18) for cell in row))
        print("counts: " + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())))


def test_show_prompt_is_the_same_warm_and_in_process_and_refused_with_endpoint(paths):
    """`run --show-prompt` (a README example): the default (warm) run renders it here from the model's vocabulary
    and template (issue 57: it was exit 2 naming --endpoint); --endpoint's server renders its own: refused, named."""
    shown = {}
    for path in ("in-process", "warm"):
        result = run_cli("run", "--show-prompt", "-s", "Be brief.", PROMPT, env=paths[path])
        assert result.code == 0, result.stderr
        shown[path] = (result.stdout, result.stderr.splitlines()[-1])
    assert shown["warm"] == shown["in-process"] and PROMPT in shown["warm"][0] and "Be brief." in shown["warm"][0]
    assert shown["warm"][1].endswith("tokens (smollm2, chat template, context 4096)"), shown["warm"][1]
    refused = run_cli("run", "--show-prompt", PROMPT, env=paths["--endpoint serve"])
    assert refused.code == 2 and "--show-prompt" in refused.stderr and "--endpoint" in refused.stderr


def test_batch_refuses_what_shapes_one_prompt_instead_of_dropping_it():
    """`run --batch` with --show-prompt, -C, --cid, -T, --save, --var, --prompt-first or --stdin answered the file as if
    they were not given: a refusal naming them (exit 2), before anything loads."""
    for flag, args in (("--show-prompt", []), ("--continue", ["-C"]), ("--cid", ["--cid", "x"]),
                       ("--template", ["-T", "t"]), ("--save", ["--save", "t"]), ("--var", ["--var", "a=b"]),
                       ("--prompt-first", []), ("--stdin", [])):
        result = run_cli("run", "--batch", "-", *(args or [flag]), input='{"prompt": "hi"}\n')
        assert result.code == 2 and f"--batch answers each record of its file on its own: drop {flag}" in result.stderr, \
            result.stderr


def test_a_warm_error_is_the_in_process_error(paths):
    """The same exit code, words and hint; never the warm server's internal URL (issue 57: exit 2, `http://llmcli/v1
    refused the request (400)`, no hint)."""
    long = "word " * 5000
    unsatisfiable = '{"type": "string", "minLength": 5, "maxLength": 2}'  # (a valid schema no text meets: the
    # warm server turns it into a grammar, not the run: it said `response_format cannot be…`, naming the API's field)
    errors = {}
    for path in ("in-process", "warm"):
        for args in (["-n", "4", long], ["--logit-bias", "Hello world=-inf", PROMPT], ["--logit-bias", "99999999=1", PROMPT],
                     ["--json-schema", unsatisfiable, PROMPT]):
            result = run_cli("run", "--temp", "0", *args, env=paths[path])
            errors[path, args[1]] = (result.code, result.stderr.strip().splitlines()[-2:])
    for key in ("4", "Hello world=-inf", "99999999=1", unsatisfiable):
        assert errors["warm", key] == errors["in-process", key], key
        assert "http://llmcli" not in " ".join(errors["warm", key][1])
    assert errors["warm", "4"][0] == 6 and errors["warm", "4"][1][1].startswith("Hint: Use --ctx-size")
    assert errors["warm", "Hello world=-inf"][0] == errors["warm", "99999999=1"][0] == 2
    assert errors["warm", unsatisfiable][0] == 2
    assert errors["warm", unsatisfiable][1][-1] == "Error: --json-schema cannot be turned into a grammar: at most 2 is " \
        "less than at least 5"


def test_on_overflow_truncate_and_a_capped_n_say_the_same_on_every_path(paths):
    """--on-overflow truncate (issue 57: dropped with a warning on the warm path) cuts the same characters and says
    so in the same words; a too-large -n is capped with the same notice."""
    long = " ".join(f"word{i}" for i in range(700))
    records = {}
    options = ["--json", "--temp", "0", "-n", "4", "-c", "256", "--on-overflow", "truncate"]
    for path in ("in-process", "warm"):
        result = run_cli("run", *options, long, env=paths[path])
        assert result.code == 0, result.stderr
        records[path] = json.loads(result.stdout)
    for path in ("in-process", "warm"):  # --batch (its items were refused: "the prompt is 1410 tokens"), and through
        keep = ["--keep-alive", "5m"] if path == "warm" else []  # a warm server (their notices were dropped)
        result = run_cli("run", *options, *keep, "--batch", "-", input=json.dumps({"prompt": long}) + "\n",
                         env=paths[path])
        assert result.code == 0, result.stderr
        records["--batch", path] = json.loads(result.stdout.splitlines()[0])
    assert _same_answer(records["warm"], records["in-process"]) == []
    assert _same_answer(records["--batch", "in-process"], records["in-process"]) == []
    for record in (records["warm"], records["--batch", "in-process"], records["--batch", "warm"]):
        assert [n for n in record["notices"] if n.startswith("input truncated")] == \
            [n for n in records["in-process"]["notices"] if n.startswith("input truncated")]
        assert record["usage"]["prompt_tokens"] <= 256 - 4


def test_a_warm_answer_is_logged_under_the_model_s_name_and_the_log_is_private(paths):
    """`llmcli logs -m smollm2` finds a warm answer (issue 57: it was logged as `SmolLM2-135M-Instruct.Q4_1`); the
    data dir is 0700 and logs.db 0600, as the README's Safety section says."""
    import os
    import stat

    result = run_cli("run", "-m", "smollm2", "--temp", "0", "-n", "4", "--json", "lighthouse keeper", env=paths["warm"])
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "smollm2"
    found = run_cli("logs", "--json", "-q", "lighthouse", "-m", "smollm2")
    assert found.code == 0 and len(json.loads(found.stdout)) == 1, found
    data = Path(os.environ["LLMCLI_DATA_DIR"])
    assert stat.S_IMODE(data.stat().st_mode) == 0o700 and stat.S_IMODE((data / "logs.db").stat().st_mode) == 0o600


def test_serve_s_request_shaping_flags_are_the_defaults_of_requests_that_set_none(tmp_path):
    """`serve --grammar … --logit-bias …` (issue 57: taken and ignored: every route answered free text): every
    protocol's answer follows the server's grammar and bias unless the request brings its own format; `serve --help`
    says so."""
    import ollama
    from openai import OpenAI

    proc, url = start_server(tmp_path, "-P", "2", "--temp", "0", "--grammar", YES_NO, "--logit-bias", "no=100")
    try:
        with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client, \
                ollama.Client(host=url, timeout=120) as ollama_client:
            chat = client.chat.completions.create(model="smollm2", max_tokens=8,
                                                  messages=[{"role": "user", "content": PROMPT}])
            completion = client.completions.create(model="smollm2", max_tokens=8, prompt=PROMPT)
            generated = ollama_client.generate(model="smollm2", prompt=PROMPT)
            own = client.chat.completions.create(model="smollm2", max_tokens=24, response_format={"type": "json_object"},
                                                 messages=[{"role": "user", "content": PROMPT}])
    finally:
        stop_server(proc)
    assert chat.choices[0].message.content == completion.choices[0].text == generated.response == "no"
    assert json.loads(own.choices[0].message.content) is not None  # the request's own format wins
    help_text = " ".join(run_cli("serve", "--help").stdout.split())
    assert "--grammar, --json-schema and --format constrain every answer whose request sets no grammar" in help_text


def test_the_readme_s_using_it_examples_run_as_written_by_default(tmp_path, monkeypatch):
    """README, "Using it": each example (with a model here) run as written — the default model, warm (the default
    path: issue 57) — answers, exit 0; LLMCLI_MAX_TOKENS keeps the answers short. A pipe into llmcli is its stdin,
    one out of it to jq is read here (forked runs: a shell and a fresh Python per line cost 0.7 s of CPU each)."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## Using it", 1)[1].split("```", 2)[1]
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip().startswith(("llmcli", "cat"))]
    runnable = [line for line in lines if not re.search(r"-m \./|--image", line)]  # (models not here: the README's own)
    assert len(runnable) >= 10, runnable
    notes = "Tides rise and fall twice a day."
    runtime = tempfile.mkdtemp(prefix="llmcli-rt-", dir="/tmp")
    monkeypatch.delenv("LLMCLI_MODEL")  # (the default model: as a user has it)
    env = {"LLMCLI_RUNTIME_DIR": runtime, "LLMCLI_KEEP_ALIVE": "", "LLMCLI_MAX_TOKENS": "6"}
    try:
        for index, line in enumerate(runnable):
            command, _, piped_to = line.partition(" | jq")
            piped = command.startswith("cat notes.txt | ")
            args = shlex.split(command.removeprefix("cat notes.txt | "))
            assert args[0] == "llmcli", line
            result = run_cli(*args[1:], input=notes if piped else None, env=env)
            assert result.code == 0 and result.stdout.strip(), (line, result.stderr)
            if piped_to:
                assert "decode_tokens_per_s" in json.loads(result.stdout)["timings"], line
            if "--show-prompt" not in line:
                assert result.stderr.strip().splitlines()[-1].startswith("load " if index == 0 else "warm · "), (line, result.stderr)
    finally:
        run_cli("stop", env=env)
        shutil.rmtree(runtime, ignore_errors=True)


def test_an_image_gives_the_in_process_answer_on_every_path(seeing, tmp_path, capsys):
    """The matrix's `--image` row (issue 57, item 1), on a model that sees (SmolLM2 with a random-weight projector
    beside it: its answers about pictures mean nothing, and are the same on every path): `run --image` in process,
    warm, chat's `/image`, a `--batch` record's `images`, `--endpoint` to `llmcli serve` serving it, and that server
    through Anthropic's and Ollama's official clients (the picture sent their way: a base64 block, `images`)."""
    import base64
    import io

    import anthropic
    import ollama
    from PIL import Image

    picture = tmp_path / "picture.png"
    pixels = bytes((i * 31 + (i // 7) * 13) % 256 for i in range(64 * 48 * 3))
    buffer = io.BytesIO()
    Image.frombytes("RGB", (64, 48), pixels).save(buffer, "PNG")
    picture.write_bytes(buffer.getvalue())
    common = ["--temp", "0", "-n", "8", "--no-prompt-cache", "--json", "-m", str(seeing)]

    def ran(result) -> dict | None:
        return json.loads(result.stdout.splitlines()[0]) if result.code == 0 and result.stdout.strip() else None

    reference = ran(run_cli("run", *common, "--image", str(picture), PROMPT, env={"LLMCLI_KEEP_ALIVE": "0"}))
    assert reference is not None and reference["timings"]["images"] == 1, reference
    records = {
        "warm": ran(run_cli("run", *common, "--image", str(picture), PROMPT)),
        "chat": ran(run_cli("chat", "--no-save", *common, input=f"/image {picture}\n{PROMPT}\n")),
        "--batch": ran(run_cli("run", *common, "--batch", "-", env={"LLMCLI_KEEP_ALIVE": "0"},
                               input=json.dumps({"prompt": PROMPT, "images": [str(picture)]}) + "\n")),
    }
    (tmp_path / "serve").mkdir()
    server, url = start_server(tmp_path / "serve", "-m", str(seeing), "-P", "1")
    try:
        records["--endpoint serve"] = ran(run_cli("run", *common[:-2], "--image", str(picture), PROMPT,
                                                  env={"LLMCLI_ENDPOINT": url}))
        data = picture.read_bytes()
        with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120) as anthropic_client:
            message = anthropic_client.messages.create(
                model="smol", max_tokens=8, extra_body={"temperature": 0.0}, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(data).decode()}},
                    {"type": "text", "text": "\n" + PROMPT}]}])  # (run's message: its pictures, a line break, the text —
            # what llmcli's own client sends as blocks; blocks are joined as sent, so without it the prompt is a token less)
        records["Anthropic"] = {"text": "".join(b.text for b in message.content if b.type == "text"),
                                "finish_reason": FINISH[message.stop_reason or ""], "timings": {}, "usage": {
            "prompt_tokens": message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
            "completion_tokens": message.usage.output_tokens}}
        with ollama.Client(host=url, timeout=120) as ollama_client:
            reply = ollama_client.chat(model="smol", messages=[
                {"role": "user", "content": PROMPT, "images": [data]}], options={"temperature": 0, "num_predict": 8})
        records["Ollama"] = {"text": reply.message.content, "finish_reason": FINISH[reply.done_reason], "timings": {},
                             "usage": {"prompt_tokens": reply.prompt_eval_count, "completion_tokens": reply.eval_count}}
    finally:
        stop_server(server)
    cells = {}
    for path, record in records.items():
        assert record is not None, path
        cells[path] = _same_answer(record, reference, named_by_server=path in ("--endpoint serve", "Anthropic", "Ollama"))
    with capsys.disabled():
        print("\n" + "row".ljust(26) + "".join(path.ljust(18) for path in ("in-process", *cells)))
        print("--image".ljust(26) + "same".ljust(18) + "".join(("same" if not d else "DIFFERS").ljust(18)
                                                               for d in cells.values()))
    assert not any(cells.values()), cells
