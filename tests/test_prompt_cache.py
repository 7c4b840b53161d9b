"""The prompt cache (issue 13): prefill once across runs, through the real CLI on real models, and the
store's checks on its own (no model). Timings are not asserted: token counts prove what was reused."""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_cli

from llmcli.store.prompt_store import BLOCK, MAGIC, BadEntry, PromptStore, all_entries, block_hashes, clear, fingerprint

# The prompt cache on disk is a run's in its own process (a warm server keeps its slots' KV itself).
pytestmark = pytest.mark.in_process

GIB = 2**30
FACTS = [
    ("Amsterdam", "herons", "copper"), ("Lisbon", "otters", "glass"), ("Oslo", "lynxes", "amber"),
    ("Quito", "condors", "tin"), ("Hanoi", "tigers", "silk"), ("Nairobi", "zebras", "clay"),
    ("Lima", "llamas", "wool"), ("Perth", "quokkas", "opal"), ("Tallinn", "storks", "flax"),
    ("Dakar", "pelicans", "salt"), ("Seoul", "magpies", "jade"), ("Cusco", "alpacas", "gold"),
]


def document(n_lines: int = 12, seed: int = 0) -> str:
    """A small report with distinct facts (about 14 tokens a line)."""
    lines = []
    for i in range(n_lines):
        city, animal, material = FACTS[(i + seed) % len(FACTS)]
        lines.append(f"Site {i + 1 + 100 * seed}: the team in {city} studies {animal} and builds with {material}.")
    return "\n".join(lines)


def ask(question: str, doc: str, *args: str, model: Path | None = None) -> dict:
    """`echo DOC | llmcli run --json QUESTION`: the record, with stderr under "stderr"."""
    flags = ["-m", str(model)] if model else []
    result = run_cli("run", "--json", "--temp", "0", "-n", "8", *flags, *args, question, input=doc)
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    record["stderr"] = result.stderr
    return record


def entries(isolated_env: Path) -> list[Path]:
    return sorted((isolated_env / "cache" / "prompts").glob("*/entries/*.kv"))


# -- through the CLI -------------------------------------------------------------------------------

@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_second_question_about_a_piped_document_starts_from_its_saved_state(model_name, request, isolated_env):
    model = request.getfixturevalue(model_name)
    doc = document(8)
    first = ask("Which city studies otters?", doc, "--prompt-cache-min", "64", model=model)
    assert first["usage"]["cached_tokens"] == 0 and first["timings"]["restored_tokens"] == 0
    assert len(entries(isolated_env)) == 1  # saved after the answer

    warm = ask("Which city builds with jade?", doc, "--prompt-cache-min", "64", model=model)
    restored = warm["timings"]["restored_tokens"]
    # Evaluated from scratch in the batches the restored run used (the restored part, then the rest): a batch's size
    # changes how the CPU's kernels round (on AVX2, Gemma's first token differs between -b 512 and -b 135).
    cold = ask("Which city builds with jade?", doc, "--no-prompt-cache", "-b", str(restored), model=model)
    assert restored > 0.9 * first["usage"]["prompt_tokens"]  # the whole document
    assert warm["usage"]["cached_tokens"] == warm["timings"]["restored_tokens"]
    assert f"({warm['usage']['cached_tokens']} cached)" in warm["stderr"]
    assert cold["usage"]["cached_tokens"] == 0
    assert warm["text"] == cold["text"]  # greedy: the same answer as evaluating everything
    assert len(entries(isolated_env)) == 1  # the second question evaluated too little to be worth a file


def test_a_repeated_prompt_argument_is_restored_too(smollm2, isolated_env):
    long_prompt = document(8) + "\n\nWhich city studies storks?"
    runs = [run_cli("run", "--json", "--temp", "0", "-n", "8", "--prompt-cache-min", "64", long_prompt) for _ in range(2)]
    records = [json.loads(r.stdout) for r in runs]
    assert records[1]["usage"]["cached_tokens"] == records[1]["usage"]["prompt_tokens"] - 1
    assert records[0]["text"] == records[1]["text"]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _header(path: Path) -> tuple[dict, int]:
    """An entry file's header and where its tokens begin."""
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    return json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + header_len]), len(MAGIC) + 4 + header_len


