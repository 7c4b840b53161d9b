"""A loopback stand-in for the Hugging Face Hub: the routes and headers the real huggingface_hub client uses.

- `GET /api/models/OWNER/REPO[/revision/REV]?blobs=true`: repository info with LFS sizes and sha256;
- `HEAD|GET /OWNER/REPO/resolve/REV/FILE`: 302 to a CDN URL with X-Repo-Commit, X-Linked-Etag,
  X-Linked-Size (as the Hub does for LFS files), or 401 GatedRepo / 404 RepoNotFound / EntryNotFound;
- `GET /cdn/SHA256`: the bytes, with Range support (206) and injectable faults: drop the
  connection after N bytes, or serve corrupted bytes of the same size.
Every request is logged as (method, path, range header) for tests to assert on.

The server runs in a child process (its threads live there), so the test process stays single-threaded
and may fork the CLI runs; the request log and the faults are shared through a multiprocessing manager.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import re
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HASHES: dict[Path, str] = {}  # by path: each file is hashed once (conftest adds the models it hashed)


def sha256_of(path: Path) -> str:
    if path not in HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        HASHES[path] = digest.hexdigest()
    return HASHES[path]


@dataclass
class Fault:
    drop_after: int | None = None  # close the connection after this many bytes of a body
    times: int = 1  # for this many GETs of the file
    corrupt: bool = False  # flip a byte in the middle (same size), on every GET
    delay_per_mb: float = 0.0  # seconds to sleep per MiB sent: a slow download to interrupt
    listed_size: int | None = None  # what the repository listing claims the size is


@dataclass
class Repo:
    commit: str
    files: dict[str, Path]
    gated: bool = False


class SharedLog:
    """The request log, shared with the server process: reads like a list of (method, path, range)."""

    def __init__(self, proxy: Any):
        self.proxy = proxy

    def append(self, entry: tuple[str, str, str | None]) -> None:
        self.proxy.append(entry)

    def clear(self) -> None:
        del self.proxy[:]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.proxy))

    def __eq__(self, other: object) -> bool:
        return list(self.proxy) == other

    def __repr__(self) -> str:
        return repr(list(self.proxy))


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    faults: Any = field(default_factory=dict)  # by file name; a shared dict once started
    log: Any = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, Path], gated: bool = False) -> None:
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = Repo(commit, files, gated)

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple[str, str, str | None]]:
        return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]

    def start(self) -> FakeHub:
        self._manager = multiprocessing.Manager()
        faults = self._manager.dict(self.faults)
        self.faults, self.log = faults, SharedLog(self._manager.list())
        ready = multiprocessing.Queue()
        self._process = multiprocessing.Process(target=_serve, args=(self.repos, faults, self.log.proxy, ready), daemon=True)
        self._process.start()
        self.url = ready.get(timeout=30)
        return self

    def serve(self, ready: Any) -> None:
        """Run the server in this process until it is terminated; put its URL on `ready` first."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.handle_any(body=False)

            def do_GET(self) -> None:
                self.handle_any(body=True)

            def handle_any(self, body: bool) -> None:
                hub.log.append((self.command, self.path, self.headers.get("Range")))
                path = self.path.split("?", 1)[0]
                try:
                    if path.startswith("/api/models/"):
                        self.api(path[len("/api/models/"):])
                    elif path.startswith("/cdn/"):
                        self.cdn(path[len("/cdn/"):], body)
                    elif "/resolve/" in path:
                        self.resolve(path.lstrip("/"))
                    else:
                        self.error(404, "RepoNotFound", "not found")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def error(self, status: int, code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def repo(self, repo_id: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self.error(401, "RepoNotFound", "Repository not found")
                    return None
                if repo.gated and "authorization" not in {k.lower() for k in self.headers}:
                    self.error(401, "GatedRepo", "Access to model is restricted")
                    return None
                return repo

            def api(self, rest: str) -> None:
                match = re.fullmatch(r"([^/]+/[^/]+)(?:/revision/([^/]+))?", rest)
                if not match:
                    return self.error(404, "RepoNotFound", "not found")
                repo = self.repo(match.group(1))
                if repo is None:
                    return
                siblings = []
                for name, source in repo.files.items():
                    fault = hub.faults.get(name)
                    size = fault.listed_size if fault and fault.listed_size is not None else source.stat().st_size
                    siblings.append({
                        "rfilename": name, "size": size, "blobId": hashlib.sha1(name.encode()).hexdigest(),
                        "lfs": {"sha256": sha256_of(source), "size": size, "pointerSize": 134},
                    })
                data = json.dumps({"id": match.group(1), "modelId": match.group(1), "sha": repo.commit,
                                   "siblings": siblings, "private": False}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def resolve(self, rest: str) -> None:
                owner, name, _, revision, filename = rest.split("/", 4)
                repo = self.repo(f"{owner}/{name}")
                if repo is None:
                    return
                if revision not in ("main", repo.commit):
                    return self.error(404, "RevisionNotFound", "Invalid rev id")
                source = repo.files.get(filename)
                if source is None:
                    return self.error(404, "EntryNotFound", "Entry not found")
                sha = sha256_of(source)
                self.send_response(302)
                # Another host name for the same server: like the Hub's CDN, the client must not follow it on HEAD.
                self.send_header("Location", f"{hub.url.replace('127.0.0.1', 'localhost')}/cdn/{sha}")
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(source.stat().st_size))
                self.send_header("ETag", f'"{sha}"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            def cdn(self, sha: str, body: bool) -> None:
                found = [(n, p) for r in hub.repos.values() for n, p in r.files.items() if sha256_of(p) == sha]
                if not found:
                    return self.error(404, "EntryNotFound", "no such blob")
                name, source = found[0]
                size = source.stat().st_size
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if match:
                    start = int(match.group(1))
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(size - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{sha}"')
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                fault = hub.faults.get(name)
                limit = None
                if fault and fault.drop_after is not None and fault.times > 0:
                    fault.times -= 1
                    hub.faults[name] = fault  # the shared copy counts down too
                    limit = fault.drop_after
                middle = size // 2
                sent = 0
                with source.open("rb") as handle:
                    handle.seek(start)
                    position = start
                    while True:
                        block = handle.read(1 << 20)
                        if not block:
                            break
                        if fault and fault.corrupt and position <= middle < position + len(block):
                            block = bytearray(block)
                            block[middle - position] ^= 0xFF
                            block = bytes(block)
                        if limit is not None and sent + len(block) > limit:
                            self.wfile.write(block[: limit - sent])
                            self.wfile.flush()
                            self.close_connection = True
                            self.connection.shutdown(2)
                            return
                        self.wfile.write(block)
                        sent += len(block)
                        position += len(block)
                        if fault and fault.delay_per_mb:
                            time.sleep(fault.delay_per_mb)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        ready.put(self.url)
        self.server.serve_forever()

    def stop(self) -> None:
        self._process.terminate()
        self._process.join(timeout=10)
        self._manager.shutdown()


def _serve(repos: dict[str, Repo], faults: Any, log: Any, ready: Any) -> None:
    """The server process: answer until terminated."""
    hub = FakeHub(repos, faults, SharedLog(log))
    hub.serve(ready)
