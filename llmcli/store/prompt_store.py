"""The prompt cache on disk: saved KV states of prompts, found by the longest prefix they share with a new one.

Layout under the prompt cache dir (paths.prompt_cache_dir()):

    <key>/entries/<id>.kv     one saved state: header, its tokens, llama.cpp's state bytes
    <key>/blocks/<hash>       the ids of the entries whose tokens begin with this chain of blocks, one a line

`key` fingerprints everything that changes the KV (model sha256, llama.cpp build, context and KV
settings): states saved under another key are never looked at. Tokens are cut into BLOCK-token
blocks and each block's hash chains the hashes before it (as vLLM's prefix caching does), so the
entry that shares the longest prefix with a prompt is found with one lookup per block, longest
first, without opening any other file.

An entry file is: MAGIC, a u32 header length, the header (JSON: format version, key, token count,
payload length, sha256 of everything after the header), the tokens (int32 little-endian), the payload.
It is written to a temp file and renamed, so a reader sees a whole file or none; everything is
checked (size, key, checksum) before a byte of it is handed to llama.cpp. A damaged file is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.answer.shared_prefix import shared_prefix

MAGIC = b"LLMCLIKV"
FORMAT_VERSION = 1
BLOCK = 64  # tokens per block of the hash chain
_HEADER_MAX = 64 * 1024
_STALE_TEMP_S = 3600  # temp files older than this were left by a process that died while saving


class BadEntry(Exception):
    """A state file that must not reach llama.cpp: why, in a few words."""


@dataclass(frozen=True)
class Found:
    """A saved state that shares `shared` tokens with the prompt looked up."""

    path: Path
    tokens: array[int]  # all the tokens the state holds
    payload: memoryview  # llama.cpp's state bytes, checked; writable (llama.cpp reads it in place)
    shared: int


@dataclass(frozen=True)
class EntryInfo:
    """One saved state, as `llmcli cache list` shows it (read from its header only)."""

    path: Path
    key: str
    model: str
    n_tokens: int
    size: int
    used: float  # last use, seconds since the epoch (the file's mtime)


def fingerprint(signature: dict[str, Any]) -> str:
    """The key of a KV signature: what a state depends on, hashed."""
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()


def block_hashes(key: str, tokens: Sequence[int]) -> list[str]:
    """The hash chain of the full blocks of `tokens`: item k names the first (k + 1) * BLOCK tokens."""
    hashes = []
    previous = key.encode()
    data = _token_bytes(tokens)
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        previous = hashlib.sha256(previous + data[start * 4 : (start + BLOCK) * 4]).digest()
        hashes.append(previous[:16].hex())
    return hashes


def _fits(saved: Sequence[int], tokens: Sequence[int], at_least: int, whole: bool) -> bool:
    shared = shared_prefix(saved, tokens)
    return shared >= at_least and (not whole or shared == len(saved))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("i", tokens)
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian everywhere
        packed.byteswap()
    return packed.tobytes()


class PromptStore:
    """The entries of one key, under `root`, within a disk budget shared by every key."""

    def __init__(self, root: Path, key: str, budget_bytes: int, model: str = ""):
        self.root = root
        self.key = key
        self.budget_bytes = budget_bytes
        self.model = model  # for `cache list`
        self.folder = root / key[:24]
        self.notices: list[str] = []  # for the user: files found damaged and removed, saves skipped

    # -- lookup ----------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], at_least: int = 1, whole: bool = False) -> Found | None:
        """The entry sharing the longest prefix with `tokens` (at least `at_least` tokens), checked;
        with `whole`, only an entry that is all of it a prefix of `tokens`."""
        tried: set[Path] = set()
        hashes = block_hashes(self.key, tokens)
        for k in range(len(hashes) - 1, -1, -1):
            if (k + 1) * BLOCK < at_least:
                break
            for path in self._entries_of(hashes[k]):
                if path in tried:
                    continue
                tried.add(path)
                found = self._check(path, tokens, at_least, whole, (k + 1) * BLOCK)
                if found is not None:
                    return found
        return None

    def _check(self, path: Path, tokens: Sequence[int], at_least: int, whole: bool, indexed: int) -> Found | None:
        """The entry at `path`, indexed as holding the first `indexed` tokens of `tokens`, if it shares enough
        with them and passes every check; a damaged one is removed (with a notice)."""
        try:
            _, listed = _header_tokens(path)  # unchecked: to skip an entry that does not fit without reading it all
            if shared_prefix(listed, tokens) >= indexed and not _fits(listed, tokens, at_least, whole):
                return None  # (sharing less than its index says, it is damaged: the checks below tell how)
            saved, payload = self.read(path)
        except (BadEntry, OSError, ValueError, KeyError, TypeError) as exc:
            reason = str(exc) if isinstance(exc, BadEntry) else "has a damaged header"
            self.notices.append(f"prompt cache: {path.name} {reason}; removed it, evaluating the prompt instead")
            self.remove(path)
            return None
        if not _fits(saved, tokens, at_least, whole):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        return Found(path, saved, payload, shared_prefix(saved, tokens))

    def holds(self, tokens: Sequence[int], n_tokens: int, whole: bool = False) -> bool:
        """Whether an entry holds (to a block) at least the first `n_tokens` of `tokens` (with `whole`: and is
        all of it a prefix of them); only headers are read."""
        hashes = block_hashes(self.key, tokens)
        first = max(0, -(-n_tokens // BLOCK) - 1)
        for block_hash in hashes[first:]:
            for path in self._entries_of(block_hash):
                if not whole:
                    return True
                with contextlib.suppress(OSError, BadEntry, ValueError, KeyError, TypeError):
                    if _fits(_header_tokens(path)[1], tokens, n_tokens, whole=True):
                        return True
        return False

    def _entries_of(self, block_hash: str) -> list[Path]:
        """The entry files a block names that exist, the most recently saved first."""
        entries = self.folder / "entries"
        return [path for entry_id in reversed(_ids(self.folder / "blocks" / block_hash))
                if (path := entries / f"{entry_id}.kv").is_file()]

    def read(self, path: Path) -> tuple[array[int], memoryview]:
        """The tokens and payload of an entry file, after checking all of it; BadEntry if anything is wrong."""
        try:
            with path.open("rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                data = bytearray(size)
                if handle.readinto(data) != size:
                    raise BadEntry("changed while being read")
        except OSError as exc:
            raise BadEntry(f"cannot be read ({exc.strerror or exc})") from None
        view = memoryview(data)
        if size < len(MAGIC) + 4 or bytes(view[: len(MAGIC)]) != MAGIC:
            raise BadEntry("is not a prompt cache file")
        (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4 + header_len
        if header_len > _HEADER_MAX or start > size:
            raise BadEntry("has a damaged header")
        try:
            header = json.loads(bytes(view[len(MAGIC) + 4 : start]))
            version, key, n_tokens = header["version"], header["key"], header["tokens"]
            payload_len, checksum = header["payload"], header["sha256"]
        except (ValueError, KeyError, TypeError):
            raise BadEntry("has a damaged header") from None
        if version != FORMAT_VERSION:
            raise BadEntry(f"was written in format {version!r}, not {FORMAT_VERSION}")
        if key != self.key:
            raise BadEntry("belongs to another model or other engine settings")
        if not (isinstance(n_tokens, int) and isinstance(payload_len, int) and n_tokens > 0 and payload_len > 0):
            raise BadEntry("has a damaged header")
        if size != start + 4 * n_tokens + payload_len:
            raise BadEntry(f"is truncated or padded ({size} bytes, the header says {start + 4 * n_tokens + payload_len})")
        if hashlib.sha256(view[start:]).hexdigest() != checksum:
            raise BadEntry("fails its checksum (damaged on disk)")
        tokens = array("i")
        tokens.frombytes(view[start : start + 4 * n_tokens])
        if sys.byteorder != "little":  # pragma: no cover
            tokens.byteswap()
        return tokens, view[start + 4 * n_tokens :]

    # -- saving ----------------------------------------------------------------------------

    def save(self, tokens: Sequence[int], payload: Any) -> Path | None:
        """Write an entry for `tokens` (payload: a buffer of llama.cpp's state) and index its blocks;
        None, with a notice, when it cannot be written (a full disk): the answer is never affected."""
        token_data = _token_bytes(tokens)
        body_hash = hashlib.sha256(token_data)
        body_hash.update(payload)
        entry_id = hashlib.sha256(self.key.encode() + token_data).hexdigest()[:32]
        header = json.dumps({"version": FORMAT_VERSION, "key": self.key, "tokens": len(tokens),
                             "payload": memoryview(payload).nbytes, "sha256": body_hash.hexdigest(),
                             "model": self.model, "created": time.time()}).encode()
        entries = self.folder / "entries"
        path = entries / f"{entry_id}.kv"
        temp = entries / f".{entry_id}.{os.getpid()}.tmp"
        try:
            entries.mkdir(parents=True, exist_ok=True)
            with temp.open("wb") as handle:
                handle.write(MAGIC + struct.pack("<I", len(header)) + header)
                handle.write(token_data)
                handle.write(payload)
            os.replace(temp, path)  # concurrent saves of the same tokens: the last rename wins, whole
            blocks = self.folder / "blocks"
            blocks.mkdir(exist_ok=True)
            for block_hash in block_hashes(self.key, tokens):
                pointer = blocks / block_hash
                if entry_id not in _ids(pointer):
                    with pointer.open("a", encoding="ascii") as handle:  # one short append: atomic
                        handle.write(entry_id + "\n")
        except OSError as exc:
            _unlink(temp)
            self.notices.append(f"prompt cache: not saved ({exc.strerror or exc})")
            return None
        self.evict(keep=path)
        return path

    # -- the budget ------------------------------------------------------------------------

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove the least recently used entries (of every key) until the total fits the budget."""
        entries = sorted(all_entries(self.root), key=lambda e: e.used)
        total = sum(e.size for e in entries)
        removed = []
        for entry in entries:
            if total <= self.budget_bytes:
                break
            if entry.path == keep and total - entry.size <= self.budget_bytes and len(entries) > 1:
                continue
            self.remove(entry.path)
            total -= entry.size
            removed.append(entry.path)
        if keep in removed:
            self.notices.append("prompt cache: this prompt's state is larger than the budget "
                                "(--prompt-cache-size); not kept")
        _remove_stale_temps(self.root)
        return removed

    def remove(self, path: Path) -> None:
        """Remove an entry and the block pointers that name it (an entry of any key: eviction spans them all)."""
        entry_id = path.name.removesuffix(".kv")
        blocks = path.parent.parent / "blocks"
        with contextlib.suppress(OSError, BadEntry):
            key, tokens = _header_tokens(path)
            for block_hash in block_hashes(key, tokens):
                pointer = blocks / block_hash
                others = [other for other in _ids(pointer) if other != entry_id and (path.parent / f"{other}.kv").is_file()]
                with contextlib.suppress(OSError):
                    if others:
                        _write_atomic(pointer, "".join(f"{other}\n" for other in others))
                    else:
                        pointer.unlink()
        _unlink(path)


def _header(handle: Any) -> tuple[dict[str, Any], int]:
    """The header of an open entry file and where its tokens start."""
    head = handle.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise BadEntry("is not a prompt cache file")
    (header_len,) = struct.unpack_from("<I", head, len(MAGIC))
    if header_len > _HEADER_MAX:
        raise BadEntry("has a damaged header")
    try:
        header = json.loads(handle.read(header_len))
    except ValueError:
        raise BadEntry("has a damaged header") from None
    if not isinstance(header, dict):
        raise BadEntry("has a damaged header")
    return header, len(MAGIC) + 4 + header_len


def _header_tokens(path: Path) -> tuple[str, array[int]]:
    with path.open("rb") as handle:
        header, _ = _header(handle)
        n_tokens = int(header["tokens"])
        tokens = array("i")
        tokens.frombytes(handle.read(4 * n_tokens))
    return str(header["key"]), tokens


def all_entries(root: Path) -> list[EntryInfo]:
    """Every saved state under `root`, from the headers (nothing is checked or loaded)."""
    found = []
    for path in _entry_files(root):
        try:
            stat = path.stat()
            with path.open("rb") as handle:
                header, _ = _header(handle)
            found.append(EntryInfo(path, str(header.get("key", "")), str(header.get("model", "")),
                                   int(header.get("tokens", 0)), stat.st_size, stat.st_mtime))
        except (OSError, BadEntry, ValueError, TypeError):
            with contextlib.suppress(OSError):
                found.append(EntryInfo(path, "", "(damaged)", 0, path.stat().st_size, path.stat().st_mtime))
    return found


def clear(root: Path) -> tuple[int, int]:
    """Remove every saved state and pointer; (entries removed, bytes freed)."""
    entries = all_entries(root)
    for entry in entries:
        _unlink(entry.path)
    for folder in (root.iterdir() if root.is_dir() else ()):
        if folder.is_dir():
            for pointer in (folder / "blocks").glob("*") if (folder / "blocks").is_dir() else ():
                _unlink(pointer)
    _remove_stale_temps(root, max_age_s=0)
    return len(entries), sum(e.size for e in entries)


def _entry_files(root: Path) -> Iterator[Path]:
    if root.is_dir():
        yield from root.glob("*/entries/*.kv")


def _remove_stale_temps(root: Path, max_age_s: float = _STALE_TEMP_S) -> None:
    now = time.time()
    for temp in root.glob("*/entries/.*.tmp") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if now - temp.stat().st_mtime >= max_age_s:
                temp.unlink()


def _write_atomic(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text, encoding="ascii")
    os.replace(temp, path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _ids(pointer: Path) -> list[str]:
    """The entry ids a block pointer lists (well-formed ones only)."""
    try:
        lines = pointer.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return []
    return [line for line in lines if len(line) == 32 and all(c in "0123456789abcdef" for c in line)]
