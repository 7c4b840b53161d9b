"""Where llmcli keeps things: the only place paths are computed (platformdirs, moved by environment variables).

Read at call time, never at import, so tests and `--cache-dir` can move them.
"""

from __future__ import annotations

import errno
import os
import stat
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


def quantized_dir() -> Path:
    """Models made by `llmcli quantize` without -o: `quantized/NAME/TYPE.gguf`, named NAME:type."""
    return cache_dir() / "quantized"


def quality_cache_dir() -> Path:
    """`eval quality`'s references: a reference model's top log-probabilities over a text (a few MB each)."""
    return cache_dir() / "quality"


def prompt_cache_dir() -> Path:
    """Saved KV states of long prompts (the prompt cache), inside the cache dir."""
    return cache_dir() / "prompts"


# Other tools' model stores, read in place (never written): see llmcli/store/foreign_stores.py.


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
    """Short-lived state of running processes (which llmcli processes are generating, the warm servers' sockets):
    `$XDG_RUNTIME_DIR/llmcli`, else `llmcli-UID` in the temporary dir. Use it through `private_dir`: in a shared
    temporary dir another user may have made that name first."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / APP
    import tempfile

    return Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}"


class UnsafeDirectory(OSError):
    """A directory llmcli keeps its own state in is not this user's alone: another user made it, or it is a link."""


def private_dir(path: Path, top: Path) -> Path:
    """`path` as a directory only this user may use. Each directory from `top` (llmcli's own: `path` or an ancestor)
    down to `path` is made 0700, or, where it exists, checked: a directory, not a link, owned by this user (made 0700
    if it was not). UnsafeDirectory otherwise: nothing may be written through it. Missing ancestors of `top` are made
    0700 too (ancestors that exist are not llmcli's to judge)."""
    missing = [parent for parent in top.parents if not parent.exists()]
    for parent in reversed(missing):
        try:
            os.mkdir(parent, 0o700)
        except FileExistsError:
            pass
    below = [path, *path.parents]
    if top not in below:
        raise ValueError(f"{top} is not {path} or one of its parents")
    for directory in reversed(below[: below.index(top) + 1]):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        found = os.lstat(directory)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            raise UnsafeDirectory(errno.EPERM, "not a directory of this user's alone (another user's, or a link)",
                                  str(directory))
        if found.st_mode & 0o077:
            os.chmod(directory, 0o700)
    return path


def open_private(path: Path, flags: int) -> int:
    """A file descriptor for `path` (os.open's `flags`), never through a link at its name; created 0600."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def debug_log() -> Path:
    return data_dir() / "logs" / "debug.log"


def debug() -> bool:
    """$LLMCLI_DEBUG=1 re-raises errors with their traceback."""
    return os.environ.get("LLMCLI_DEBUG", "") not in ("", "0")


def warm_servers_dir() -> Path:
    """The Unix sockets of the private servers `--keep-alive` keeps warm: $LLMCLI_RUNTIME_DIR/servers, else `servers`
    in the runtime dir. Only through `private_warm_servers_dir` when anything is written there."""
    given = os.environ.get("LLMCLI_RUNTIME_DIR")
    return Path(given) / "servers" if given else runtime_dir() / "servers"


def private_warm_servers_dir() -> Path:
    """The warm servers' directory, made or checked (`private_dir`): UnsafeDirectory if another user has it."""
    folder = warm_servers_dir()
    return private_dir(folder, folder if os.environ.get("LLMCLI_RUNTIME_DIR") else runtime_dir())
