"""`llmcli embed` and `llmcli similar` on the real SmolLM2 (a chat model: mean pooling)."""

from __future__ import annotations

import io
import json

import numpy as np
from conftest import run_cli, spawn_cli

TEXTS = ["The cat sat on the mat.", "Dogs bark loudly at night.", "The kitten sleeps on the rug.",
         "Stock prices fell sharply today.", "A recipe for apple pie."]


def embed_lines(*args: str, texts: list[str] = TEXTS) -> list[dict]:
    result = run_cli("embed", *args, input="\n".join(texts) + "\n")
    assert result.code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_vectors_are_the_same_across_runs_and_batch_sizes():
    one = json.loads(run_cli("embed", TEXTS[0]).stdout)
    assert isinstance(one, list) and len(one) == 576 and all(isinstance(v, float) for v in one)
    together = embed_lines("--texts-per-pass", "32")
    alone = embed_lines("--texts-per-pass", "1")
    assert [r["index"] for r in together] == list(range(5)) and [r["text"] for r in together] == TEXTS
    for a, b in zip(together, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"], strict=True)) < 1e-4
    assert max(abs(x - y) for x, y in zip(one, together[0]["embedding"], strict=True)) < 1e-4
    normalized = json.loads(run_cli("embed", "--normalize", TEXTS[0]).stdout)
    assert abs(sum(v * v for v in normalized) - 1) < 1e-4


def test_similar_finds_a_text_itself_first(tmp_path):
    collection = tmp_path / "vectors.jsonl"
    collection.write_text("\n".join(json.dumps(r) for r in embed_lines()) + "\n")
    result = run_cli("similar", "--collection", str(collection), "--json", "-n", "3", TEXTS[2])
    assert result.code == 0, result.stderr
    ranked = json.loads(result.stdout)
    assert ranked[0]["text"] == TEXTS[2] and ranked[0]["score"] > 0.9999 and len(ranked) == 3
    assert ranked[0]["score"] >= ranked[1]["score"] >= ranked[2]["score"]
    plain = run_cli("similar", "--collection", str(collection), TEXTS[0]).stdout.splitlines()
    assert plain[0].endswith(TEXTS[0]) and len(plain) == 5
    wrong = run_cli("similar", "--collection", str(collection), "-m", "gemma3-270m", "cat")
    assert wrong.code == 2 and "dimensions" in wrong.stderr


def test_jsonl_in_bad_lines_become_error_records_and_the_rest_goes_on(tmp_path):
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"id": 1, "body": "first note"}\nnot json\n{"id": 3}\n{"id": 4, "body": "fourth note"}\n')
    result = run_cli("embed", "--input", str(notes), "--field", "body")
    assert result.code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[0]["id"] == 1 and len(records[0]["embedding"]) == 576 and records[3]["id"] == 4
    assert "not JSON" in records[1]["error"] and "no 'body' string" in records[2]["error"]
    assert "2 of 4 texts have an error record" in result.stderr


def test_texts_longer_than_the_context():
    long_text = "word " * 400
    cut = embed_lines("-c", "256", texts=["short text", long_text])
    assert "embedding" in cut[0] and "do not fit the context of 256" in cut[1]["error"]
    kept = embed_lines("-c", "256", "--truncate", texts=[long_text])
    assert kept[0]["tokens"] == 256 and len(kept[0]["embedding"]) == 576


def test_npy_is_one_float32_array(tmp_path):
    proc = spawn_cli("embed", "--format", "npy", input="\n".join(TEXTS), env={"LLMCLI_THREADS": "1"})
    out, err = proc.communicate(timeout=120)  # (bytes: an array, not text)
    assert proc.returncode == 0, err
    array = np.load(io.BytesIO(out))
    assert array.shape == (5, 576) and array.dtype == np.float32


def test_an_embedding_model_s_own_pooling_is_used(smollm2, tmp_path):
    """A GGUF that declares its pooling (as embedding models do) is pooled that way unless --pooling says otherwise."""
    from gguf_tools import U32, rewrite_metadata

    pooled = rewrite_metadata(smollm2, tmp_path / "last-pooled.gguf", strings={"llama.pooling_type": U32(3)})  # LAST
    own = json.loads(run_cli("embed", "-m", str(pooled), TEXTS[0]).stdout)
    last = json.loads(run_cli("embed", "-m", str(smollm2), "--pooling", "last", TEXTS[0]).stdout)
    mean = json.loads(run_cli("embed", "-m", str(smollm2), "--pooling", "mean", TEXTS[0]).stdout)
    assert max(abs(a - b) for a, b in zip(own, last, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(own, mean, strict=True)) > 1e-2


def test_embedding_nothing_is_an_error():
    too_long = run_cli("embed", "-c", "64", input="word " * 300)
    assert too_long.code == 6 and "do not fit" in too_long.stderr
    some = run_cli("embed", "-c", "64", input="short\n" + "word " * 300 + "\n")
    assert some.code == 0 and "1 of 2 texts have an error record" in some.stderr
