"""llama.cpp's quantizer (`llama_model_quantize`): one GGUF file made into another of a chosen type.

The C call cannot be interrupted and, on a full disk, leaves what it wrote. So it runs in a child process
(`python -m llmcli.llama.quantize SPEC_JSON`) writing to a hidden file beside the target: the child reports each
tensor as llama.cpp's log names it ("[ 12/ 272] blk.0.attn_k.weight …"); Ctrl-C, SIGTERM or a failure ends the
child and removes the hidden file; only a finished, checked file is renamed to the target. The child asks to die with
its parent (PR_SET_PDEATHSIG), and a hidden file left by a parent killed with -9 is removed by the next quantize
into the same folder.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from llmcli.errors import IntegrityError, LlmcliError, ResourceError, UsageError
from llmcli.interrupt import Cancellation
from llmcli.reaper import alive
from llmcli.store.gguf_header import FILE_TYPES, TENSOR_TYPES, GGUFHeader, read_header
from llmcli.units import human_size

# The types llama.cpp makes without an importance matrix, and their bits per weight (the quantized tensors', for
# the free-space estimate; llama.cpp's K-quant mixes and fallbacks vary it a little).
BITS_PER_WEIGHT = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69, "Q5_K_S": 5.54,
    "Q5_1": 6.0, "Q5_0": 5.5, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_1": 5.0, "Q4_0": 4.5, "IQ4_NL": 4.5,
    "IQ4_XS": 4.25, "Q3_K_L": 4.27, "Q3_K_M": 3.91, "Q3_K_S": 3.5, "IQ3_M": 3.7, "IQ3_S": 3.44, "IQ3_XS": 3.3,
    "IQ3_XXS": 3.06, "Q2_K": 3.35,
}
# The types whose quantizer needs an importance matrix: llama.cpp refuses each without one ("this quantization
# requires an imatrix!"). IQ3_* and IQ4_* are made without one (SmolLM2: 11-17 s each).
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S")
UNQUANTIZED = ("F32", "F16", "BF16")
FTYPES = {name: number for number, name in FILE_TYPES.items()}
GGML_TYPES = {name: number for number, (name, _, _) in TENSOR_TYPES.items()}
FULL_BELOW = 4 * 2**20  # free bytes under which a failed write is a full disk
PARTIAL = ".partial-"  # a hidden file being written: ".NAME.partial-PID"
LOG_ERROR = 4  # ggml's log level of an error
PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")  # llama.cpp's line for each tensor


@dataclass(frozen=True)
class QuantizeJob:
    source: str
    target: str
    type: str  # a key of BITS_PER_WEIGHT
    allow_requantize: bool = False
    output_type: str | None = None  # the output tensor's ggml type (GGML_TYPES); None: llama.cpp's choice
    embedding_type: str | None = None  # the token embeddings' ggml type
    threads: int = 0  # 0: llama.cpp's (the cores)


def check_type(name: str) -> str:
    """The canonical name of a quantization type, or a UsageError saying which exist (and why some are refused)."""
    upper = name.upper()
    if upper in BITS_PER_WEIGHT:
        return upper
    if upper in NEEDS_IMATRIX:
        raise UsageError(f"{upper} needs an importance matrix (llama.cpp's quantizer refuses it without one), which "
                         "llmcli does not compute",
                         hint=f"Choose one of {', '.join(BITS_PER_WEIGHT)}; Q2_K and Q3_K_S are the smallest.")
    raise UsageError(f"unknown quantization type {name!r}", hint=f"Choose one of {', '.join(BITS_PER_WEIGHT)}.")


def check_tensor_type(name: str | None, what: str) -> str | None:
    if name is None:
        return None
    upper = name.upper()
    if upper not in GGML_TYPES or upper.startswith(("I8", "I16", "I32", "I64", "Q8_K", "Q8_1")):
        raise UsageError(f"unknown tensor type {name!r} for {what}",
                         hint="For example F16, Q8_0, Q6_K, Q5_K, Q4_K or Q4_0.")
    return upper


def requantizes(header: GGUFHeader) -> bool:
    """Whether the source is quantized already (its file type is not a float type)."""
    return header.quant.upper() not in UNQUANTIZED


def estimated_bytes(header: GGUFHeader, type_name: str) -> int:
    """The output's size, about: 1-D tensors (norms, biases) stay F32, the rest at the type's bits per weight."""
    bits = BITS_PER_WEIGHT[type_name]
    total = header.data_offset
    for tensor in header.tensors:
        elements = tensor.n_elements
        total += elements * 4 if len(tensor.shape) < 2 or tensor.shape[1] == 1 else int(elements * bits / 8)
    return total


def check_space(header: GGUFHeader, target: Path, type_name: str) -> int:
    """Refuse, with the numbers, where the target's file system lacks room for the output (+ 5 %)."""
    needed = int(estimated_bytes(header, type_name) * 1.05)
    free = shutil.disk_usage(target.parent).free
    if needed > free:
        raise ResourceError(f"{type_name} of this model needs about {human_size(needed)} on disk; {target.parent} has "
                            f"{human_size(free)} free", hint="Free some space or write elsewhere with -o PATH.")
    return needed


