"""Hashing model files, and remembering the hashes (the store, chat records, bench and the prompt cache)."""

from __future__ import annotations

import contextlib
import hashlib
import json
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


def _remembered(path: Path, compute: bool) -> str | None:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    store = paths.hash_memo_file()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if key not in known:
        if not compute:
            return None
        known[key] = sha256_of(path)
        with contextlib.suppress(OSError):  # a memo, not a record: an unwritable data dir costs a re-hash next time
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(known))
    return str(known[key])
