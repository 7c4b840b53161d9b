"""Hostile models, broken downloads, interrupts and bad input (the case table is tests/README.md)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_in_terminal, spawn_cli
from fake_hub import FakeHub, Fault
from gguf_tools import copy_range, rewrite_metadata
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_K_M.gguf"


# -- templates are code-shaped data ----------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        "{{ cycler.__init__.__globals__.os.popen('touch CANARY').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__()[0]('touch CANARY') }}",
        "{{ self.__init__.__globals__.__builtins__.open('CANARY', 'w') }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ joiner()() }}{{ lipsum() }}",
    ],
)
def test_template_injection_is_refused_and_runs_nothing(tmp_path, payload, monkeypatch):
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "evil.jinja"
    template.write_text(payload)
    result = run_cli("run", "--chat-template-file", str(template), "-n", "2", "hi")
    assert result.code == 7, result.stderr
    assert result.stderr.startswith("Error: chat template") and "Traceback" not in result.stderr
    assert not (tmp_path / "CANARY").exists()


@pytest.mark.parametrize(
    "payload, reason",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'a' * 10**9 }}", "too large"),
        ("{% set s = 'a' * 1000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "output exceeds"),
        ("{{ 2 ** 100000000 }}", "exponent"),
    ],
)
def test_runaway_templates_stop_within_their_budget(tmp_path, payload, reason):
    template = tmp_path / "slow.jinja"
    template.write_text(payload)
    result = run_cli("run", "--show-prompt", "--chat-template-file", str(template), "hi", timeout=60)
    assert result.code == 7
    assert "stopped" in result.stderr and reason in result.stderr


def test_a_template_file_past_the_limit_is_refused_without_reading_it_all(tmp_path):
    """--chat-template-file over 64 Ki characters is one line (exit 7), and reading stops at the limit: /dev/zero, which
    never ends, is refused like a long file (read whole, it would take every byte of memory)."""
    long = tmp_path / "long.jinja"
    long.write_text("{{ 'x' }}" + " " * (64 * 1024))
    result = run_cli("run", "--show-prompt", "--chat-template-file", str(long), "hi", timeout=60)
    assert result.code == 7 and "is 65545 characters; the limit is 65536" in result.stderr, result.stderr
    endless = run_cli("run", "--show-prompt", "--chat-template-file", "/dev/zero", "hi", timeout=60)
    assert endless.code == 7, endless.stderr
    assert "(/dev/zero) is more than 65536 characters" in endless.stderr and "Traceback" not in endless.stderr


def test_broken_template_in_the_model_does_not_make_it_unusable(tmp_path, smollm2):
    broken = rewrite_metadata(smollm2, tmp_path / "broken.gguf", strings={"tokenizer.chat_template": "{% if x %}oops"})
    result = run_cli("run", "-m", str(broken), "hi")
    assert result.code == 7 and "syntax error" in result.stderr and "--raw" in result.stderr
    raw = run_cli("run", "-m", str(broken), "--raw", "--temp", "0", "-n", "4", "-q", "Once upon a time")
    assert raw.code == 0 and raw.stdout.strip()
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    fixed = run_cli("run", "-m", str(broken), "--chat-template-file", str(template), "--temp", "0", "-n", "4", "-q", "hi")
    assert fixed.code == 0 and fixed.stdout.strip()
    assert run_cli("show", str(broken)).code == 0


# -- GGUF pre-flight -------------------------------------------------------------------------


def test_llama_cpp_reason_is_surfaced(tmp_path, smollm2):
    # passes the pre-flight check, but llama.cpp cannot build the model without its layer count
    model = rewrite_metadata(smollm2, tmp_path / "no-layers.gguf", drop=("llama.block_count",))
    result = run_cli("run", "-m", str(model), "hi")
    assert result.code == 5
    assert result.stderr.startswith("Error: llama.cpp could not load") and "block_count" in result.stderr


HEADER_END = 1_785_664  # SmolLM2's data section starts here: everything before is header


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(["flip", "truncate", "forge"]))
    if kind == "flip":
        return kind, draw(st.integers(4, HEADER_END - 1)), draw(st.integers(0, 7))
    if kind == "truncate":
        return kind, draw(st.integers(0, 98_362_431)), 0
    return kind, draw(st.sampled_from([8, 16, 24, 31, 40, 1_769_060, 1_769_507])), draw(st.sampled_from([2**63, 2**40, 2**32 - 1]))


def write_mutated(model: Path, path: Path, mutation: tuple[str, int, int]) -> None:
    """`model` with `mutation` applied, written to `path`: the header read and changed here, the rest of the file
    (the tensors: ~94 MB) copied by the kernel."""
    kind, offset, value = mutation
    with model.open("rb") as source, path.open("wb") as target:
        head = bytearray(source.read(HEADER_END))
        if kind == "flip":
            head[offset] ^= 1 << value
        elif kind == "forge":
            head[offset : offset + 8] = value.to_bytes(8, "little")
        end = offset if kind == "truncate" else model.stat().st_size
        target.write(head[:end])
        copy_range(source, target, min(end, HEADER_END), end, min(end, HEADER_END))


@settings(max_examples=25, deadline=None, derandomize=True,  # the same cases on every run: CI cannot flake
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=mutations())
@example(mutation=("flip", 402478, 5))  # found by fuzzing: a repeated token made llama.cpp abort (GGML_ASSERT)
@example(mutation=("forge", 646937, 0))  # found by fuzzing: tokens equal up to a NUL byte, the same abort
@example(mutation=("truncate", 0, 0))  # found by fuzzing: an empty file could not be mapped (an internal error)
def test_fuzzed_gguf_never_crashes_or_hangs(tmp_path, packaged_smollm2, mutation):
    path = tmp_path / "fuzzed.gguf"
    write_mutated(packaged_smollm2, path, mutation)
    proc = run_cli("run", "-m", str(path), "--raw", "--temp", "0", "-n", "1", "-q", "hi", timeout=60)  # its own process
    assert proc.code >= 0, f"killed by signal {-proc.code} for {mutation}"
    assert proc.code in (0, 3, 5, 6), (mutation, proc.stderr)
    assert "Traceback" not in proc.stderr
    if proc.code:
        assert proc.stderr.startswith("Error: "), (mutation, proc.stderr)
    if mutation[0] == "truncate":
        assert proc.code == 5


# -- output hygiene --------------------------------------------------------------------------


def test_escape_sequences_from_the_model_are_neutralised_on_a_terminal():
    grammar = r'root ::= "\x1b[31mred\x1b[0m [bold]x[/bold]"'
    output = run_in_terminal(["run", "--grammar", grammar, "--temp", "0", "-q", "--plain", "hi"], {"NO_COLOR": "1"})
    assert b"\x1b" not in output
    assert b"^[[31mred^[[0m [bold]x[/bold]" in output
    rendered = run_in_terminal(["run", "--grammar", grammar, "--temp", "0", "-q", "hi"], {"NO_COLOR": "1"})
    assert b"\x1b[31m" not in rendered and b"^[[31mred^[[0m [bold]x[/bold]" in rendered  # rendered, still neutral
    piped = run_cli("run", "--grammar", grammar, "--temp", "0", "-q", "hi")  # piped: the bytes, untouched
    assert piped.stdout.rstrip("\n") == "\x1b[31mred\x1b[0m [bold]x[/bold]"


# -- interrupts ------------------------------------------------------------------------------


@pytest.mark.in_process  # (the load in this process: llama.cpp's log blocks it)
def test_ctrl_c_while_loading_exits_130_quietly():
    """The signal lands inside llama.cpp's model load, every time: with -v, llama.cpp's log goes to a pipe
    of one page that this test does not read, so the loader blocks in its log callback once the page is full."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen([sys.executable, "-m", "llmcli", "run", "-v", "--seed", "1", "hi"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=write_end)
    os.close(write_end)
    deadline = time.monotonic() + 60
    while not _blocked_writing_a_full_pipe(proc.pid, read_end):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    with os.fdopen(read_end, "rb") as stderr:
        err = stderr.read()
    with proc.stdout:
        out = proc.stdout.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, err
    assert b"llama_model_loader" in err  # the load had begun...
    assert b"llama_context:" not in err and out == b""  # ...and was aborted: no context, no answer
    assert b"Traceback" not in err and b"Exception ignored" not in err


