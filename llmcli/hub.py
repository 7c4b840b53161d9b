"""Downloads from the Hugging Face Hub into a verified cache: the only module that uses huggingface_hub.

- Cache: huggingface_hub's own layout under `config.cache_dir()/hub`, so the files stay plain
  `.gguf` files other tools can use. A file becomes visible (a snapshot link) only when complete.
  Within one pull a dropped connection is resumed with a Range request while data keeps
  flowing; a pull that fails in the end leaves no partial file behind (huggingface_hub 2.x
  downloads to a per-process temporary file), so the next pull starts over cleanly.
- Integrity: hf_hub_download does not check what it wrote; every new download is hashed and
  compared with the LFS sha256 from the repository listing, and removed on mismatch.
- Endpoint and token are read at call time ($HF_ENDPOINT, $HF_TOKEN), never at import.
- Every library exception is translated in one ordered table (hub_errors.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli import config, resources
from llmcli.errors import IntegrityError, ModelNotFoundError, ResourceError, UsageError
from llmcli.hub_errors import translated as _translated
from llmcli.references import Choice, HubReference, check_filename, choices, select

# Progress of one file: (file name, bytes done, bytes total or None).
ProgressCallback = Callable[[str, int, "int | None"], None]

DISK_MARGIN = 64 * 1024 * 1024


def _hf() -> Any:
    """Import huggingface_hub on first use (never at import: `--help` stays fast)."""
    # No user-agent telemetry: it also makes the client fetch a registry from the Hub, with a
    # 3-second timeout that would stall every offline run.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import huggingface_hub
    from huggingface_hub.utils import logging as hf_logging

    # Its retry warnings ("Trying to resume download...") are not for our users' stderr;
    # what failed in the end reaches them as one translated error line.
    hf_logging.set_verbosity_error()
    return huggingface_hub


def hub_cache() -> Path:
    return config.cache_dir() / "hub"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline(flag: bool = False) -> bool:
    return flag or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


@dataclass(frozen=True)
class Fetched:
    reference: HubReference
    commit: str | None
    paths: tuple[Path, ...]  # the first is the one to load
    quant: str | None


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None


def fetch(reference: HubReference, offline_only: bool = False, refresh: bool = False,
          on_progress: ProgressCallback | None = None, force: bool = False) -> Fetched:
    """The model files of `reference` in the local cache, downloading what is missing.

    Without `refresh`, a model already in the cache is used without any request (as `run` does);
    `pull` refreshes: it lists the repository and downloads only what changed.
    """
    if not refresh or offline_only:
        cached = from_cache(reference)
        if cached is not None:
            return cached
        if offline_only:
            raise ModelNotFoundError(
                f"{reference} is not in the cache ({hub_cache()}) and offline mode is on",
                hint=f"Run `llmcli pull {reference}` while online.",
            )
    with _translated(reference):
        commit, remote = _listing(reference)
        choice = _choose(reference, list(remote))
        files = [remote[name] for name in choice.files]
        resources.check_memory(str(reference), sum(f.size or 0 for f in files), force=force)
        _check_disk_space(reference, files)
        prune_partial()  # partial files a killed process left behind
        paths = tuple(_download(reference, file, on_progress) for file in files)
    return Fetched(reference, commit, paths, choice.quant)


def _listing(reference: HubReference) -> tuple[str | None, dict[str, RemoteFile]]:
    hf = _hf()
    api = hf.HfApi(endpoint=endpoint(), token=_token())
    info = api.model_info(reference.repo_id, revision=reference.revision, files_metadata=True)
    remote = {}
    for sibling in info.siblings or []:
        if not sibling.rfilename.lower().endswith(".gguf"):
            continue
        try:
            check_filename(sibling.rfilename)  # names from a listing are untrusted input too
        except UsageError:
            continue  # never offered, never joined to a path
        sha = sibling.lfs.sha256 if sibling.lfs else None
        size = sibling.lfs.size if sibling.lfs else sibling.size
        remote[sibling.rfilename] = RemoteFile(sibling.rfilename, size, sha)
    return info.sha, remote


def _choose(reference: HubReference, names: list[str]) -> Choice:
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


def _check_disk_space(reference: HubReference, files: list[RemoteFile]) -> None:
    needed = sum(f.size or 0 for f in files if _cached_path(reference, f.name) is None)
    if not needed:
        return
    where = hub_cache()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed + DISK_MARGIN > free:
        raise ResourceError(
            f"not enough disk space for {reference}: needs {needed / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free in {where}",
            hint="Free some space (llmcli rm …) or point LLMCLI_CACHE_DIR at a larger disk.",
        )


def _cached_path(reference: HubReference, filename: str) -> Path | None:
    found = _hf().try_to_load_from_cache(
        reference.repo_id, filename, cache_dir=hub_cache(), revision=reference.revision
    )
    return Path(found) if isinstance(found, str) else None


def _download(reference: HubReference, file: RemoteFile, on_progress: ProgressCallback | None) -> Path:
    already = _cached_path(reference, file.name) is not None
    path = Path(_hf().hf_hub_download(
        reference.repo_id, file.name, revision=reference.revision, cache_dir=hub_cache(),
        endpoint=endpoint(), token=_token(), tqdm_class=_relay(file.name, on_progress),
    ))
    resolved = path.resolve()
    if not resolved.is_relative_to(hub_cache().resolve()) or not resolved.is_file():
        raise IntegrityError(f"{file.name} from {reference.repo_id} resolved outside the cache or to a non-file: {resolved}")
    if not already and file.sha256:
        actual = sha256_of(path)
        if actual != file.sha256:
            remove_file(path)
            raise IntegrityError(
                f"{file.name} from {reference.repo_id} failed its checksum: sha256 {actual[:16]}… "
                f"instead of {file.sha256[:16]}…; the download was removed",
                hint="Pull again; if it keeps failing, the server or a proxy is corrupting the file.",
            )
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove_file(path: Path) -> None:
    """Remove a snapshot file and its blob (when no other snapshot links to that blob)."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    repo_dir = blob.parent.parent
    still_linked = any(
        link.is_symlink() and link.resolve() == blob for link in (repo_dir / "snapshots").rglob("*")
    ) if (repo_dir / "snapshots").exists() else False
    if not still_linked:
        blob.unlink(missing_ok=True)


