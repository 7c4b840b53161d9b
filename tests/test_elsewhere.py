"""GGUFs other tools keep, used in place: Ollama's store, LM Studio's folder, the standard Hugging Face cache.

Each layout is built in a temporary folder around the real SmolLM2 file (linked, not copied), as those tools
write it; the tests check what `run`, `list --all`, `show` and `rm` do with it, and that nothing is written there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fake_hub
import pytest
from conftest import run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def smollm2_sha256(smollm2: Path) -> str:
    return fake_hub.HASHES[smollm2]  # (hashed once, as the tests' models are: conftest)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` with its size and modification time: a store must not change."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def blob(root: Path, content: bytes | Path, digest: str | None = None) -> str:
    """A blob in Ollama's layout: named by the sha256 of `content` (or by `digest`, right or not)."""
    import hashlib

    if isinstance(content, Path):
        assert digest is not None
        (root / "blobs" / f"sha256-{digest}").symlink_to(content)
        return digest
    digest = digest or hashlib.sha256(content).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_bytes(content)
    return digest


def manifest(root: Path, name: str, tag: str, layers: list[tuple[str, str, int]]) -> None:
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}", "size": size}
        for kind, digest, size in layers]}))


@pytest.fixture
def ollama(tmp_path: Path, smollm2: Path, smollm2_sha256: str) -> Path:
    root = tmp_path / "ollama-models"
    (root / "blobs").mkdir(parents=True)
    size = smollm2.stat().st_size
    model = blob(root, smollm2, smollm2_sha256)
    params = json.dumps({"temperature": 0, "stop": ["<|im_end|>"], "num_ctx": 1024, "num_gpu": 99}).encode()
    layers = [("model", model, size), ("params", blob(root, params), len(params)),
              ("system", blob(root, b"Answer in one word."), 19), ("template", blob(root, b"{{ .Prompt }}"), 13)]
    manifest(root, "smol", "latest", layers)
    manifest(root, "smol", "missing", [("model", "ab" * 32, size)])
    wrong = "cd" * 32  # a blob whose content does not hash to its name
    blob(root, smollm2, wrong)
    manifest(root, "smol", "damaged", [("model", wrong, size)])
    return root


def test_an_ollama_model_runs_in_place_with_its_params(ollama: Path, tmp_path: Path):
    env = {"OLLAMA_MODELS": str(ollama)}
    before = tree(ollama)
    result = run_cli("run", "-m", "ollama:smol", "--json", "-n", "8", "Name a colour.", env=env)
    assert result.code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["model"] == "ollama:smol:latest" and record["text"]
    assert "not used: parameter num_gpu, its Go chat template" in result.stderr
    shown = json.loads(run_cli("config", "show", "--json", "-m", "ollama:smol:latest", env=env).stdout)["settings"]
    assert shown["temp"]["value"] == 0 and shown["ctx_size"]["value"] == 1024 and shown["temp"]["source"].startswith("model")
    assert shown["system"]["value"] == "Answer in one word." and shown["stop"]["value"] == ["<|im_end|>"]
    flagged = run_cli("run", "-m", "ollama:smol", "--temp", "0.5", "--seed", "1", "--json", "-n", "2", "hi", env=env)
    assert json.loads(flagged.stdout)["timings"]["seed"] == 1  # a flag still outranks the store's params
    listed = run_cli("list", "--all", "--json", env=env)
    names = {entry["name"]: entry for entry in json.loads(listed.stdout)}
    assert names["ollama:smol:latest"]["architecture"] == "llama"
    assert "ollama:smol:latest" not in {e["name"] for e in json.loads(run_cli("list", "--json", env=env).stdout)}
    refused = run_cli("rm", "-y", "ollama:smol", env=env)
    assert refused.code == 2 and "never removes another tool's files" in refused.stderr
    assert tree(ollama) == before  # nothing written, moved or removed in Ollama's store


@pytest.mark.parametrize("reference, code, fragment", [
    ("ollama:smol:missing", 3, "is missing"),
    ("ollama:smol:damaged", 5, "does not match its sha256 name"),
    ("ollama:nothing", 3, "is not in Ollama's store"),
    ("ollama:../../etc:latest", 2, "invalid Ollama model name"),
])
def test_broken_ollama_references_are_one_line_errors(ollama: Path, reference, code, fragment):
    result = run_cli("run", "-m", reference, "-n", "1", "hi", env={"OLLAMA_MODELS": str(ollama)})
    assert result.code == code, result.stderr
    assert fragment in result.stderr and "Traceback" not in result.stderr


def test_lm_studio_models_run_in_place(tmp_path: Path, smollm2: Path):
    home = tmp_path / "home"
    folder = home / ".lmstudio" / "models" / "bartowski" / "SmolLM2-135M-Instruct-GGUF"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct-Q4_0.gguf").symlink_to(smollm2)
    env = {"HOME": str(home)}
    for reference in ("lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF",
                      "lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_0.gguf"):
        result = run_cli("run", "-m", reference, "--json", "--temp", "0", "-n", "4", "hi", env=env)
        assert result.code == 0, result.stderr
        assert json.loads(result.stdout)["model"] == "lmstudio:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_0.gguf"
    moved = tmp_path / "elsewhere"
    (moved / "me" / "mine").mkdir(parents=True)
    (moved / "me" / "mine" / "model-Q4_0.gguf").symlink_to(smollm2)
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(moved)}))
    listed = {e["name"] for e in json.loads(run_cli("list", "--all", "--json", env=env).stdout)}
    assert "lmstudio:me/mine/model-Q4_0.gguf" in listed  # the folder LM Studio's settings name
    escape = run_cli("run", "-m", "lmstudio:../../x.gguf", "-n", "1", "hi", env=env)
    assert escape.code == 2 and "invalid LM Studio model path" in escape.stderr


def test_the_standard_hugging_face_cache_is_used_in_place_without_the_hub(tmp_path: Path, smollm2: Path,
                                                                           smollm2_sha256: str, isolated_env: Path):
    cache = tmp_path / "hf-hub"
    repo = cache / "models--someone--SmolLM2-135M-Instruct-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs" / smollm2_sha256).symlink_to(smollm2)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "SmolLM2-135M-Instruct-Q4_0.gguf").symlink_to(os.path.relpath(repo / "blobs" / smollm2_sha256, snapshot))
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}  # a Hub that cannot answer
    before = tree(cache)
    result = run_cli("run", "-m", "someone/SmolLM2-135M-Instruct-GGUF", "--json", "--temp", "0", "-n", "4", "hi", env=env)
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "someone/SmolLM2-135M-Instruct-GGUF:Q4_0"
    assert not (isolated_env / "cache" / "hub").exists()  # no second copy in llmcli's cache
    listed = {e["name"]: e["source"] for e in json.loads(run_cli("list", "--all", "--json", env=env).stdout)}
    assert listed["someone/SmolLM2-135M-Instruct-GGUF:Q4_0"].startswith("hf-cache:")
    assert tree(cache) == before