def remove_stale_partials(folder: Path) -> None:
    """Hidden files that a quantize killed with -9 left: their writer is gone."""
    for path in folder.glob(f".*{PARTIAL}*"):
        pid = path.name.rsplit(PARTIAL, 1)[-1]
        if pid.isdigit() and not alive(int(pid)):
            path.unlink(missing_ok=True)


def quantize(job: QuantizeJob, cancel: Cancellation, on_progress: Callable[[int, int, str], None]) -> GGUFHeader:
    """Make `job.target`; `on_progress(done, total, tensor)` as each tensor is written. Returns the result's checked
    header. Raises KeyboardInterrupt (Ctrl-C; `cancel.signum` says which signal) or LlmcliError, leaving nothing."""
    target = Path(job.target)
    remove_stale_partials(target.parent)
    partial = target.parent / f".{target.name}{PARTIAL}{os.getpid()}"
    spec = json.dumps({**asdict(job), "target": str(partial)})
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen([sys.executable, "-m", "llmcli.llama.quantize", spec], stdout=subprocess.PIPE,
                                 stderr=errors, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            with cancel.raising():
                said = _follow(child, on_progress)
                code = child.wait()
            if code != 0 or said.get("error"):
                errors.seek(0)
                full = shutil.disk_usage(target.parent).free < FULL_BELOW  # (before its file is removed)
                raise _failure(said.get("error") or errors.read().decode("utf-8", "replace"), code, target, full)
            try:
                header = read_header(partial)
            except IntegrityError as exc:
                raise IntegrityError(f"llama.cpp's quantizer wrote a file that does not read back: {exc.message}") from None
            if header.quant.upper() != job.type and not (job.type == "F32" and header.quant.upper() == "F32"):
                raise IntegrityError(f"llama.cpp's quantizer wrote {header.quant}, not {job.type}")
            os.replace(partial, target)
            return header
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            partial.unlink(missing_ok=True)
            if child.stdout is not None:
                child.stdout.close()


def _follow(child: subprocess.Popen[str], on_progress: Callable[[int, int, str], None]) -> dict[str, str]:
    said: dict[str, str] = {}
    assert child.stdout is not None
    for line in child.stdout:
        kind, _, rest = line.rstrip("\n").partition(" ")
        if kind == "tensor":
            done, total, name = rest.split(" ", 2)
            on_progress(int(done), int(total), name)
        elif kind == "error":
            said["error"] = rest
    return said


def _failure(reason: str, code: int, target: Path, full: bool) -> LlmcliError:
    text = " ".join(reason.split())[-300:] or f"the quantizer ended with status {code}"
    if full or "No space left" in text:  # (llama.cpp says only "basic_ios::clear: iostream error")
        return ResourceError(f"the disk filled up while writing {target.name}: nothing was kept",
                             hint=f"Free some space in {target.parent} or write elsewhere with -o PATH.")
    if code < 0:
        text = f"the quantizer died ({signal.Signals(-code).name})"
    return LlmcliError(f"llama.cpp could not quantize the model: {text}")


# -- the child ---------------------------------------------------------------------------------------------------


def _child(spec: dict[str, object]) -> int:
    import llama_cpp

    job = QuantizeJob(**spec)  # type: ignore[arg-type]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the parent
        if os.getppid() == 1:
            return 1
    errors: list[str] = []
    pending = [""]

    def on_log(level: int, text: bytes | None, user_data: object) -> None:
        try:
            message = (text or b"").decode("utf-8", "replace")
            if level == LOG_ERROR:  # (whole lines, never part of the tensor line it interrupts)
                errors.append(message.strip())
                return
            pending[0] += message
            while "\n" in pending[0]:
                line, pending[0] = pending[0].split("\n", 1)
                found = PROGRESS.match(line.strip())
                if found:
                    print("tensor", found.group(1), found.group(2), found.group(3), flush=True)
        except BaseException:  # nothing may propagate into C
            pass

    callback = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[job.type]
    params.allow_requantize = job.allow_requantize
    params.nthread = job.threads
    if job.output_type is not None:
        params.output_tensor_type = GGML_TYPES[job.output_type]
    if job.embedding_type is not None:
        params.token_embedding_type = GGML_TYPES[job.embedding_type]
    rc = llama_cpp.llama_model_quantize(job.source.encode(), job.target.encode(), ctypes.byref(params))
    if rc != 0:
        print("error", " | ".join(errors[-3:]) or f"llama_model_quantize returned {rc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides: it kills this process and removes the file
    sys.exit(_child(json.loads(sys.argv[1])))