def _relay(filename: str, on_progress: ProgressCallback | None) -> type:
    """A tqdm stand-in for hf_hub_download that forwards byte counts to `on_progress`."""

    class Relay:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any):
            self.total, self.n = total, initial
            self._report()

        def _report(self) -> None:
            if on_progress is not None:
                on_progress(filename, self.n, self.total)

        def update(self, n: int = 1) -> None:
            self.n += n
            self._report()

        def reset(self, total: int | None = None) -> None:
            self.n, self.total = 0, total if total is not None else self.total
            self._report()

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> Relay:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return Relay


# -- the local cache, without the network ---------------------------------------------------


def prune_partial() -> list[Path]:
    """Remove partial downloads whose download is not running (its lock is free): what a killed
    process left behind. Returns what was removed."""
    from filelock import FileLock, Timeout  # a huggingface_hub dependency

    removed = []
    root = hub_cache()
    for partial in sorted(root.glob("models--*/blobs/*.incomplete")) if root.exists() else []:
        etag = partial.name.split(".", 1)[0]
        lock = FileLock(str(root / ".locks" / partial.parent.parent.name / f"{etag}.lock"))
        try:
            with lock.acquire(timeout=0):
                partial.unlink(missing_ok=True)
                removed.append(partial)
        except (Timeout, OSError):
            continue  # a download is running: leave its file alone
    packages = config.cache_dir() / "packages"
    for partial in packages.glob(".*.incomplete") if packages.exists() else []:
        if time.time() - partial.stat().st_mtime > 3600:  # an assembly takes seconds; an hour-old one is dead
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def _repo_dir(repo_id: str) -> Path:
    return hub_cache() / f"models--{repo_id.replace('/', '--')}"


def _snapshot_dir(reference: HubReference) -> Path | None:
    repo = _repo_dir(reference.repo_id)
    revision = reference.revision or "main"
    ref_file = repo / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = repo / "snapshots" / commit
    inside = snapshot.resolve().is_relative_to(hub_cache().resolve()) if snapshot.exists() else False
    return snapshot if inside and snapshot.is_dir() else None


def _local_files(snapshot: Path) -> list[str]:
    return sorted(
        str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf") if p.is_file()
    )


def from_cache(reference: HubReference) -> Fetched | None:
    """The cached files of `reference`, or None when they are not (all) there."""
    snapshot = _snapshot_dir(reference)
    if snapshot is None:
        return None
    names = _local_files(snapshot)
    try:
        choice = _choose(reference, names)
    except ModelNotFoundError:
        return None
    paths = tuple(snapshot / name for name in choice.files)
    if not all(p.is_file() for p in paths):
        return None
    return Fetched(reference, snapshot.name, paths, choice.quant)


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
        label = f"{self.repo_id}:{self.quant}" if self.quant else f"{self.repo_id}/{self.files[0].name}"
        return label


def cached_models() -> list[CachedModel]:
    """Every loadable model in the cache, from huggingface_hub's cache scan."""
    if not hub_cache().exists():
        return []
    with _translated(None):
        info = _hf().scan_cache_dir(hub_cache())
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            by_name = {str(f.file_path.relative_to(revision.snapshot_path)): f for f in revision.files}
            for choice in choices(list(by_name)):
                files = tuple(by_name[n].file_path for n in choice.files)
                size = sum(by_name[n].size_on_disk for n in choice.files)
                found.append(CachedModel(repo.repo_id, revision.commit_hash, tuple(sorted(revision.refs)), files, choice.quant, size))
    return found


def delete(models: list[CachedModel]) -> int:
    """Remove these models' files; empty snapshots and repositories go too. Returns bytes freed."""
    freed = 0
    for model in models:
        for path in model.files:
            blob = path.resolve()
            freed += blob.stat().st_size if blob.exists() else 0
            remove_file(path)
    for repo in {_repo_dir(m.repo_id) for m in models}:
        snapshots = repo / "snapshots"
        for snapshot in list(snapshots.iterdir()) if snapshots.exists() else []:
            if not any(p.is_file() or p.is_symlink() for p in snapshot.rglob("*")):
                shutil.rmtree(snapshot, ignore_errors=True)
        if not snapshots.exists() or not any(snapshots.iterdir()):
            shutil.rmtree(repo, ignore_errors=True)
    return freed
