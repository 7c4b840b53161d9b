"""Downloads from the Hugging Face Hub into a verified cache: the only module that uses huggingface_hub.

- Cache: huggingface_hub's own layout under `config.cache_dir()/hub`, so the files stay plain
  `.gguf` files other tools can use. A file becomes visible (a snapshot link) only when complete.
  Within one pull a dropped connection is resumed with a Range request while data keeps
  flowing; a pull that fails in the end leaves no partial file behind (huggingface_hub 2.x
  downloads to a per-process temporary file), so the next pull starts over cleanly.
- Integrity: hf_hub_download does not check what it wrote; every new download is hashed and
  compared with the LFS sha256 from the repository listing, and removed on mismatch.
- Endpoint and token are read at call time ($HF_ENDPOINT, $HF_TOKEN), never at import.
- Every library exception is translated in one ordered table (`translated`, below).
- The cache's layout, read without the library, is llmcli/store/cache.py's.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.config.settings import default
from llmcli.errors import ExitCode, IntegrityError, LlmcliError, ModelNotFoundError, ResourceError, UsageError
from llmcli.store import memory
from llmcli.store.cache import (
    CachedModel,
    Fetch,
    Fetched,
    ProgressCallback,
    RemoteFile,
    choose,
    from_cache,
    partial_downloads,
    remove_file,
)
from llmcli.store.file_hashes import sha256_of
from llmcli.store.references import HubReference, check_filename, choices, projector_file
from llmcli.units import human_size

DISK_MARGIN = 64 * 1024 * 1024


def _hf(timeout: float | None = None) -> Any:
    """Import huggingface_hub on first use (never at import: `--help` stays fast)."""
    if timeout is not None and "huggingface_hub" not in sys.modules:
        # Read once, at its import: how long a download may wait for its next bytes.
        os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(max(1, math.ceil(timeout))))
    # No user-agent telemetry: it also makes the client fetch a registry from the Hub, with a
    # 3-second timeout that would stall every offline run.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import huggingface_hub
    import huggingface_hub.errors  # noqa: F401  (the exception classes `translated` maps)

    # Its retry warnings ("Trying to resume download...") are not for our users' stderr;
    # what failed in the end reaches them as one translated error line.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    return huggingface_hub


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline(flag: bool = False) -> bool:
    return flag or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def fetch(reference: HubReference, policy: Fetch) -> Fetched:
    """The model files of `reference` in the local cache, downloading what is missing.

    Without `refresh`, a model already in the cache is used without any request (as `run` does);
    `pull` refreshes: it lists the repository and downloads only what changed. A Hub that accepts the
    connection and then says nothing is given up on after `policy.timeout` seconds (exit 4).
    """
    offline_only = offline(policy.offline)
    _hf(policy.timeout)
    if not policy.refresh or offline_only:
        cached = from_cache(reference)
        if cached is not None:
            return cached
        if offline_only:
            raise ModelNotFoundError(
                f"{reference} is not in the cache ({paths.hub_cache()}) and offline mode is on",
                hint=f"Run `llmcli pull {reference}` while online.",
            )
    waiting = policy.on_waiting(_host()) if policy.on_waiting is not None else nullcontext()
    with translated(reference, policy.timeout):
        with waiting:
            commit, remote = _listing(reference, policy.timeout)
        choice = choose(reference, list(remote))
        projector = projector_file(list(remote), choice)  # a vision model's projector comes with it
        files = [remote[name] for name in (*choice.files, *([projector] if projector else []))]
        memory.check_memory(str(reference), sum(f.size or 0 for f in files), force=policy.force)
        _check_disk_space(reference, files)
        prune_partial()  # partial files a killed process left behind
        if policy.on_files is not None:
            policy.on_files(tuple(files))
        downloaded = tuple(_download(reference, file, policy) for file in files)
    return Fetched(reference, commit, downloaded[: len(choice.files)], choice.quant)


def listed_quants(reference: HubReference, timeout: float) -> list[tuple[str | None, tuple[str, ...], int]]:
    """The models a Hub repository offers, from its listing (nothing is downloaded): (quant, files, bytes in all)."""
    _hf(timeout)
    with translated(reference, timeout):
        _, remote = _listing(reference, timeout)
    return [(c.quant, c.files, sum(remote[f].size or 0 for f in c.files)) for c in choices(list(remote))]


def _host() -> str:
    return endpoint().split("://", 1)[-1].split("/", 1)[0]


def _listing(reference: HubReference, timeout: float) -> tuple[str | None, dict[str, RemoteFile]]:
    hf = _hf()
    api = hf.HfApi(endpoint=endpoint(), token=_token())
    info = api.model_info(reference.repo_id, revision=reference.revision, files_metadata=True, timeout=timeout)
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


def _check_disk_space(reference: HubReference, files: list[RemoteFile]) -> None:
    needed = sum(f.size or 0 for f in files if _cached_path(reference, f.name) is None)
    if not needed:
        return
    where = paths.hub_cache()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed + DISK_MARGIN > free:
        raise ResourceError(
            f"not enough disk space for {reference}: needs {human_size(needed)}, {human_size(free)} free in {where}",
            hint="Free some space (llmcli rm …) or point LLMCLI_CACHE_DIR at a larger disk.",
        )


def _cached_path(reference: HubReference, filename: str) -> Path | None:
    found = _hf().try_to_load_from_cache(
        reference.repo_id, filename, cache_dir=paths.hub_cache(), revision=reference.revision
    )
    return Path(found) if isinstance(found, str) else None


def _download(reference: HubReference, file: RemoteFile, policy: Fetch) -> Path:
    already = _cached_path(reference, file.name) is not None
    path = Path(_hf().hf_hub_download(
        reference.repo_id, file.name, revision=reference.revision, cache_dir=paths.hub_cache(),
        endpoint=endpoint(), token=_token(), tqdm_class=_relay(file.name, policy.on_progress), etag_timeout=policy.timeout,
    ))
    resolved = path.resolve()
    if not resolved.is_relative_to(paths.hub_cache().resolve()) or not resolved.is_file():
        raise IntegrityError(f"{file.name} from {reference.repo_id} resolved outside the cache or to a non-file: {resolved}")
    if not already and file.sha256:
        actual = sha256_of(path)
        if actual != file.sha256:
            remove_file(path)
            raise IntegrityError(
                f"{file.name} from {reference.repo_id} failed its checksum: sha256 {actual[:16]}… "
                f"instead of {file.sha256[:16]}…; the download was removed",
                hint="Try again; if it keeps failing, the server or a proxy is corrupting the file.",
            )
    return path


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
    for partial, lock_file in partial_downloads():
        try:
            with FileLock(str(lock_file)).acquire(timeout=0):
                partial.unlink(missing_ok=True)
                removed.append(partial)
        except (Timeout, OSError):
            continue  # a download is running: leave its file alone
    packages = paths.assembled_models_dir()
    for partial in packages.glob(".*.incomplete") if packages.exists() else []:
        if time.time() - partial.stat().st_mtime > 3600:  # an assembly takes seconds; an hour-old one is dead
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def cached_models() -> list[CachedModel]:
    """Every loadable model in the cache, from huggingface_hub's cache scan."""
    if not paths.hub_cache().exists():
        return []
    with translated(None):
        info = _hf().scan_cache_dir(paths.hub_cache())
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            by_name = {str(f.file_path.relative_to(revision.snapshot_path)): f for f in revision.files}
            for choice in choices(list(by_name)):
                files = tuple(by_name[n].file_path for n in choice.files)
                size = sum(by_name[n].size_on_disk for n in choice.files)
                refs = tuple(sorted(revision.refs))
                found.append(CachedModel(repo.repo_id, revision.commit_hash, refs, files, choice.quant, size))
    return found


