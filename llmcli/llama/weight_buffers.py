"""Where llama.cpp's CPU backend may keep a model's weights: besides plain memory, its "extra" buffer types, which
rearrange the weights for faster kernels as they load (CPU_REPACK: Q4_0, IQ4_NL and, depending on the llama.cpp
version, a few more on AVX2/AVX-512; AMX on Intel CPUs with AMX, in builds made on one; KLEIDIAI on Arm).
llama.cpp offers them all or none (`use_extra_bufts`).

Its AMX kernels are not safe: on a Sapphire Rapids CPU every prompt of two tokens or more crashes the process in
`ggml_backend_amx_mul_mat`, whatever the quantization (Q4_0, Q4_1, Q4_K_M; ggml-org/llama.cpp#20824), and they gave
wrong answers for Q4_0 and Q4_1 (#16315). A source build of llama-cpp-python (how pip installs it) compiles them in on
such a CPU. Where the CPU backend offers the AMX buffer type, llmcli loads weights without extra buffer types: the
kernels then used are llama.cpp's plain AVX-512 ones, which is what a Q4_1 model gets anyway (REPACK has none for it)."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import llama_cpp

from llmcli.llama.llama_log import llama_backend

# Extra buffer types whose kernels crash or answer wrongly: their name -> why they are left out.
UNSAFE = {"AMX": "llama.cpp's AMX kernels crash (ggml-org/llama.cpp#20824)"}

_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


@lru_cache(maxsize=1)
def extra_buffer_types() -> tuple[str, ...]:
    """The names of the CPU backend's extra buffer types, in llama.cpp's order of preference (it puts each weight in
    the first that takes it). Read from ggml's backend registry; where that cannot be read, AMX is assumed present
    when llama.cpp says it was built with it."""
    llama_backend()
    try:
        return _from_registry()
    except (OSError, AttributeError, ValueError):
        built = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
        return ("AMX",) if "AMX_INT8 = 1" in built else ()


def _from_registry() -> tuple[str, ...]:
    folder = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(folder.glob("libggml.so*")) or sorted(folder.glob("libggml.dylib")) or sorted(folder.glob("ggml.dll"))
    if not found:
        raise OSError(f"no ggml library in {folder}")
    ggml = ctypes.CDLL(str(found[0]))  # the library llama.cpp already loaded: the same handle
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    device = ggml.ggml_backend_dev_by_type(_CPU_DEVICE)
    if not device:
        raise ValueError("llama.cpp has no CPU device")
    address = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(device),
                                                     b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return ()
    listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(device)
    names: list[str] = []
    while listed and listed[len(names)]:  # a NULL-terminated array
        names.append((ggml.ggml_backend_buft_name(listed[len(names)]) or b"?").decode("utf-8", "replace"))
    return tuple(names)


def use_extra_buffer_types() -> bool:
    """Whether weights may go to the extra buffer types: not where one of them is unsafe."""
    return not any(name in UNSAFE for name in extra_buffer_types())


def weight_buffers_summary() -> str:
    """For benchmark records: `CPU_REPACK`, or `off (AMX: llama.cpp's AMX kernels crash …)`, or `none`."""
    names = extra_buffer_types()
    unsafe = [name for name in names if name in UNSAFE]
    if unsafe:
        return f"off ({', '.join(f'{name}: {UNSAFE[name]}' for name in unsafe)})"
    return ", ".join(names) or "none"