def _payload_offset(path: Path) -> int:
    header, tokens_at = _header(path)
    return tokens_at + 4 * header["tokens"]


def test_damaged_or_foreign_state_files_never_reach_llama_cpp(smollm2, no_template_model, isolated_env):
    doc = document(8)
    args = ("--prompt-cache-min", "64")
    baseline = ask("Which city studies lynxes?", doc, *args, "--no-prompt-cache")
    ask("Which city studies lynxes?", doc, *args)
    [saved] = entries(isolated_env)
    foreign_dir = isolated_env / "foreign"
    foreign = run_cli("run", "-m", str(no_template_model), "--raw", "-n", "1", "-q", "--prompt-cache-min", "64",
                      "Which city studies lynxes?", input=doc, env={"LLMCLI_CACHE_DIR": str(foreign_dir)})
    assert foreign.code == 0, foreign.stderr
    [foreign_file] = foreign_dir.glob("prompts/*/entries/*.kv")

    damages = {
        "bit flipped in the KV data": (lambda p: _flip(p, _payload_offset(p) + 5000), "checksum"),
        "bit flipped in a token": (lambda p: _flip(p, _payload_offset(p) - 40), "checksum"),
        "bit flipped in the header": (lambda p: _flip(p, len(MAGIC) + 12), "damaged header"),
        "truncated": (lambda p: p.write_bytes(p.read_bytes()[: _payload_offset(p) + 1000]), "truncated"),
        "another model's file": (lambda p: p.write_bytes(foreign_file.read_bytes()), "another model"),
        "not a state file": (lambda p: p.write_bytes(b"hello"), "not a prompt cache file"),
    }
    # Every damage is caught by the store's reader before a byte reaches llama.cpp (in-process: no model needed)...
    good = saved.read_bytes()
    store = PromptStore(saved.parent.parent.parent, _header(saved)[0]["key"], 1 << 30)
    for damage, says in damages.values():
        damage(saved)
        with pytest.raises(BadEntry, match=says):
            store.read(saved)
        saved.write_bytes(good)
    # ... and through the CLI a damaged entry is removed with a notice, the answer unchanged.
    for what in ("bit flipped in the KV data", "another model's file"):
        [path] = entries(isolated_env)
        damages[what][0](path)
        damaged = path.read_bytes()
        again = ask("Which city studies lynxes?", doc, *args)
        assert again["text"] == baseline["text"], what
        assert again["timings"]["restored_tokens"] == 0, what
        assert "prompt cache:" in again["stderr"] and "removed it" in again["stderr"], what
        assert not path.exists() or path.read_bytes() != damaged, what  # gone (a good one saved in its place)
    assert entries(isolated_env) == [saved]  # the run after the last damage saved a good state again
    assert ask("Which city studies lynxes?", doc, *args)["timings"]["restored_tokens"] > 0


def test_concurrent_runs_on_the_same_document_leave_one_good_entry(smollm2, isolated_env):
    doc = document(8)
    with ThreadPoolExecutor(2) as pool:  # threads in the test process: run_cli starts real processes
        results = list(pool.map(lambda _: run_cli("run", "--json", "--temp", "0", "-n", "8", "--prompt-cache-min", "64",
                                                  "Which city studies tigers?", input=doc), range(2)))
    assert [r.code for r in results] == [0, 0], [r.stderr for r in results]
    assert json.loads(results[0].stdout)["text"] == json.loads(results[1].stdout)["text"]
    assert len(entries(isolated_env)) == 1
    assert not list((isolated_env / "cache" / "prompts").glob("*/entries/.*.tmp"))
    warm = ask("Which city studies tigers?", doc, "--prompt-cache-min", "64")
    assert warm["timings"]["restored_tokens"] > 0


def test_the_budget_evicts_the_least_recently_used_state(smollm2, isolated_env, monkeypatch):
    monkeypatch.setenv("LLMCLI_PROMPT_CACHE_MIN", "64")
    a, b, c = (document(10, seed) for seed in (0, 1, 2))
    ask("Which city studies herons?", a)
    [entry_a] = entries(isolated_env)
    monkeypatch.setenv("LLMCLI_PROMPT_CACHE_SIZE", str(2.5 * entry_a.stat().st_size / GIB))  # room for two
    ask("Which city studies otters?", b)
    [entry_b] = [e for e in entries(isolated_env) if e != entry_a]
    assert ask("Which city builds with copper?", a)["timings"]["restored_tokens"] > 0  # A is used again
    ask("Which city studies lynxes?", c)
    left = entries(isolated_env)
    assert entry_a in left and entry_b not in left and len(left) == 2  # B was the least recently used
    listed = json.loads(run_cli("cache", "list", "--json").stdout)
    assert {Path(e["path"]) for e in listed} == set(left)
    info = json.loads(run_cli("cache", "info", "--json").stdout)
    assert info["states"] == 2 and info["bytes"] <= info["budget_bytes"]