F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity


def _blocked_writing_a_full_pipe(pid: int, read_end: int) -> bool:
    """The process sleeps in a write to the pipe (the kernel's wait channel says so where it is shown)."""
    queued = struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0\0\0\0"))[0]
    wchan = Path(f"/proc/{pid}/wchan").read_text()
    if wchan not in ("", "0"):
        return "pipe_write" in wchan
    return queued > 4096 - 512 and Path(f"/proc/{pid}/stat").read_text().split()[2] == "S"


@pytest.fixture
def slow_hub(smollm2: Path, serve_hub) -> FakeHub:
    return serve_hub({REPO: {Q4: smollm2}}, faults={Q4: Fault(delay_per_mb=0.05)})  # ~5 s for the whole file


def cache_entries(home: Path) -> list[str]:
    root = home / "cache" / "hub"
    return [str(p) for p in root.rglob("*") if p.is_file() and p.suffix != ".lock"] if root.exists() else []


def _downloading(root: Path) -> bool:
    """A partial download with bytes in it under `root` (a file renamed meanwhile: not yet, or no longer)."""
    for partial in root.rglob("*.incomplete"):
        try:
            if partial.stat().st_size > 0:
                return True
        except OSError:
            pass
    return False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_a_download_leaves_nothing_partial(slow_hub, isolated_env, signum, code):
    proc = spawn_cli("pull", REPO)
    deadline = time.time() + 30
    while time.time() < deadline and not _downloading(isolated_env / "cache" / "hub"):
        time.sleep(0.02)  # (bytes on disk: under way; a fixed pause after its request let it finish on a busy machine)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert b"Traceback" not in err
    leftovers = [p for p in cache_entries(isolated_env) if "/blobs/" in p or p.endswith(".gguf")]
    assert leftovers == []


