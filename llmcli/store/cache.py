"""The local model cache, read and tidied without huggingface_hub: its layout lives here only.

huggingface_hub's layout under `paths.hub_cache()`:

    models--OWNER--REPO/refs/BRANCH             the commit a branch points at
    models--OWNER--REPO/snapshots/COMMIT/FILE   a link to ../../blobs/SHA256 (LFS files)
    models--OWNER--REPO/blobs/SHA256
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from llmcli import paths
from llmcli.config.settings import default
from llmcli.errors import ModelNotFoundError
from llmcli.store.references import Choice, HubReference, choices, select

REPO_PREFIX = "models--"

# Progress of one download: (file name, bytes done, bytes total or None).
ProgressCallback = Callable[[str, int, "int | None"], None]
# What is about to be fetched: the files of one model (a projector's too), as the Hub lists them.
FilesCallback = Callable[[tuple["RemoteFile", ...]], None]
# Around a request to a host that may keep us waiting: a context manager that tells the user (after a while).
WaitingNotice = Callable[[str], AbstractContextManager[object]]


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub repository as its listing gives it (an LFS file's size and sha256)."""

    name: str
    size: int | None
    sha256: str | None


@dataclass(frozen=True)
class Fetch:
    """How a Hub model may be fetched while resolving."""

    offline: bool = False  # never ask the Hub (also $HF_HUB_OFFLINE)
    refresh: bool = False  # ask the Hub even when the model is cached (`pull`)
    cached_only: bool = False  # look in the cache alone, without the Hub client (`show`)
    force: bool = False  # skip the memory check before a download
    timeout: float = default("hub_timeout")  # seconds to connect, or between received bytes
    on_progress: ProgressCallback | None = None
    on_files: FilesCallback | None = None  # told what will be fetched, once it is checked (memory, disk)
    on_waiting: WaitingNotice | None = None


@dataclass(frozen=True)
class Fetched:
    reference: HubReference
    commit: str | None
    paths: tuple[Path, ...]  # the first is the one to load
    quant: str | None


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    revision: str  # commit
    refs: tuple[str, ...]  # branch/tag names pointing at it
    files: tuple[Path, ...]  # first one loads
    quant: str | None
    size: int

    @property
    def name(self) -> str:
        return f"{self.repo_id}:{self.quant}" if self.quant else f"{self.repo_id}/{self.files[0].name}"


def repo_dir(repo_id: str, root: Path | None = None) -> Path:
    return (root or paths.hub_cache()) / f"{REPO_PREFIX}{repo_id.replace('/', '--')}"


def repo_dirs(root: Path | None = None) -> list[tuple[str, Path]]:
    """(OWNER/REPO, its folder) for every model repository in the cache (or in another cache of this layout)."""
    root = root or paths.hub_cache()
    found = sorted(root.glob(f"{REPO_PREFIX}*")) if root.exists() else []
    return [(folder.name[len(REPO_PREFIX):].replace("--", "/", 1), folder) for folder in found]


def choose(reference: HubReference, names: list[str]) -> Choice:
    """The file(s) of `reference` among a repository's GGUF file names."""
    if reference.filename is not None:
        if reference.filename not in names:
            shown = ", ".join(sorted(names)[:12]) or "none"
            raise ModelNotFoundError(f"{reference.filename} is not in {reference.repo_id}", hint=f"Files there: {shown}")
        group = [c for c in choices(names) if reference.filename in c.files]
        return group[0] if group else Choice((reference.filename,), None)
    try:
        return select(choices(names), reference.quant, reference.repo_id)
    except LookupError as exc:
        raise ModelNotFoundError(str(exc), hint="Name a quant (OWNER/REPO:Q4_K_M) or a file (OWNER/REPO/FILE.gguf).") from None


def _snapshot_dir(reference: HubReference, root: Path) -> Path | None:
    repo = repo_dir(reference.repo_id, root)
    revision = reference.revision or "main"
    ref_file = repo / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = repo / "snapshots" / commit
    inside = snapshot.resolve().is_relative_to(root.resolve()) if snapshot.exists() else False
    return snapshot if inside and snapshot.is_dir() else None


def gguf_names(snapshot: Path) -> list[str]:
    """The GGUF files of a snapshot, as paths relative to it."""
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf") if p.is_file())


def from_cache(reference: HubReference, root: Path | None = None) -> Fetched | None:
    """The cached files of `reference` (in llmcli's cache, or another cache of this layout at `root`), or None
    when they are not (all) there."""
    snapshot = _snapshot_dir(reference, root or paths.hub_cache())
    if snapshot is None:
        return None
    try:
        choice = choose(reference, gguf_names(snapshot))
    except ModelNotFoundError:
        return None
    files = tuple(snapshot / name for name in choice.files)
    if not all(p.is_file() for p in files):
        return None
    return Fetched(reference, snapshot.name, files, choice.quant)


def remove_file(path: Path) -> None:
    """Remove a snapshot file and its blob (when no other snapshot links to that blob)."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    snapshots = blob.parent.parent / "snapshots"
    still_linked = snapshots.exists() and any(link.is_symlink() and link.resolve() == blob for link in snapshots.rglob("*"))
    if not still_linked:
        blob.unlink(missing_ok=True)


def delete(models: list[CachedModel]) -> int:
    """Remove these models' files; empty snapshots and repositories go too. Returns bytes freed."""
    freed = 0
    for model in models:
        for path in model.files:
            blob = path.resolve()
            freed += blob.stat().st_size if blob.exists() else 0
            remove_file(path)
    for repo in {repo_dir(m.repo_id) for m in models}:
        snapshots = repo / "snapshots"
        for snapshot in list(snapshots.iterdir()) if snapshots.exists() else []:
            if not any(p.is_file() or p.is_symlink() for p in snapshot.rglob("*")):
                shutil.rmtree(snapshot, ignore_errors=True)
        if not snapshots.exists() or not any(snapshots.iterdir()):
            shutil.rmtree(repo, ignore_errors=True)
    return freed


def partial_downloads() -> list[tuple[Path, Path]]:
    """(partial file, the lock file its download holds) for every unfinished download in the cache."""
    root = paths.hub_cache()
    found = []
    for partial in sorted(root.glob(f"{REPO_PREFIX}*/blobs/*.incomplete")) if root.exists() else []:
        etag = partial.name.split(".", 1)[0]
        found.append((partial, root / ".locks" / partial.parent.parent.name / f"{etag}.lock"))
    return found
