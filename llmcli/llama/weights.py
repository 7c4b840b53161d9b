"""A model's weights, loaded by llama.cpp: the one place they are loaded (`load_weights`) and freed (`Weights.free`),
and the weights a process keeps loaded for the engines it makes later (`keep_loaded`).

Kept weights are shared by every engine of the process — and, copy-on-write, of every process forked from it — that
loads the same file in the same load mode: a parent that forks many short-lived answerers (a test suite's CLI runs)
loads a model once instead of once a child. An engine never frees kept weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from llmcli.errors import IntegrityError
from llmcli.interrupt import Cancellation
from llmcli.llama.engine_config import EngineConfig
from llmcli.llama.llama_log import llama_backend
from llmcli.llama.weight_buffers import use_extra_buffer_types


@dataclass
class Weights:
    """llama.cpp's model (`pointer`); `owned`: this engine loaded it and frees it, else it is kept by the process."""

    pointer: Any
    owned: bool

    def free(self) -> None:
        if self.owned and self.pointer:
            llama_cpp.llama_model_free(self.pointer)
        self.pointer = None


def load_mode(config: EngineConfig) -> int:
    return {
        (True, False): llama_cpp.LLAMA_LOAD_MODE_AUTO,  # llama.cpp picks mmap on the CPU
        (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
        (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
        (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
    }[(config.mmap, config.mlock)]


_KEPT: dict[tuple[Path, int], Any] = {}  # (resolved path, load mode) -> the weights kept loaded


def keep_loaded(path: Path, config: EngineConfig | None = None) -> None:
    """Load `path`'s weights now (the header already checked by the caller) and keep them for this process's later
    engines of the same load mode, until it exits."""
    config = config or EngineConfig()
    key = (path.resolve(), load_mode(config))
    if key not in _KEPT:
        _KEPT[key] = load_weights(path, config, Cancellation(), keep=False).pointer


def release_kept(path: Path) -> None:
    """Free the weights this process keeps for `path` (any load mode): a later engine loads the file again. (An engine
    never uses kept weights it did not inherit: a forked process's copy is its own.)"""
    resolved = path.resolve()
    for key in [key for key in _KEPT if key[0] == resolved]:
        llama_cpp.llama_model_free(_KEPT.pop(key))


def kept_model(path: Path) -> Any | None:
    """The model this process keeps loaded from `path` (any load mode), or None: its vocabulary is there already."""
    resolved = path.resolve()
    return next((pointer for (kept, _), pointer in _KEPT.items() if kept == resolved), None)


def load_weights(path: Path, config: EngineConfig, cancel: Cancellation, keep: bool = True) -> Weights:
    """The weights of `path` (whose header was checked): the kept ones when the process keeps them (`keep`), else
    loaded now; Ctrl-C (`cancel`) aborts a load at once; IntegrityError when llama.cpp cannot load the file."""
    mode = load_mode(config)
    if keep and (kept := _KEPT.get((path.resolve(), mode))):
        return Weights(kept, owned=False)
    log = llama_backend()
    params = llama_cpp.llama_model_default_params()
    # Called as loading proceeds; returning False aborts it: Ctrl-C during a load is honoured at once.
    progress = llama_cpp.llama_progress_callback(lambda _progress, _data: not cancel)
    params.progress_callback = progress
    params.load_mode = mode
    params.use_extra_bufts = use_extra_buffer_types()  # (not AMX's: weight_buffers)
    weights = Weights(llama_cpp.llama_model_load_from_file(str(path).encode(), params), owned=True)
    log.raise_if_interrupted()
    if cancel:
        weights.free()
        cancel.raise_for_signal()
    if not weights.pointer:
        raise IntegrityError(
            f"llama.cpp could not load {path}: {log.take_error() or 'unknown reason'}",
            hint="Check that the file is a complete GGUF model supported by this llama.cpp build.",
        )
    return weights
