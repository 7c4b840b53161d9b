"""Ollama's routes about its own store, both ways: /api/pull's body and its progress lines (`serve --allow-pull`:
llmcli/serve/pulling.py downloads), and what the routes that change Ollama's store (create, copy, delete, push,
blobs) answer: that llmcli's store is changed from its command line. No HTTP.
"""

from __future__ import annotations

import time
from typing import Any

from llmcli.errors import LlmcliError, ModelNotFoundError, UsageError
from llmcli.serve import pulling
from llmcli.serve.answer_request import ApiError
from llmcli.serve.model_pool import checked_name
from llmcli.serve.request_fields import check_fields

PULL_FIELDS = frozenset({"model", "name", "stream", "insecure"})  # (insecure: a registry's TLS; the Hub's is checked)
# Ollama's routes that change its own store: llmcli's store is changed from the command line
STORE_ROUTES = {"create": "create models (a GGUF file, a path or a Hub model is used as it is)",
                "copy": "copy models (`llmcli config` aliases name a model twice)",
                "delete": "delete models (`llmcli rm NAME` does)", "push": "push models to a registry",
                "blobs": "take blobs (a GGUF file, a path or a Hub model is used as it is)"}
PROGRESS_EVERY_S = 0.25  # a download's progress lines: at most this often per file (and its last)


def parse_pull(body: Any) -> tuple[str, bool]:
    """/api/pull: the model to download (`model`, or the older `name`: a Hub reference, or anything `-m` takes) and
    whether its progress streams (Ollama's default) or one reply says it is done."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, PULL_FIELDS)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required", param="model")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    return checked_name(name), stream


class PullReply:
    """A pull's events (llmcli/serve/pulling.py) as Ollama's progress lines: `pulling manifest`, `pulling DIGEST`
    with `total` and `completed` for each file (keyed by its sha256, as clients draw a bar per digest), `verifying
    sha256 digest`, `success`; or `{"error"}`."""

    def __init__(self) -> None:
        self._digests: dict[str, str] = {}
        self._shown: dict[str, tuple[float, int]] = {}  # by file: when its last line went, and its bytes then

    def _file(self, name: str, done: int, total: int | None, now: float) -> list[dict[str, Any]]:
        """A file's line, unless its last one said the same or went less than PROGRESS_EVERY_S ago (its end goes)."""
        last, shown = self._shown.get(name, (-PROGRESS_EVERY_S, -1))
        if done == shown or (done != total and now - last < PROGRESS_EVERY_S):
            return []
        self._shown[name] = (now, done)
        digest = self._digests.get(name, name)
        return [{"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest, "total": total or 0,
                 "completed": done}]

    def lines(self, event: pulling.PullEvent) -> list[dict[str, Any]]:
        now = time.monotonic()
        if isinstance(event, pulling.Started):
            return [{"status": "pulling manifest"}]
        if isinstance(event, pulling.Listed):
            self._digests.update({f.name: f"sha256:{f.sha256}" for f in event.files if f.sha256})
            return [line for f in event.files for line in self._file(f.name, 0, f.size, now)]
        if isinstance(event, pulling.Progress):
            return self._file(event.file, event.done, event.total, now)
        if isinstance(event, pulling.Pulled):  # (every file was checked against its sha256 as it arrived)
            done = [line for f in event.files for line in self._file(f.name, f.size or 0, f.size, now)]
            return [*done, {"status": "verifying sha256 digest"}, {"status": "success"}]
        return [{"error": event.error.message}]


def pull_failure(error: LlmcliError) -> ApiError:
    """A pull that failed, as a whole reply's status: 404 not found, 400 not a model's name, else 500 (as Ollama)."""
    status = 404 if isinstance(error, ModelNotFoundError) else 400 if isinstance(error, UsageError) else 500
    return ApiError(status, error.message)
