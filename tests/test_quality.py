"""Which quant to run: `llmcli quantize`, `llmcli eval quality` and `llmcli quant advise`, on SmolLM2's real weights."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, spawn_cli

from llmcli.eval.quality import default_text, full_kld

# A text of ~285 SmolLM2 tokens (the start of llmcli's own): 2 chunks of -c 128, 63 positions scored in each.
CTX = 128


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(default_text()[:1200], encoding="utf-8")
    return path


def _quantized(tmp_path_factory: pytest.TempPathFactory, source: str, name: str, types: tuple[str, ...]) -> dict[str, Path]:
    """`source` requantized by `llmcli quantize` to each type (into the store as NAME:type), once a session: the first
    worker makes them, the others wait (each test links them into its own store)."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "ladder-cache"  # (the workers' root)
    cache.mkdir(exist_ok=True)
    made = {}
    with (cache / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for type_name in types:
            path = cache / "quantized" / name / f"{type_name}.gguf"
            if not path.exists():
                result = run_cli("quantize", source, "--type", type_name, "--allow-requantize", "--json",
                                 env={"LLMCLI_CACHE_DIR": str(cache)})
                assert result.code == 0, result.stderr
                assert Path(json.loads(result.stdout)["path"]) == path
            made[type_name] = path
    return made


@pytest.fixture(scope="session")
def ladder(packaged_smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2 requantized to F16 (the reference: the packaged Q4_1's values), Q8_0 and Q2_K."""
    return _quantized(tmp_path_factory, "smollm2", "smollm2", ("F16", "Q8_0", "Q2_K"))


def _into_store(made: dict[str, Path], home: Path, name: str = "smollm2") -> None:
    folder = home / "cache" / "quantized" / name
    folder.mkdir(parents=True, exist_ok=True)
    for type_name, path in made.items():
        os.link(path, folder / f"{type_name}.gguf")


def test_quantize_makes_a_model_the_store_lists_runs_and_removes(ladder, isolated_env, packaged_smollm2):
    refused = run_cli("quantize", "smollm2", "--type", "Q8_0")
    assert refused.code == 2 and "is Q4_1 already" in refused.stderr and "--allow-requantize" in refused.stderr
    needs = run_cli("quantize", "smollm2", "--type", "iq2_xs", "--allow-requantize")
    assert needs.code == 2 and "IQ2_XS needs an importance matrix" in needs.stderr
    unknown = run_cli("quantize", "smollm2", "--type", "Q9_9", "--allow-requantize")
    assert unknown.code == 2 and "unknown quantization type 'Q9_9'" in unknown.stderr
    missing = run_cli("run", "-m", "smollm2:q8_0", "hi")
    assert missing.code == 3 and "`llmcli quantize smollm2 --type Q8_0` makes it" in missing.stderr

    made = run_cli("quantize", "smollm2", "--type", "Q8_0", "--allow-requantize")
    assert made.code == 0, made.stderr
    assert "requantizing Q4_1 to Q8_0" in made.stderr and "smollm2:q8_0: Q8_0," in made.stderr
    target = isolated_env / "cache" / "quantized" / "smollm2" / "Q8_0.gguf"
    assert target.read_bytes() == ladder["Q8_0"].read_bytes()  # (llama.cpp's quantizer is deterministic)
    again = run_cli("quantize", "smollm2", "--type", "q8_0", "--allow-requantize")
    assert again.code == 2 and "smollm2:q8_0 exists already" in again.stderr

    elsewhere = run_cli("show", "smollm2:q5_k_m")
    assert elsewhere.code == 3 and "`llmcli quantize smollm2 --type Q5_K_M` makes it" in elsewhere.stderr
    listed = run_cli("list", "--json")
    entry = next(e for e in json.loads(listed.stdout) if e["name"] == "smollm2:q8_0")
    assert entry["quant"] == "Q8_0" and entry["source"] == "quantize" and entry["path"] == str(target)
    answered = run_cli("run", "-m", "smollm2:q8_0", "--json", "-n", "4", "Say hi")  # (warm: the default path)
    assert answered.code == 0, answered.stderr
    assert json.loads(answered.stdout)["model"] == "smollm2:q8_0"
    shown = run_cli("show", "smollm2:q8_0", "--json")
    assert json.loads(shown.stdout)["quant"] == "Q8_0"

    removed = run_cli("rm", "-y", "smollm2:q8_0")
    assert removed.code == 0 and "removed 1 model" in removed.stderr and not target.exists()
    assert list((isolated_env / "cache" / "quantized").iterdir()) == []


def test_ctrl_c_and_a_full_disk_during_quantize_leave_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = spawn_cli("quantize", "smollm2", "--type", "F16", "--allow-requantize", "-o", str(out / "f16.gguf"))
    deadline = time.monotonic() + 60
    while not any(out.iterdir()) and time.monotonic() < deadline:  # (its hidden file: the quantizer writes)
        time.sleep(0.02)
    assert [p.name for p in out.iterdir()][0].startswith(".f16.gguf.partial-")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"quantize interrupted: nothing was written" in err and b"Traceback" not in err
    assert list(out.iterdir()) == []
    assert str(out).encode() not in subprocess.run(["ps", "-eo", "args"], capture_output=True).stdout  # (its child)

    # A 40 MB file system: the check refuses before writing (F16 is ~270 MB); with --force, llama.cpp's write fails
    # when it is full, and nothing is left. (A private mount: unshare's own namespace, gone with it.)
    script = (f'mount -t tmpfs -o size=40m tmpfs "{out}" || exit 99; cd "{out}"; '
              f'{sys.executable} -m llmcli quantize smollm2 --type F16 --allow-requantize -o small/f16.gguf; echo "rc=$?"; '
              f'mkdir small; {sys.executable} -m llmcli quantize smollm2 --type F16 --allow-requantize -o small/f16.gguf; '
              f'echo "rc=$?"; {sys.executable} -m llmcli quantize smollm2 --type F16 --allow-requantize '
              '-o small/f16.gguf --force; echo "rc=$?"; ls -A small; echo listed')
    unshared = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    if unshared.returncode == 99 or "unshare:" in unshared.stderr:
        pytest.skip(f"no private tmpfs here: {unshared.stderr.strip()[:200]}")
    lines = unshared.stdout.split()
    assert lines[:3] == ["rc=2", "rc=6", "rc=6"] and lines[3:] == ["listed"], unshared.stdout + unshared.stderr
    assert "the folder" in unshared.stderr and "does not exist" in unshared.stderr
    assert "needs about 2" in unshared.stderr and "free" in unshared.stderr  # (the check: MiB needed, MiB free)
    assert "the disk filled up while writing f16.gguf: nothing was kept" in unshared.stderr


INDEPENDENT = """
import sys
import llama_cpp
import numpy as np

model, text_path, ctx, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(model_path=model, n_ctx=ctx, n_batch=ctx, logits_all=True, verbose=False, n_threads=1,
                      flash_attn=True)  # (as llmcli's "auto" runs it on a CPU: Q2_K's perplexity moves 1.4 % without)
tokens = llm.tokenize(open(text_path, encoding="utf-8").read().encode(), add_bos=True, special=False)
adds_bos = llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
rows, targets = [], []
for start in range(0, len(tokens) // ctx * ctx, ctx):
    chunk = tokens[start : start + ctx]
    if adds_bos:
        chunk[0] = llm.token_bos()
    llm.reset()
    llm.eval(chunk)
    logits = np.array(llm.scores[ctx // 2 : ctx - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    rows.append(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))
    targets.append(np.array(chunk[ctx // 2 + 1 :]))
np.savez(out, rows=np.concatenate(rows), targets=np.concatenate(targets))
"""


def _reference_numbers(model: Path, text: Path, ctx: int, tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Independently of llmcli: llama.cpp's logits for every position through llama-cpp-python's high-level API,
    chunked as llama-perplexity does (chunks of ctx tokens, each alone; the BOS first where the model adds one; the
    second half scored): (log-softmax rows [positions, vocab], the actual next tokens). In a process of its own: a
    process that ran llama.cpp's thread pool cannot fork the suite's CLI runs (OpenMP is not fork-safe)."""
    out = tmp_path / f"{model.stem}-{ctx}.npz"
    subprocess.run([sys.executable, "-c", INDEPENDENT, str(model), str(text), str(ctx), str(out)], check=True,
                   timeout=120)
    with np.load(out) as data:
        return data["rows"], data["targets"]


def test_eval_quality_agrees_with_an_independent_computation(smollm2, ladder, text, tmp_path):
    """Q2_K (made by `quantize`) against the tests' Q4_0 copy: perplexity within 1 % and mean KL divergence within 5 %
    of numpy over llama.cpp's full logits; the kept reference serves the next candidate (a quantized KV cache's loss);
    --json has the issue's fields."""
    candidate = ladder["Q2_K"]
    result = run_cli("eval", "quality", "-m", str(candidate), "-r", str(smollm2), "--text", str(text), "-c", str(CTX),
                     "--json")
    assert result.code == 0, result.stderr
    measured = json.loads(result.stdout)
    assert measured["reference_kept"] is False and measured["interrupted"] is False
    assert {"perplexity", "reference_perplexity", "kld", "top1_agreement", "tokens_scored"} <= set(measured)
    assert set(measured["kld"]) >= {"mean", "median", "p99", "max"}

    ref_rows, targets = _reference_numbers(smollm2, text, CTX, tmp_path)
    cand_rows, cand_targets = _reference_numbers(candidate, text, CTX, tmp_path)
    assert np.array_equal(targets, cand_targets) and measured["tokens_scored"] == len(targets) == 2 * 63
    picked = np.arange(len(targets))
    perplexity = math.exp(-cand_rows[picked, targets].mean())
    reference_perplexity = math.exp(-ref_rows[picked, targets].mean())
    kld = full_kld(ref_rows, cand_rows)
    assert measured["perplexity"] == pytest.approx(perplexity, rel=0.01)
    assert measured["reference_perplexity"] == pytest.approx(reference_perplexity, rel=0.01)
    assert measured["kld"]["mean"] == pytest.approx(kld.mean(), rel=0.05)  # (top 128 + 128 drawn from the rest)
    agreement = (cand_rows.argmax(axis=1) == ref_rows.argmax(axis=1)).mean()
    assert measured["top1_agreement"] == pytest.approx(agreement, abs=0.01)
    print(f"\nK=128 against the full KL divergence: {measured['kld']['mean']:.6f} vs {kld.mean():.6f} "
          f"({100 * (measured['kld']['mean'] / kld.mean() - 1):+.2f} %)")

    shown = run_cli("eval", "quality", "-m", str(smollm2), "-r", str(smollm2), "--text", str(text), "-c", str(CTX),
                    "--kv-type", "q4_0")  # (the same weights, a quantized KV cache: its loss alone)
    assert shown.code == 0, shown.stderr
    lines = {line[:16].strip(): line[16:].strip() for line in shown.stdout.splitlines()}
    assert lines["model"].endswith("(its KV cache q4_0)") and lines["reference"].startswith("kept from an earlier pass")
    assert float(lines["KL divergence"].split()[1]) > 0 and float(lines["top-1 agreement"].split()[0]) < 100
    assert "cores" in lines["machine"] and "llama-cpp-python" in lines["machine"]

    other = run_cli("eval", "quality", "-m", "gemma3-270m", "-r", str(smollm2), "--text", str(text), "-c", str(CTX))
    assert other.code == 2 and "tokenizes the text differently from the reference" in other.stderr


def test_divergence_rises_and_agreement_falls_as_bits_fall(ladder, isolated_env, smollm2, text):
    """F16 (the reference) -> Q8_0 -> Q4_0 (the tests' copy) -> Q2_K, each made by `llmcli quantize`."""
    _into_store(ladder, isolated_env)
    figures = {}
    for name in ("smollm2:q8_0", str(smollm2), "smollm2:q2_k"):
        result = run_cli("eval", "quality", "-m", name, "-r", "smollm2:f16", "--text", str(text), "-c", str(CTX),
                         "--json")
        assert result.code == 0, result.stderr
        figures[name] = json.loads(result.stdout)
    kld = [f["kld"]["mean"] for f in figures.values()]
    top1 = [f["top1_agreement"] for f in figures.values()]
    assert kld == sorted(kld) and kld[0] < kld[1] / 5 and kld[1] < kld[2], figures
    assert top1 == sorted(top1, reverse=True), figures
    assert [f["reference_kept"] for f in figures.values()] == [False, True, True]


@pytest.mark.long
def test_the_same_on_gemma3_270m(gemma3, tmp_path_factory, isolated_env):
    """Gemma-3-270M (a 262k vocabulary: each pass ~3 s here, so one chunk of 128): the packaged Q4_K_M the reference,
    requantized by `llmcli quantize` to Q8_0 (its values kept, nearly) and Q2_K: KLD rises and top-1 agreement falls
    (measured here 0.006 / 0.49 and 94 / 59 % of 63 tokens: the gap many tokens wide; SmolLM2's ladder above starts
    from F16 and has three steps)."""
    made = _quantized(tmp_path_factory, str(gemma3), "gemma3-270m", ("Q8_0", "Q2_K"))
    _into_store(made, isolated_env, "gemma3-270m")
    text = isolated_env / "gemma.txt"
    text.write_text(default_text()[:700], encoding="utf-8")
    figures = []
    for type_name in ("q8_0", "q2_k"):
        result = run_cli("eval", "quality", "-m", f"gemma3-270m:{type_name}", "-r", str(gemma3), "--text", str(text),
                         "-c", "128", "--json")
        assert result.code == 0, result.stderr
        figures.append(json.loads(result.stdout))
    kld = [f["kld"]["mean"] for f in figures]
    top1 = [f["top1_agreement"] for f in figures]
    assert kld[0] < kld[1] / 5 and top1[0] > top1[1], figures
    assert figures[0]["tokens_scored"] == 63 and [f["reference_kept"] for f in figures] == [False, True], figures


def test_quant_advise_measures_every_file_marks_the_front_picks_and_resumes(ladder, isolated_env, smollm2, serve_hub):
    text = isolated_env / "short.txt"  # (~140 tokens: two chunks of 64)
    text.write_text(default_text()[:620], encoding="utf-8")
    args = ["quant", "advise", "-m", "smollm2", "--here-only", "--text", str(text), "--eval-ctx", "64",
            "--repetitions", "1", "-p", "32", "-n", "4", "-c", "2048"]
    kept = isolated_env / "cache" / "quality" / "advise"
    refused = run_cli(*args, "--make", "Q2_K")  # (the highest precision here is the packaged Q4_1: it says so)
    assert refused.code == 2 and "smollm2 (Q4_1): making Q2_K from it requantizes" in refused.stderr
    a_file = run_cli("quant", "advise", "-m", str(smollm2), "--save")  # (an alias is a name: a path runs as itself)
    assert a_file.code == 2 and "--save makes the pick what a model's name runs" in a_file.stderr
    _into_store({"F16": ladder["F16"]}, isolated_env)
    interrupted = spawn_cli(*args, "--make", "q2_k", "--json")  # (made from the F16 into the store first)
    deadline = time.monotonic() + 120
    while not (kept.is_dir() and any(kept.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    interrupted.send_signal(signal.SIGINT)  # after the first candidate's figures are kept
    out, err = interrupted.communicate(timeout=120)
    assert interrupted.returncode == 130, err
    assert json.loads(out)["interrupted"] is True
    assert (isolated_env / "cache" / "quantized" / "smollm2" / "Q2_K.gguf").is_file()

    result = run_cli(*args, "--json")
    assert result.code == 0, result.stderr
    advice = json.loads(result.stdout)
    rows = {row["name"]: row for row in advice["candidates"]}
    assert set(rows) == {"smollm2", "smollm2:f16", "smollm2:q2_k"} and advice["reference"] == "smollm2:f16"
    assert sum(row["kept"] for row in rows.values()) >= 1  # what the interrupted advise measured, resumed
    for row in rows.values():
        assert {"size_bytes", "memory_bytes", "fits", "prefill_tokens_per_s", "decode_tokens_per_s", "kld_mean",
                "top1_agreement", "pareto"} <= set(row)
        assert row["memory_bytes"] > row["size_bytes"] and row["fits"] and row["decode_tokens_per_s"] > 0
    assert rows["smollm2:f16"]["kld_mean"] == 0 and rows["smollm2:f16"]["top1_agreement"] == 1
    assert rows["smollm2"]["kld_mean"] < rows["smollm2:q2_k"]["kld_mean"]  # (the F16 is the Q4_1's values)
    assert rows["smollm2:f16"]["pareto"]  # (none is closer)
    fastest = max(rows.values(), key=lambda r: r["decode_tokens_per_s"])
    assert fastest["pareto"]  # (none is faster)
    assert advice["pick"] in rows and "the fastest decode" in advice["why"] or "closest" in advice["why"]
    assert all(row["kld_mean"] <= 0.05 for row in rows.values() if row["name"] == advice["pick"]) or \
        "no candidate" in advice["why"]

    serve_hub({"test/SmolLM2-GGUF": {"SmolLM2-Q4_0.gguf": smollm2, "SmolLM2-Q2_K.gguf": ladder["Q2_K"]}})
    listed = run_cli(*args, "--repo", "test/SmolLM2-GGUF", "--json")  # (Q2_K is here: only Q4_0 is new)
    assert listed.code == 0, listed.stderr
    hub_rows = [row for row in json.loads(listed.stdout)["candidates"] if not row["here"]]
    assert [(r["name"], r["size_bytes"], r["pareto"]) for r in hub_rows] == [
        ("test/SmolLM2-GGUF:Q4_0", smollm2.stat().st_size, False)] and "decode_tokens_per_s" not in hub_rows[0]

    picture = isolated_env / "advice.svg"
    table = run_cli(*args, "--repo", "test/SmolLM2-GGUF", "--download", "--max-kld", "0", "--save", "--plot",
                    str(picture))
    assert table.code == 0, table.stderr
    assert "test/SmolLM2-GGUF:Q4_0" in table.stdout and "listed on the Hub" not in table.stdout  # (fetched, measured)
    assert "pick: smollm2:f16" in table.stdout and "saved: -m smollm2 runs smollm2:f16" in table.stdout
    assert "front" in table.stdout and "DECODE T/S" in table.stdout and "cores" in table.stdout
    assert f"plot: {picture} (1 panel)" in table.stderr and "quality against speed" in picture.read_text()
    shown = run_cli("show", "smollm2", "--json")  # (the alias --save wrote)
    assert json.loads(shown.stdout)["quant"] == "F16"
    shutil.rmtree(kept)


def test_a_text_too_large_or_not_utf8_is_refused_before_any_model_loads(tmp_path):
    """--text reaches llama.cpp's tokenizer: bounded (16 MiB) and UTF-8, refused in one line before anything loads."""
    large = tmp_path / "large.txt"
    with large.open("wb") as handle:
        handle.truncate(16 * 2**20 + 1)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    for path, words in ((large, "larger than 16 MiB"), (latin, "not UTF-8")):
        for args in (("eval", "quality", "-m", "smollm2", "-r", "smollm2"), ("quant", "advise", "-m", "smollm2")):
            refused = run_cli(*args, "--text", str(path))
            assert refused.code == 2 and f"--text {path}: {words}" in refused.stderr, refused.stderr


def test_ctrl_c_during_a_candidate_s_speed_measure_ends_advise_at_once(smollm2, isolated_env, tmp_path):
    """Ctrl-C while a candidate's speed is measured (minutes of decoding here: 20 runs of 4,096 tokens) ends `quant
    advise` at once, as interrupted (it waited for the whole measure: the raw loop looks at no flag)."""
    text = isolated_env / "short.txt"
    text.write_text(default_text()[:620], encoding="utf-8")
    proc = spawn_cli("quant", "advise", "-m", str(smollm2), "--here-only", "--text", str(text), "--eval-ctx", "64",
                     "-p", "256", "-n", "4096", "--repetitions", "20", "--json")
    try:
        deadline = time.monotonic() + 120
        while _cpu_seconds(proc.pid) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # (3 s of CPU: past finding and hashing the file, well into decoding)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # (it would decode for minutes)
    assert proc.returncode == 130, err
    assert out, err.decode()[-600:]
    assert json.loads(out)["interrupted"] is True and b"Traceback" not in err


def _cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (its user and system time, /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_quant_advise_measures_the_model_s_files_in_other_tools_stores(ladder, isolated_env, smollm2):
    """Issue 59: advise's candidates include the same model in Ollama's store and LM Studio's folder (found by their
    shape, measured in place like the rest; the stores unchanged)."""
    import hashlib

    from test_elsewhere import blob, manifest, tree

    ollama = isolated_env / "ollama-models"
    (ollama / "blobs").mkdir(parents=True)
    digest = hashlib.sha256(ladder["Q8_0"].read_bytes()).hexdigest()
    manifest(ollama, "smol", "q8", [("model", blob(ollama, ladder["Q8_0"], digest), ladder["Q8_0"].stat().st_size)])
    lmstudio = isolated_env / "home" / ".lmstudio" / "models" / "someone" / "SmolLM2-GGUF"
    lmstudio.mkdir(parents=True)
    (lmstudio / "SmolLM2-Q2_K.gguf").symlink_to(ladder["Q2_K"])
    before = tree(ollama), tree(lmstudio)
    text = isolated_env / "short.txt"
    text.write_text(default_text()[:620], encoding="utf-8")
    result = run_cli("quant", "advise", "-m", str(smollm2), "--text", str(text), "--eval-ctx", "64", "--repetitions",
                     "1", "-p", "32", "-n", "4", "-c", "2048", "--json",
                     env={"OLLAMA_MODELS": str(ollama), "HOME": str(isolated_env / "home")})
    assert result.code == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["candidates"]}
    found = {name: row["type"] for name, row in rows.items() if name.startswith(("ollama:", "lmstudio:"))}
    assert sorted(found.values()) == ["Q2_K", "Q8_0"], rows.keys()
    for name in found:
        assert rows[name]["decode_tokens_per_s"] > 0 and rows[name]["kld_mean"] >= 0 and rows[name]["here"], rows[name]
    assert (tree(ollama), tree(lmstudio)) == before
