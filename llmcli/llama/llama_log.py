"""llama.cpp's process-wide state: initialisation, build information, and its own messages:
its log (forwarded with -v, last error kept for our messages) and what its C code writes
straight to stderr (captured where we need the reason)."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import llama_cpp


class LlamaLog:
    """Receives llama.cpp's log lines: forwards them to stderr when verbose, keeps the recent errors."""

    LEVEL_ERROR = 4
    KEPT = 4

    def __init__(self) -> None:
        self.verbose = False
        self.errors: list[str] = []
        self._line = ""
        self._callback = llama_cpp.llama_log_callback(self._on_log)  # referenced while installed
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes | None, user_data: object) -> None:
        try:
            message = (text or b"").decode("utf-8", "replace")
            if self.verbose:
                sys.stderr.write(message)
            if level == self.LEVEL_ERROR:
                self._line += message
                if self._line.endswith("\n"):
                    self.errors = [*self.errors, self._line.strip()][-self.KEPT:]
                    self._line = ""
        except BaseException:  # nothing may propagate into C: a Ctrl-C here is re-raised after the C call
            self.interrupted = True

    interrupted = False
    _multimodal = False

    def route_multimodal(self) -> None:
        """The multimodal library (mtmd, CLIP) logs through its own setting: routed here too, once."""
        if not self._multimodal:
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_log_set(self._callback, ctypes.c_void_p(0))
            mtmd_cpp.mtmd_helper_log_set(self._callback, ctypes.c_void_p(0))
            self._multimodal = True

    def raise_if_interrupted(self) -> None:
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    def take_error(self) -> str:
        """The most specific recent error: the first of the chain (later lines say only that it failed)."""
        errors, self.errors = self.errors, []
        return errors[0] if errors else ""


_log: LlamaLog | None = None


def llama_backend() -> LlamaLog:
    """Initialise llama.cpp once, with its log routed through LlamaLog."""
    global _log
    if _log is None:
        _log = LlamaLog()
        llama_cpp.llama_backend_init()
    return _log


@contextmanager
def stderr_captured() -> Iterator[Callable[[], str]]:
    """Collect what C code writes to file descriptor 2 meanwhile; the callable returns it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode("utf-8", "replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def build_info() -> dict[str, str]:
    """llama-cpp-python's version and llama.cpp's CPU feature line, for benchmark records."""
    llama_backend()
    return {
        "llama_cpp_python": getattr(llama_cpp, "__version__", "unknown"),
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
    }