def test_prune_removes_orphaned_partial_files_but_not_running_ones(isolated_env):
    from filelock import FileLock

    blobs = isolated_env / "cache" / "hub" / "models--a--b" / "blobs"
    blobs.mkdir(parents=True)
    orphan = blobs / ("1" * 64 + ".abcd1234.incomplete")
    running = blobs / ("2" * 64 + ".ef567890.incomplete")
    orphan.write_bytes(b"x" * 100)
    running.write_bytes(b"y" * 100)
    locks = isolated_env / "cache" / "hub" / ".locks" / "models--a--b"
    locks.mkdir(parents=True)
    with FileLock(str(locks / ("2" * 64 + ".lock"))):
        result = run_cli("prune")
    assert result.code == 0 and "1 partial file removed" in result.stderr
    assert not orphan.exists() and running.exists()


# -- disk, memory, integrity of the cache ----------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here: " + done.stderr.decode(errors="replace").strip())
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_disk_space_is_checked_before_a_pull(hub_for_disk, small_disk):
    result = run_cli("--cache-dir", str(small_disk), "pull", REPO)
    assert result.code == 6
    assert "not enough disk space" in result.stderr and " free in " in result.stderr
    assert hub_for_disk.requests("GET", "/cdn/") == []


def test_disk_filling_up_anyway_is_a_clear_error_and_the_cache_stays_usable(hub_for_disk, small_disk):
    hub_for_disk.faults[Q4] = Fault(listed_size=1000)  # the listing lies: the check passes, the disk fills
    result = run_cli("--cache-dir", str(small_disk), "pull", REPO)
    assert result.code == 6, result.stderr
    assert "disk filled up" in result.stderr and "Traceback" not in result.stderr
    assert [p for p in small_disk.rglob("*") if p.is_file() and "blobs" in str(p)] == []
    listed = run_cli("--cache-dir", str(small_disk), "list", "--json")
    assert listed.code == 0 and json.loads(listed.stdout)


@pytest.fixture
def hub_for_disk(smollm2: Path, serve_hub) -> FakeHub:
    return serve_hub({REPO: {Q4: smollm2}})


def test_memory_is_checked_before_a_download(hub_for_disk):
    hub_for_disk.faults[Q4] = Fault(listed_size=10 * 2**40)  # 10 TiB
    result = run_cli("pull", REPO)
    assert result.code == 6
    assert "of memory" in result.stderr and "available" in result.stderr and "--force" in result.stderr
    assert hub_for_disk.requests("GET", "/cdn/") == []


