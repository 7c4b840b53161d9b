"""Where llmcli keeps things: the only place paths are computed (platformdirs, moved by environment variables).

Read at call time, never at import, so tests and `--cache-dir` can move them.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir, user_config_dir, user_data_dir

APP = "llmcli"


def cache_dir() -> Path:
    """Downloaded and assembled models: $LLMCLI_CACHE_DIR or the platform cache dir."""
    return Path(os.environ.get("LLMCLI_CACHE_DIR") or user_cache_dir(APP))


def hub_cache() -> Path:
    """huggingface_hub's cache layout (`models--OWNER--REPO/…`), inside the cache dir."""
    return cache_dir() / "hub"


def assembled_models_dir() -> Path:
    """Models assembled from chunk packages on first use."""
    return cache_dir() / "packages"


def prompt_cache_dir() -> Path:
    """Saved KV states of long prompts (the prompt cache), inside the cache dir."""
    return cache_dir() / "prompts"


# Other tools' model stores, read in place (never written): see llmcli/store/elsewhere.py.


def ollama_models_dir() -> Path:
    """Ollama's store: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def lmstudio_home() -> Path:
    """LM Studio's home (its settings.json names a moved models folder)."""
    return Path.home() / ".lmstudio"


def standard_hf_cache() -> Path:
    """The Hugging Face cache other tools share: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def config_file() -> Path:
    """The TOML config file: $LLMCLI_CONFIG or `<platform config dir>/config.toml`."""
    return Path(os.environ.get("LLMCLI_CONFIG") or Path(user_config_dir(APP)) / "config.toml")


def data_dir() -> Path:
    """Conversations, REPL history, the debug log: $LLMCLI_DATA_DIR or the platform data dir."""
    return Path(os.environ.get("LLMCLI_DATA_DIR") or user_data_dir(APP))


def answer_log_file() -> Path:
    """Every answer, recorded (SQLite): `llmcli logs`."""
    return data_dir() / "logs.db"


def conversations_dir() -> Path:
    return data_dir() / "conversations"


def chat_history_file() -> Path:
    return data_dir() / "chat_history"


def hash_memo_file() -> Path:
    """sha256 of model files, remembered by (path, size, mtime)."""
    return data_dir() / "hashes.json"


def runtime_dir() -> Path:
    """Short-lived state of running processes (which llmcli processes are generating):
    `$XDG_RUNTIME_DIR/llmcli`, else `llmcli-UID` in the temporary dir (platformdirs warns there instead)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / APP
    import tempfile

    return Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}"


def debug_log() -> Path:
    return data_dir() / "logs" / "debug.log"


def debug() -> bool:
    """$LLMCLI_DEBUG=1 re-raises errors with their traceback."""
    return os.environ.get("LLMCLI_DEBUG", "") not in ("", "0")


def warm_servers_dir() -> Path:
    """The Unix sockets of the private servers `--keep-alive` keeps warm: $LLMCLI_RUNTIME_DIR or the platform's
    runtime dir (only the user may enter it)."""
    given = os.environ.get("LLMCLI_RUNTIME_DIR")
    if given:
        return Path(given) / "servers"
    import warnings

    from platformdirs import user_runtime_dir

    with warnings.catch_warnings():  # no XDG_RUNTIME_DIR: platformdirs warns and uses /tmp/runtime-UID (0700)
        warnings.simplefilter("ignore")
        return Path(user_runtime_dir(APP)) / "servers"
