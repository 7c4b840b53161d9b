"""Where llmcli keeps things and which environment variables it reads: the only place paths are computed."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "llmcli"


def cache_dir() -> Path:
    """Downloaded models (huggingface_hub's cache layout): $LLMCLI_CACHE_DIR or the platform cache dir."""
    return Path(os.environ.get("LLMCLI_CACHE_DIR") or user_cache_dir(APP))


def config_dir() -> Path:
    return Path(user_config_dir(APP))


def data_dir() -> Path:
    """Conversations and REPL history: $LLMCLI_DATA_DIR or the platform data dir."""
    return Path(os.environ.get("LLMCLI_DATA_DIR") or user_data_dir(APP))


def default_model() -> str | None:
    """The model used when no -m/--model is given ($LLMCLI_MODEL)."""
    return os.environ.get("LLMCLI_MODEL") or None


def debug() -> bool:
    """$LLMCLI_DEBUG=1 re-raises errors with their traceback."""
    return os.environ.get("LLMCLI_DEBUG", "") not in ("", "0")
