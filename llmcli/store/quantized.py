"""Models `llmcli quantize` made into llmcli's store: `NAME:type` (`smollm2:q4_0`) is `quantized/NAME/TYPE.gguf`.

NAME is the source's short name (a packaged model's, a Hub repository's, a file's stem), made safe for a folder; the
type is llama.cpp's name for the quantization (Q4_K_M), written in either case.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmcli import paths

# A quantization type's name as llama.cpp writes it (F16, BF16, Q8_0, Q4_K_M, IQ4_XS, ...).
TYPE_NAME = re.compile(r"(?:F32|F16|BF16|I?Q\d(?:_[0-9A-Z]+)*)", re.IGNORECASE)


def base_name(model_name: str) -> str:
    """A store name for a model: `bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M` -> `smollm2-135m-instruct`."""
    name = model_name.split(":", 1)[0].rsplit("/", 1)[-1]
    name = re.sub(r"[-_.]gguf$", "", name, flags=re.IGNORECASE)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.").lower()
    return name or "model"


def target(name: str, type_name: str) -> Path:
    return paths.quantized_dir() / name / f"{type_name.upper()}.gguf"


def reference_of(name: str, type_name: str) -> str:
    return f"{name}:{type_name.lower()}"


def parse(reference: str) -> tuple[str, str] | None:
    """(NAME, TYPE) where `reference` has the shape NAME:TYPE with no folder in NAME; else None."""
    name, colon, type_name = reference.partition(":")
    if not colon or "/" in name or not name or not TYPE_NAME.fullmatch(type_name):
        return None
    return name.lower(), type_name.upper()


def find(reference: str) -> Path | None:
    parsed = parse(reference)
    if parsed is None:
        return None
    path = target(*parsed)
    return path if path.is_file() else None


def made() -> list[tuple[str, Path]]:
    """(reference, path) of every model in the store, by name then type."""
    folder = paths.quantized_dir()
    if not folder.is_dir():
        return []
    return [(reference_of(path.parent.name, path.stem), path)
            for path in sorted(folder.glob("*/*.gguf")) if not path.name.startswith(".")]


def remove(reference: str) -> Path | None:
    """Remove a made model (and its folder once empty); its path, or None when the store has no such model."""
    path = find(reference)
    if path is None:
        return None
    path.unlink()
    try:
        path.parent.rmdir()
    except OSError:
        pass
    return path
