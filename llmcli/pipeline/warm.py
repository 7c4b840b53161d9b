"""`--keep-alive`: `run`, `chat` and `--batch` answer through a private `llmcli serve` of their model, started in the
background on first use and kept warm — no daemon to manage, and the next run skips the load.

The server listens on a Unix socket in the runtime dir (the directory 0700, the socket 0600: no TCP port, no one
else), one per model and load settings (a server of another llmcli version has another socket), and exits once its
model has been idle for the keep-alive, removing its socket. A dead socket is removed and a new server started; a
server that will not start leaves the answer to this process (one notice). Speaks HTTP only: no llama.cpp here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx2

from llmcli import __version__, paths, reaper
from llmcli.answer.answerer import ServedFacts
from llmcli.config import settings
from llmcli.embed.embedded import Embedded
from llmcli.errors import LlmcliError
from llmcli.prompt import read_template_file
from llmcli.remote.client import socket_transport
from llmcli.store import memory
from llmcli.units import parse_keep_alive

if TYPE_CHECKING:
    from llmcli.store.gguf_header import GGUFHeader

# What the server fixes when it loads the model: sent once, when it starts (each request sends the rest).
LOAD_SETTINGS = ("ctx_size", "threads", "batch_size", "mlock", "mmap", "flash_attn", "kv_type", "speculate",
                 "draft_model", "draft_max", "tool_format", "special", "mmproj")
START_TIMEOUT_S = 300.0  # a large model's first load (page cache cold, weights repacked)
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its terminating NUL, on Linux)

_LISTENING_HERE: set[Path] = set()  # the sockets this process serves on (`serve --socket`): never asked by itself


Health = dict[str, Any]  # a server's /health, as JSON gives it: model(s), pid, slots, version


@dataclass(frozen=True)
class WarmServer:
    socket: Path
    model: str  # the name its model answers to
    pid: int
    start_s: float | None = None  # seconds this run waited for it to start and load its model; None: it was running
    notices: tuple[str, ...] = ()  # what its model's load said (no chat template, …): said with each answer, as here
    thinking_switch: bool | None = None  # whether its chat template reads --think (None: it has none, or did not say)
    facts: ServedFacts | None = None  # its context and chat template, as it says them


def socket_for(model_path: Path, effective: settings.Settings, template_file: Path | None,
               projector: Path | None = None, draft: Path | None = None) -> Path:
    """The socket of the server for this model file as it is now (replaced or rewritten — `quantize --force`, a new
    download — it is another server's: one started before serves the old weights), its projector and its draft
    model's file (the same: found by name, the server would keep the file it loaded), the text of
    --chat-template-file (read by the server when it starts: an edited file is another server's) and these load
    settings (and this llmcli), and the CPUs this process may run on: a server started from it keeps them (a run
    under `taskset -c 0` is answered on that CPU, with one thread, not by a server started without it)."""
    template = "" if template_file is None else hashlib.sha256(read_template_file(template_file).encode()).hexdigest()
    identity = json.dumps([__version__, _file_version(model_path), _file_version(projector), _file_version(draft),
                           template, {name: effective[name] for name in LOAD_SETTINGS}, _cpus()],
                          sort_keys=True, default=str)
    return paths.warm_servers_dir() / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.sock"


def _cpus() -> list[int]:
    """The CPUs this process may run on (taskset, cpusets), where the system says."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _file_version(path: Path | None) -> list[object]:
    """A file as it is now: where it resolves to, and its device, inode, size and modification time (empty where it
    cannot be read: the server's load says why)."""
    if path is None:
        return []
    resolved = path.resolve()
    try:
        found = resolved.stat()
    except OSError:
        return [str(resolved)]
    return [str(resolved), found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns]


def health(socket: Path, timeout: float = 2.0) -> Health | None:
    """What the server on `socket` says of itself, or None if none answers there."""
    try:
        with httpx2.Client(transport=socket_transport(str(socket)), timeout=timeout) as http:
            found: Health = http.get("http://llmcli/health").json()
            return found
    except (httpx2.HTTPError, OSError, ValueError):
        return None


def served_at(url: str) -> Health:
    """What the `llmcli serve` at `url` says of itself (its /health; its pid and paths only given $LLMCLI_API_KEY);
    LlmcliError if it does not answer as one."""
    base = url.rstrip("/").removesuffix("/v1")
    key = os.environ.get("LLMCLI_API_KEY")  # with the server's key, its pid and the models' paths too
    try:
        found: Health = httpx2.get(f"{base}/health", timeout=10,
                                           headers={"Authorization": f"Bearer {key}"} if key else None).json()
    except (httpx2.HTTPError, ValueError) as exc:
        raise LlmcliError(f"{base}/health did not answer: {exc}") from None
    if "models" not in found:
        raise LlmcliError(f"{base} is not an llmcli serve (its /health lists no models)")
    return found


def listening_here(socket: Path) -> None:
    """`socket` is this process's own (`serve --socket` bound it before loading its model): `running()` leaves it out.
    While the model loads, nothing answers there, and the load's memory check would wait on its own socket for
    health's whole timeout (every warm server's start took 2 s longer)."""
    _LISTENING_HERE.add(Path(os.path.abspath(socket)))


def own_sockets() -> tuple[Path, ...]:
    """The sockets this process serves on (its engines' processes leave them out too: `listening_here`)."""
    return tuple(sorted(_LISTENING_HERE))


def running() -> list[tuple[Path, Health]]:
    """The warm servers of this user: each socket that answers, with its health (this process's own left out)."""
    folder = paths.warm_servers_dir()
    found = []
    try:
        mine = folder.is_dir() and paths.private_warm_servers_dir() == folder
    except OSError:  # another user's folder: none of its sockets is this user's server
        mine = False
    for socket in sorted(folder.glob("*.sock")) if mine else []:
        if Path(os.path.abspath(socket)) in _LISTENING_HERE:
            continue
        state = health(socket)
        if state is not None:
            found.append((socket, state))
    return found


def ensure(model_path: Path, effective: settings.Settings, template_file: Path | None,
           reference: str | None = None, projector: Path | None = None, draft: Path | None = None,
           fits: Callable[[GGUFHeader], None] | None = None) -> WarmServer:
    """The warm server of this model, started if none answers (LlmcliError if it will not start). `reference`: what
    the server's -m is, when the user gave none (an installed model's short name: what `list` and `ps` call it);
    `projector`: the one found with the model (another one, or none, is another server); `draft`: the draft model's
    file, where one drafts; `fits`: the server's memory check, made here before it starts (the same words, without
    starting a process that would refuse)."""
    socket = socket_for(model_path, effective, template_file, projector, draft)
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:
        raise LlmcliError(f"the runtime dir's path is too long for a Unix socket ({socket}: more than "
                          f"{MAX_SOCKET_PATH} bytes); set LLMCLI_RUNTIME_DIR to a shorter one")
    state = health(socket)
    start_s = None
    if state is None:
        from llmcli.store.gguf_header import read_header

        header = read_header(model_path)  # the pre-flight checks here, in milliseconds: a broken file, or a model that
        if fits is not None:  # does not fit, starts no server (it took 1.2 s to refuse; the lock's file is not made)
            fits(header)
    if state is None or state.get("version") != __version__:
        with starting(socket):  # one start at a time: a second run waits for the first one's server
            state = health(socket)
            if state is None:
                make_room(effective["max_models"])
                started = time.perf_counter()
                state = _start(socket, model_path, effective, template_file, reference)
                start_s = time.perf_counter() - started
    served: Any = next(iter(state.get("models") or []), {})
    notices = tuple(n for n in served.get("notices") or () if isinstance(n, str)) if isinstance(served, dict) else ()
    served = served if isinstance(served, dict) else {}
    switch, n_ctx = served.get("thinking_switch"), served.get("n_ctx")
    sha, system = served.get("template_sha256"), served.get("template_system")
    facts = ServedFacts(n_ctx, sha if isinstance(sha, str) else None, system if isinstance(system, str) else None) \
        if type(n_ctx) is int and n_ctx > 0 else None
    return WarmServer(socket, str(state.get("model") or model_path.stem), int(state.get("pid") or 0), start_s, notices,
                      switch if isinstance(switch, bool) else None, facts)


def serve_installed() -> bool:
    """Whether `llmcli serve`'s dependencies (the serve extra) are here: a warm server needs them."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("starlette", "uvicorn", "sse_starlette"))


def first_start_notice(model: str, keep_alive: str) -> str | None:
    """The one line said the first time a warm server starts for this user (None ever after): what stays loaded,
    for how long, and how to stop it or turn it off. A marker in the data dir remembers it was said."""
    if not _first_time(paths.data_dir() / "warm-servers-explained"):
        return None
    kept = "until `llmcli stop`" if parse_keep_alive(keep_alive) is None else f"for {keep_alive} after each answer"
    return (f"{model} stays loaded {kept}, so the next run starts at once: `llmcli ps` shows it, `llmcli stop` "
            "unloads it, --keep-alive 0 (or keep_alive = \"0\" in the config file, or LLMCLI_KEEP_ALIVE=0) turns this off")


def _first_time(marker: Path) -> bool:
    """Whether `marker` is made now (False: it was there); a data dir that cannot be written counts as a first time
    each time (said again rather than never)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def without_serve(asked: bool, instead: str) -> str | None:
    """None when a warm server can run here; else why not, to be said when a keep-alive was asked for ("" when warm
    was only the default: then the answer is quietly this process's). `instead`: what is done instead."""
    if serve_installed():
        return None
    if not asked:
        return ""
    from llmcli.config.install_hint import install_hint

    return f"a warm server needs the serve extra ({install_hint('serve')}); {instead} in this process"


def server_pids(state: Health) -> list[int]:
    """The processes of a server (as its /health tells its key's holder): its own, and each model's engine's and
    embedding process's."""
    engines = [int(((m.get("slots") or {}).get("engine") or {}).get("pid") or 0) for m in state.get("models") or []]
    embedding = [int(m.get("embedding_pid") or 0) for m in state.get("models") or []]
    return [pid for pid in (int(state.get("pid") or 0), *engines, *embedding) if pid > 0]


def held_by_others(model_path: Path) -> int:
    """The memory this user's warm servers hold that MemAvailable counts as free (their mapped models), leaving out a
    server of `model_path` itself (its pages are the ones this load maps too)."""
    held = 0
    for _, state in running():
        paths_served = {m.get("path") for m in state.get("models", [])}
        if str(model_path.resolve()) not in paths_served:
            held += sum(memory.mapped_file_bytes(pid) for pid in server_pids(state))
    return held


def make_room(max_models: int) -> None:
    """Before a warm server starts: while `max_models` or more run, stop the one idle the longest (one answering
    is never stopped); launch servers are not counted."""
    servers = running()
    count, idle = len(servers), []
    for socket, state in servers:
        served = state.get("models") or [{}]
        if not any(m.get("in_flight") for m in served):
            idle.append((min(float(m.get("idle_s") or 0.0) for m in served), socket, state))
    for _, socket, state in sorted(idle, key=lambda found: found[0], reverse=True):
        if count < max_models:
            break
        if stop(socket, state):
            count -= 1


@contextmanager
def starting(server: Path) -> Iterator[None]:
    """One start at a time of the server at `server` (a socket, or a launch server's record): its lock, in a directory
    that is this user's alone (paths.private_dir); LlmcliError otherwise."""
    try:
        paths.private_warm_servers_dir()
        lock = paths.open_private(server.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT)
    except OSError as exc:
        raise LlmcliError(f"the warm servers' directory cannot be used: {exc.filename}: {exc.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def _start(socket: Path, model_path: Path, effective: settings.Settings, template_file: Path | None,
           reference: str | None) -> Health:
    keep_alive = str(effective["keep_alive"])
    command = [sys.executable, "-m", "llmcli", "serve", "--socket", str(socket), "-m", effective["model"] or
               reference or str(model_path), "--keep-alive", keep_alive, "--exit-when-idle", "-P", "1", "--queue", "64",
               "--max-models", "1"]
    if template_file is not None:
        command += ["--chat-template-file", str(template_file)]
    environment = {**os.environ, **{settings.SETTINGS[name].env: _env_value(effective[name])
                                    for name in LOAD_SETTINGS if effective[name] is not None}}
    environment.pop("LLMCLI_KEEP_ALIVE", None)
    log = socket.with_suffix(".log")
    log.unlink(missing_ok=True)  # (a link planted at its name goes, never followed)
    with os.fdopen(paths.open_private(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as output:
        process = spawn_server(command, environment, output.fileno())
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = health(socket, timeout=1.0)
        if state is not None:
            return state
        if process.poll() is not None:
            reason = " ".join(log.read_text(errors="replace").split()[-40:]) or f"exit {process.returncode}"
            for leftover in (socket, log, socket.with_suffix(".lock")):  # (it bound its socket before it failed: no
                leftover.unlink(missing_ok=True)  # one answers there; its log is read; the lock is this start's)
            raise LlmcliError(f"the warm server did not start: {reason}")
        time.sleep(0.05)
    process.terminate()
    raise LlmcliError(f"the warm server did not answer within {START_TIMEOUT_S:.0f} s")


def spawn_server(command: list[str], environment: dict[str, str], log_fd: int) -> ServerProcess:
    """A warm server's process, started detached: a session of its own, stdin and stdout on /dev/null, stderr into
    its log. The one place one starts (the test suite's forked CLI runs fork theirs here: tests/conftest.py)."""
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_fd,
                            env=environment, start_new_session=True, close_fds=True)


class ServerProcess(Protocol):
    """What `_start` needs of a server's process while it waits for it (a Popen's)."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def stop(socket: Path, state: Health, timeout: float = 30.0) -> bool:
    """End a warm server (SIGTERM: its answers finish first); whether it is gone, its socket with it."""
    import signal

    pid = int(state.get("pid") or 0)
    if pid <= 0:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        socket.unlink(missing_ok=True)
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not reaper.alive(pid):  # (exited: a zombie until init reaps it, which may take seconds)
            if socket.suffix == ".json":  # a launch server's record (llmcli/pipeline/launch.py), its log and lock
                for leftover in (socket, socket.with_suffix(".log"), socket.with_suffix(".lock")):
                    leftover.unlink(missing_ok=True)
            return True
        time.sleep(0.05)
    return False


class WarmEmbedder:
    """`llmcli embed --keep-alive`: the warm server's embedding model, as `embed` uses a local Embedder."""

    TEXTS_PER_REQUEST = 256

    def __init__(self, server: WarmServer, normalize: bool, truncate: bool):
        self.server, self.normalize, self.truncate = server, normalize, truncate
        self.engine = contextlib.nullcontext()  # (a local embedder's engine is closed after; the server's stays)

    def embed(self, texts: list[str], on_progress: Callable[[int], None] | None = None) -> Iterator[Embedded]:
        with httpx2.Client(transport=socket_transport(str(self.server.socket)), timeout=600) as http:
            for start in range(0, len(texts), self.TEXTS_PER_REQUEST):
                chunk = texts[start:start + self.TEXTS_PER_REQUEST]
                try:
                    reply = http.post("http://llmcli/llmcli/embed", json={
                        "model": self.server.model, "input": chunk, "normalize": self.normalize,
                        "truncate": self.truncate})
                    results = reply.json()["results"]
                except (httpx2.HTTPError, ValueError, KeyError) as exc:
                    raise LlmcliError(f"the warm server did not embed: {exc}") from None
                for result in results:
                    yield Embedded(result["embedding"], result["tokens"], result["error"], result["too_long"])
                if on_progress is not None:
                    on_progress(start + len(chunk))