def test_memory_is_checked_before_loading_and_force_overrides(smollm2):
    from llmcli.store.gguf_header import read_header
    from llmcli.store.memory import available_memory, kv_cache_bytes

    available = available_memory()
    assert available is not None
    too_long = str(min(2 * available // kv_cache_bytes(read_header(smollm2), 1) + 1, 2**31 - 1))  # KV cache > 2x RAM
    result = run_cli("run", "-c", too_long, "hi")
    assert result.code == 6
    assert "KV cache" in result.stderr and " is available" in result.stderr
    forced = run_cli("run", "--force", "-n", "4", "-c", too_long, "hi")
    assert forced.code == 0, forced.stderr  # a run's KV cache is sized to its work: these few tokens fit
    # A turn whose room cannot be made is that turn's error; the cache it had, and the chat, go on.
    chat = run_cli("chat", "--force", "-c", too_long, "--temp", "0", "--json", "-q",
                   input=f"/set max_tokens {int(too_long) - 64}\nhi\n/set max_tokens 2\nhi\n")
    assert chat.code == 0 and chat.stderr.count("could not create a context") == 1, chat.stderr
    assert json.loads(chat.stdout)["usage"]["completion_tokens"] == 2
    served = run_cli("serve", "--force", "--port", "0", "-c", too_long)  # a server's slot holds its whole context
    assert served.code == 6 and "could not create a context" in served.stderr  # llama.cpp tried, and said why


def test_verify_detects_a_corrupted_cached_file(hub_for_disk, isolated_env):
    assert run_cli("pull", REPO).code == 0
    assert run_cli("verify").code == 0
    blob = next((isolated_env / "cache" / "hub").rglob("blobs/*"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    result = run_cli("verify", REPO)
    assert result.code == 5 and "CORRUPT" in result.stderr and "failed their checksum" in result.stderr
    assert run_cli("run", "--offline", "-m", REPO, "hi").code == 3  # removed, not loaded


def test_unsafe_names_in_a_listing_are_never_used(smollm2, serve_hub, isolated_env, tmp_path):
    serve_hub({"evil/repo": {"../../../escape-Q4_K_M.gguf": smollm2, "/abs-Q4_K_M.gguf": smollm2, "good-Q8_0.gguf": smollm2}})
    result = run_cli("pull", "evil/repo")
    assert result.code == 0, result.stderr
    assert "evil/repo:Q8_0 ready" in result.stderr
    assert not list(tmp_path.rglob("escape-Q4_K_M.gguf")) and not Path("/abs-Q4_K_M.gguf").exists()


# -- bad input -------------------------------------------------------------------------------


def test_binary_stdin_is_decoded_with_replacement_characters():
    result = run_cli("run", "--show-prompt", "Summarize:", input=b"ok \xff\xfe\x00 bytes")
    assert result.code == 0
    assert "ok \ufffd\ufffd\x00 bytes" in result.stdout


def test_huge_stdin_is_refused():
    result = run_cli("run", "hi", input=b"x" * 5000, env={"LLMCLI_MAX_STDIN": "1000"})
    assert result.code == 6 and "stdin holds more than" in result.stderr


def test_fifo_as_model_is_a_usage_error(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    result = run_cli("run", "-m", str(fifo), "hi", timeout=30)
    assert result.code == 2 and "not a regular file" in result.stderr


def test_unknown_model_name(tmp_path):
    result = run_cli("run", "-m", "no-such-alias", "hi")
    assert result.code == 3 and result.stderr.startswith("Error: unknown model 'no-such-alias'")


def test_internal_error_is_one_line_with_the_debug_log(isolated_env):
    code = (
        "import llmcli.store.models as m\n"
        "def boom(*a, **k):\n    raise RuntimeError('simulated bug')\n"
        "m.resolve = boom\n"
        "import llmcli.pipeline as p; p.models.resolve = boom\n"
        "import sys; sys.argv = ['llmcli', 'run', 'hi']\n"
        "from llmcli.cli import main; main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == "Error: internal error: RuntimeError: simulated bug"
    assert "Traceback" not in proc.stderr
    log = isolated_env / "data" / "logs" / "debug.log"
    assert str(log) in lines[1] and "simulated bug" in log.read_text() and "Traceback" in log.read_text()
    debug = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=60, env={**os.environ, "LLMCLI_DEBUG": "1"})
    assert "Traceback" in debug.stderr


# -- llama.cpp's kernels that crash -----------------------------------------------------------------------------------


def test_weights_stay_out_of_amx_buffers_whose_kernels_crash(monkeypatch, smollm2):
    """A source build of llama.cpp on a CPU with AMX puts Q4 weights in AMX's buffers, whose kernels crash on the
    first prompt of two tokens (ggml-org/llama.cpp#20824): where the CPU backend offers them, no extra buffer type is
    used, and bench's records say so. (On such a CPU, every answering test in this suite is the proof.)"""
    from llmcli.llama import weight_buffers

    result = run_cli("run", "-m", "smollm2", "--raw", "-n", "2", "--temp", "0", "The capital of France is the city of")
    assert result.code == 0 and result.stdout.strip(), result.stderr  # (a two-token prompt or more crashed with AMX)
    offered = weight_buffers.extra_buffer_types()
    assert weight_buffers.use_extra_buffer_types() == ("AMX" not in offered)
    assert weight_buffers.weight_buffers_summary().startswith("off (AMX:" if "AMX" in offered else "")
    for listed, used, summary in [(("AMX", "CPU_REPACK"), False, "off (AMX: llama.cpp's AMX kernels crash"),
                                  (("CPU_REPACK",), True, "CPU_REPACK"), ((), True, "none")]:
        monkeypatch.setattr(weight_buffers, "extra_buffer_types", lambda listed=listed: listed)
        assert weight_buffers.use_extra_buffer_types() is used
        assert weight_buffers.weight_buffers_summary().startswith(summary)