def test_the_prompt_cache_can_be_turned_off_and_cleared(smollm2, isolated_env, monkeypatch):
    doc = document(6)
    ask("Which city studies herons?", doc, "--no-prompt-cache", "--prompt-cache-min", "64")
    assert entries(isolated_env) == []
    isolated_env.mkdir(parents=True, exist_ok=True)
    config = isolated_env / "config.toml"
    config.write_text("prompt_cache = false\nprompt_cache_min = 64\n")
    monkeypatch.setenv("LLMCLI_CONFIG", str(config))
    ask("Which city studies herons?", doc)
    assert entries(isolated_env) == []
    info = run_cli("cache", "info")
    assert "enabled  no (config.toml)" in info.stdout
    ask("Which city studies herons?", doc, "--prompt-cache")  # a flag outranks the config file
    assert len(entries(isolated_env)) == 1
    cleared = run_cli("cache", "clear")
    assert cleared.code == 0 and cleared.stdout.startswith("removed 1 saved state,")
    assert entries(isolated_env) == []
    assert json.loads(run_cli("cache", "list", "--json").stdout) == []


def test_kv_type_q8_0_halves_the_kv_cache(smollm2):
    sizes = {}
    answers = {}
    for kv_type in ("f16", "q8_0"):
        result = run_cli("run", "-v", "--json", "--temp", "0", "-n", "8", "--kv-type", kv_type, "Name a planet.")
        assert result.code == 0, result.stderr
        answers[kv_type] = json.loads(result.stdout)["text"]
        # llama.cpp's own line: "llama_kv_cache: size =   90.00 MiB (  4096 cells, ...)"
        line = next(line for line in result.stderr.splitlines() if "llama_kv_cache: size =" in line)
        sizes[kv_type] = float(line.split("size =")[1].split("MiB")[0])
    assert sizes["q8_0"] == pytest.approx(sizes["f16"] * 34 / 64, rel=0.01)  # q8_0: 34 bytes per 32 values
    assert answers["q8_0"].strip()
    bad = run_cli("run", "--kv-type", "q5", "hi")
    assert bad.code == 2 and "--kv-type must be one of f16, q8_0, q4_0" in bad.stderr


# -- chat ------------------------------------------------------------------------------------------

def _chat(*args: str, input: str) -> tuple[list[dict], str]:
    result = run_cli("chat", "--json", "--temp", "0", "-n", "24", *args, input=input)
    assert result.code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()], result.stderr


def test_chat_resume_restores_the_conversation_kv(smollm2, isolated_env):
    turns = "".join(f"Give me one word that rhymes with {word}.\n" for word in ("cat", "dog", "tree", "sun"))
    records, _ = _chat("--prompt-cache-min", "64", input=turns)
    assert len(records) == 4
    resumed, stderr = _chat("--resume", "last", "--prompt-cache-min", "64", input="And one that rhymes with light?\n")
    assert "KV state of" in stderr and "tokens restored" in stderr
    usage = resumed[0]["usage"]
    assert usage["cached_tokens"] >= records[-1]["usage"]["prompt_tokens"]  # the history was not evaluated again
    run_cli("cache", "clear")
    again, stderr = _chat("--resume", "last", "--prompt-cache-min", "64", input="And one that rhymes with night?\n")
    assert "no saved KV state for this conversation" in stderr
    assert again[0]["usage"]["cached_tokens"] == 0