# -- one ordered table: huggingface_hub's and the transport's exceptions -> LlmcliErrors --------------


@contextmanager
def translated(reference: HubReference | None, timeout: float | None = None) -> Iterator[None]:
    """huggingface_hub's and the transport's exceptions -> one-line LlmcliErrors (order matters)."""
    errors = _hf().errors
    name = str(reference) if reference else "the cache"
    repo = reference.repo_id if reference else ""
    try:
        yield
    except (LlmcliError, KeyboardInterrupt):
        raise
    except errors.GatedRepoError:
        raise LlmcliError(
            f"{repo} is gated: you need to accept its terms and authenticate to download it",
            hint="Accept the license on the model page, then set HF_TOKEN to a token with access.",
        ) from None
    except errors.RepositoryNotFoundError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", 404)
        raise ModelNotFoundError(
            f"repository {repo} not found on {endpoint()}" + (" (or it is private)" if status == 401 else ""),
            hint="Check the name (OWNER/REPO); a private repository needs HF_TOKEN.",
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"revision {reference.revision if reference else ''!r} not found in {repo}") from None
    except errors.RemoteEntryNotFoundError:
        raise ModelNotFoundError(f"{name}: file not found in the repository",
                                 hint="`llmcli pull OWNER/REPO` lists the files.") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise ModelNotFoundError(f"{name} is not in the cache and the Hub cannot be asked (offline)",
                                 hint="Run `llmcli pull` while online.") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise LlmcliError(f"{endpoint()} refused access to {repo} (HTTP {status})",
                              hint="Set HF_TOKEN to a token with access to this repository.") from None
        raise LlmcliError(f"the Hub answered HTTP {status} for {name}", exit_code=ExitCode.NETWORK,
                          hint="Try again later, or use --offline for what is cached.") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ResourceError(f"the disk filled up while downloading {name}",
                                hint="Free some space and try again; nothing partial was kept.") from None
        raise _network_error(name, exc) from None
    except Exception as exc:  # the HTTP library's transport errors (connect, read, truncated body)
        raise _network_error(name, exc, timeout) from None


def _network_error(name: str, exc: BaseException, timeout: float | None = None) -> LlmcliError:
    if "timeout" in type(exc).__name__.lower() or "timed out" in str(exc).lower():
        return LlmcliError(
            f"{_host()} did not answer within {timeout or default('hub_timeout'):g} s while fetching {name}",
            exit_code=ExitCode.NETWORK,
            hint="Check the connection or $HF_ENDPOINT; --hub-timeout (LLMCLI_HUB_TIMEOUT) waits longer; "
            "--offline uses only the cache.",
        )
    return LlmcliError(
        f"download of {name} from {endpoint()} failed: {type(exc).__name__}: {str(exc)[:200]}",
        exit_code=ExitCode.NETWORK,
        hint="Check the connection and try again (nothing partial was kept); --offline uses only the cache.",
    )
