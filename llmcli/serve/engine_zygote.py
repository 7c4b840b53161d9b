"""How a model's engine process starts (`spawn_engine`) and ends (`kill`), and the zygote each one is forked from:
`python -m llmcli.serve.engine_child --zygote FD`, started when the server starts (`start`: its imports go on while
the server's do), single-threaded, llmcli's engine modules imported once. Once a model's engine has died, the zygote
keeps that model's weights (`KeptWeights`) until the model is unloaded (`release`): each later restart forks an engine
that has them already, instead of loading (and repacking) the file again. Standard library only: `serve` starts it
before importing anything heavy."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Protocol

MESSAGE_MAX = 16384  # one message to the zygote (a path is at most 4096 bytes)


@dataclass(frozen=True)
class KeptWeights:
    """A model's weights as its engines load them (the file and the load mode): what the zygote keeps loaded."""

    path: str
    mmap: bool
    mlock: bool

    def message(self, verb: str) -> bytes:
        return f"{verb} {json.dumps(asdict(self))}".encode()

    @classmethod
    def read(cls, text: str) -> KeptWeights:
        fields = json.loads(text)
        return cls(str(fields["path"]), bool(fields["mmap"]), bool(fields["mlock"]))


def start() -> None:
    """The server's zygote, started now (once)."""
    Zygote.here()


def fork(fd: int, keep: KeptWeights | None = None) -> ForkedEngine | None:
    """An engine's process forked with the socket FD (None: no zygote could do it); with `keep`, the zygote loads those
    weights first (unless it has them) and keeps them for the engines it forks later."""
    zygote = Zygote.here()
    if zygote is None:
        return None
    try:
        return zygote.fork(fd, keep)
    except (OSError, queue.Empty):
        Zygote.lost(zygote)
        return None


def release(keep: KeptWeights) -> None:
    """The zygote frees those weights (their model is unloaded), if it has them."""
    zygote = Zygote._current
    if zygote is not None:
        try:
            zygote.sock.send(keep.message("drop"))
        except OSError:
            pass


def spawn_zygote(command: list[str], fd: int) -> Any:
    """The zygote's process (`python -m llmcli.serve.engine_child --zygote FD`): spawned, never forked from this
    threaded server (the test suite's forked servers fork theirs here: tests/conftest.py)."""
    return subprocess.Popen(command, pass_fds=[fd], stdin=subprocess.DEVNULL, close_fds=True)


class ForkedEngine:
    """An engine the zygote forked: its exit status comes from the zygote (it is not this process's child)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def ended(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["llmcli.serve.engine_child"], timeout or 0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """One per server: a single-threaded process with llmcli's engine modules imported that forks each engine (a
    model's first, a restart, a model loaded on demand) — ~0.4 s of imports and a process start saved each time.
    Messages on its socket (a packet each): "spawn" or "spawn KEPT-WEIGHTS-JSON" (with the engine's socket) and "drop
    KEPT-WEIGHTS-JSON" in; "spawned PID", "exited PID CODE" lines out. It ends when the server does (its socket's end);
    an engine it forked ends by its own socket."""

    _current: Zygote | None = None
    _starting = threading.Lock()

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # (one message a packet)
        try:
            self.proc = spawn_zygote([sys.executable, "-m", "llmcli.serve.engine_child", "--zygote",
                                      str(theirs.fileno())], theirs.fileno())
        finally:
            theirs.close()
        self._lock = threading.Lock()  # one fork at a time
        self._forked: queue.Queue[int] = queue.Queue()
        self._children: dict[int, ForkedEngine] = {}
        self._exited: dict[int, int] = {}  # (an exit reported before its fork's answer was read)
        self._gone = False
        threading.Thread(target=self._read, name="llmcli-zygote", daemon=True).start()

    @classmethod
    def here(cls) -> Zygote | None:
        with cls._starting:
            if cls._current is None:
                try:
                    cls._current = Zygote()
                except OSError:
                    return None
            return cls._current

    @classmethod
    def lost(cls, zygote: Zygote) -> None:
        with cls._starting:
            if cls._current is zygote:
                cls._current = None
        zygote.sock.close()

    def fork(self, fd: int, keep: KeptWeights | None = None) -> ForkedEngine:
        with self._lock:
            if self._gone:
                raise OSError("the zygote is gone")
            socket.send_fds(self.sock, [keep.message("spawn") if keep is not None else b"spawn"], [fd])
            pid = self._forked.get(timeout=30 if keep is None else None)  # (the weights' load first: a long one)
            if pid < 0:
                raise OSError("the zygote is gone")
            with self._starting:
                child = self._children[pid] = ForkedEngine(pid)
                if pid in self._exited:
                    child.ended(self._exited.pop(pid))
            return child

    def _read(self) -> None:
        buffer = b""
        try:
            while chunk := self.sock.recv(4096):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    kind, *numbers = line.decode().split()
                    if kind == "spawned":
                        self._forked.put(int(numbers[0]))
                    elif kind == "exited":
                        pid, code = int(numbers[0]), int(numbers[1])
                        with self._starting:
                            child = self._children.pop(pid, None)
                            if child is None:
                                self._exited[pid] = code
                        if child is not None:
                            child.ended(code)
        except OSError:
            pass
        self._gone = True
        self._forked.put(-1)
        with self._starting:
            left, self._children = list(self._children.values()), {}
        for child in left:  # (their statuses are lost with the zygote: each ends, or has, by its own socket)
            child.ended(-signal.SIGKILL)


class EngineChild(Protocol):
    """What the supervisor needs of an engine's process (a Popen's)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def spawn_engine(command: list[str], fd: int, keep: KeptWeights | None = None) -> EngineChild:
    """An engine's process with the socket FD: forked by the server's zygote (llmcli's engine modules imported once,
    started with the first engine; `keep`: with those weights loaded), else `command` (`python -m
    llmcli.serve.engine_child FD`) started. The one place an engine starts."""
    forked = fork(fd, keep)
    if forked is not None:
        return forked
    return subprocess.Popen(command, pass_fds=[fd], stdin=subprocess.DEVNULL, close_fds=True)


def kill(proc: EngineChild) -> None:
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
