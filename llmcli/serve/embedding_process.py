"""`/v1/embeddings` and Ollama's `/api/embed`: the model in embedding mode, in a process of its own (as each model's
answering engine is: llmcli/serve/engine_process.py), so that llama.cpp failing on a text ends that process, not the
server. Started on the first request (its memory checked then, as `llmcli embed` loads it: the model's own pooling, else
mean; 32 texts a pass) and kept; one request at a time, off the event loop; the same vectors as `llmcli embed`. A
process that died fails the request it was answering (503, saying so) and is started again by the next one.

Messages to the child (`python -m llmcli.serve.engine_child FD`, or forked by the server's zygote): ("embedding",
request), then ("embed", texts, normalize, truncate)…; from it: ("ready", dimensions) or ("failed", …), then
("embedded", results) for each."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

from llmcli.errors import LlmcliError
from llmcli.serve import engine_zygote
from llmcli.serve.engine_spec import handshake, load_failure, spawn_child

BATCH = 32  # texts sharing a context a pass


class Embeddings:
    def __init__(self, request: Any):
        self.request = request
        self._lock = threading.Lock()
        self._child: tuple[engine_zygote.EngineChild, Connection] | None = None
        self._dimensions = 0

    def embed(self, texts: list[str], normalize: bool = False, truncate: bool = False) -> list[Any]:
        """One result per text (llmcli/embed/embedded.py's Embedded): `normalize` scales vectors to length 1 (Ollama's
        /api/embed), `truncate` embeds the first tokens of a text too long (else its result is an error).
        LlmcliError when the model cannot be loaded, or its process died answering."""
        with self._lock:
            proc, conn = self._child or self._start()
            try:
                conn.send(("embed", texts, normalize, truncate))
                reply = conn.recv()
            except (EOFError, OSError):
                self._end()
                raise LlmcliError(f"the embedding engine stopped ({_ended(proc)}) while it embedded this request; "
                                  "the next request starts it again") from None
            if reply[0] == "failed":
                raise load_failure(reply)
            return list(reply[1])

    @property
    def dimensions(self) -> int:
        return self._dimensions

    @property
    def pid(self) -> int | None:
        """The embedding process's, while one runs (read without the lock: /health never waits on an embedding)."""
        child = self._child
        return child[0].pid if child is not None else None

    def close(self) -> None:
        with self._lock:
            self._end()

    def _start(self) -> tuple[engine_zygote.EngineChild, Connection]:
        proc, conn = spawn_child()
        dimensions = handshake(proc, conn, ("embedding", self.request))
        self._child, self._dimensions = (proc, conn), int(dimensions)
        return proc, conn

    def _end(self) -> None:
        if self._child is not None:
            proc, conn = self._child
            self._child = None
            conn.close()
            engine_zygote.kill(proc)


def _ended(proc: engine_zygote.EngineChild) -> str:
    try:
        code = proc.wait(5)
    except Exception:  # noqa: BLE001 — (still running: it is killed)
        return "it stopped answering"
    return f"killed by signal {-code}" if code < 0 else f"exit {code}"


def serve_embeddings(conn: Connection, request: Any) -> None:
    """In the child: load the model in embedding mode, say so, then embed each request until the server goes."""
    from llmcli.errors import LlmcliError
    from llmcli.pipeline.local import open_embedder
    from llmcli.serve.engine_spec import failed_message

    try:
        _, _, embedder = open_embedder(request, "model", normalize=False, truncate=False, texts_per_batch=BATCH)
    except LlmcliError as exc:
        conn.send(failed_message(exc))
        return
    conn.send(("ready", int(embedder.n_embd)))
    while True:
        try:
            _, texts, normalize, truncate = conn.recv()
        except (EOFError, OSError):
            return
        embedder.normalize, embedder.truncate = normalize, truncate
        try:
            conn.send(("embedded", list(embedder.embed(texts))))
        except LlmcliError as exc:
            conn.send(failed_message(exc))
