"""Hashing model files, and remembering the hashes (the store, chat records, bench and the prompt cache)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

from llmcli import paths


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remembered_sha256(path: Path) -> str:
    """sha256 of a model file, remembered by (path, size, mtime) so a large model is hashed once."""
    digest = _remembered(path, compute=True)
    assert digest is not None
    return digest


def known_sha256(path: Path) -> str | None:
    """The remembered sha256 of a model file, or None if it was never hashed (nothing is computed)."""
    return _remembered(path, compute=False)


def memo_key(path: Path) -> str:
    """What a hash is remembered by: the file's resolved path, size and mtime (a changed file is hashed again)."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def _remembered(path: Path, compute: bool) -> str | None:
    key = memo_key(path)
    store = paths.hash_memo_file()
    known = _read(store)
    if key not in known:
        if not compute:
            return None
        digest = sha256_of(path)
        with contextlib.suppress(OSError):  # a memo, not a record: an unwritable data dir costs a re-hash next time
            _remember(store, key, digest)
        return digest
    return str(known[key])


MAX_REMEMBERED = 4096  # the newest hashes kept


def _read(store: Path) -> dict[str, str]:
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, str)} if isinstance(known, dict) else {}


def _remember(store: Path, key: str, digest: str) -> None:
    """Add one hash to the memo: under a lock, merged with what other processes wrote meanwhile, and replaced whole
    (a temporary file renamed over it): a full disk or a crash leaves the old memo, never a part of one."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store.with_name(store.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(store)
        known.pop(key, None)
        known[key] = digest
        kept = dict(list(known.items())[-MAX_REMEMBERED:])
        handle, temporary = tempfile.mkstemp(dir=store.parent, prefix=store.name, suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(kept, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, store)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