def test_chat_shifts_the_kv_cache_when_old_exchanges_are_dropped(smollm2):
    turns = "".join(f"Tell me one fact about the number {n}, in two sentences.\n" for n in range(1, 9))
    records, stderr = _chat("-c", "256", "-n", "40", "--no-prompt-cache", input=turns)
    dropped = [r for r in records if any("dropped" in n for n in r["notices"])]
    assert dropped, stderr
    for record in dropped:
        assert "shifted, not evaluated again" in record["notices"][0]
        usage = record["usage"]
        assert usage["prompt_tokens"] - usage["cached_tokens"] < 60  # only the new message (and the last reply's end)


# -- the store on its own --------------------------------------------------------------------------

KEY = fingerprint({"model_sha256": "0" * 64, "test": True})


def _save(store: PromptStore, tokens: list[int], size: int = 1000) -> Path:
    path = store.save(tokens, bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    assert path is not None, store.notices
    return path


def test_the_longest_saved_prefix_is_found_by_blocks(tmp_path):
    store = PromptStore(tmp_path, KEY, GIB)
    short = list(range(1000, 1000 + 2 * BLOCK + 10))
    long = short + list(range(5000, 5000 + 3 * BLOCK))
    _save(store, short)
    long_path = _save(store, long)
    query = long[: 4 * BLOCK] + [7] * 50  # shares 4 blocks with `long`, 2 (and a bit) with `short`
    found = store.find(query)
    assert found is not None and found.path == long_path and found.shared == 4 * BLOCK
    assert bytes(found.payload[:3]) == b"\x00\x01\x02"
    whole = store.find(query, whole=True)  # only an entry that is all of it a prefix: `short`
    assert whole is not None and whole.shared == len(short) == len(whole.tokens)
    assert store.find([1, 2, 3] * 100) is None
    assert store.holds(long, len(long) - 10) and not store.holds([9] * 500, 64)


def test_a_damaged_entry_is_refused_before_its_bytes_are_used(tmp_path):
    store = PromptStore(tmp_path, KEY, GIB)
    tokens = list(range(3 * BLOCK))
    for damage in (lambda d: d[:-1], lambda d: d + b"\0", lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:],
                   lambda d: d[:8] + struct.pack("<I", 2**31) + d[12:], lambda d: b"LLMCLIKV" + b"\0" * 4):
        path = _save(store, tokens)
        path.write_bytes(damage(path.read_bytes()))
        assert store.find(tokens) is None
        assert not path.exists() and "removed it" in store.notices.pop()
    other = PromptStore(tmp_path, fingerprint({"model_sha256": "1" * 64}), GIB)
    foreign = _save(other, tokens)
    path = _save(store, tokens)
    path.write_bytes(foreign.read_bytes())
    assert store.find(tokens) is None and "another model" in store.notices.pop()


def test_eviction_keeps_the_budget_by_last_use(tmp_path):
    store = PromptStore(tmp_path, KEY, 2500 + 3 * 2000)
    paths = [_save(store, [seed] * (2 * BLOCK), size=2000) for seed in range(3)]
    for age, path in enumerate(paths):
        os.utime(path, (1000 + age, 1000 + age))
    assert store.find([0] * (2 * BLOCK)) is not None  # the oldest is used: now the most recent
    _save(store, [7] * (2 * BLOCK), size=2000)
    left = {e.path for e in all_entries(tmp_path)}
    assert paths[0] in left and paths[1] not in left and paths[2] in left
    assert not any((tmp_path / KEY[:24] / "blocks").glob("*")) or all(
        p.read_text().strip() for p in (tmp_path / KEY[:24] / "blocks").glob("*"))
    assert clear(tmp_path)[0] == 3 and all_entries(tmp_path) == []


def test_a_full_disk_skips_the_save_with_a_notice(tmp_path):
    store = PromptStore(tmp_path, KEY, GIB)
    (tmp_path / KEY[:24]).write_text("not a folder")  # mkdir fails like a full or read-only disk would
    assert store.save([1] * BLOCK, b"x" * 100) is None
    assert store.notices and store.notices[0].startswith("prompt cache: not saved")


def test_block_hashes_chain_the_whole_prefix():
    tokens = list(range(3 * BLOCK + 5))
    hashes = block_hashes(KEY, tokens)
    assert len(hashes) == 3
    changed = block_hashes(KEY, [99] + tokens[1:])
    assert all(a != b for a, b in zip(hashes, changed, strict=True))  # a change in block 0 changes every later hash
    assert block_hashes(KEY, tokens[: 2 * BLOCK]) == hashes[:2]
