"""`python -m llmcli.serve.engine_child FD`: one model's engine, in a process of its own (llmcli/serve/engine_process.py
starts it and talks to it over the socket FD).

It loads the model as `serve` would in its own process (the pipeline: weights, KV cache, prompt store, draft model,
vision projector), then runs its slot server: jobs come in over the socket, each step's events go out with the tokens
each answer sampled (what a restart resumes it from). The server does the queue's accounting; here a job is admitted
as soon as a slot is free. SIGINT is ignored (the server answers Ctrl-C by stopping this process); when the server
goes away, however it went, the socket ends and so does this process, at once.

Messages in: the EngineSpec first (or ("embedding", request): the model in embedding mode instead,
llmcli/serve/embedding_process.py), then ("submit", key, Job fields…), ("cancel", key), ("who",), ("stop",).
Messages out: ("ready", facts) or ("failed", kind, message, hint, exit code), then ("events", [(key, event, failure)],
{key: [(token, logprob)…]}, status or None), ("admitted", key) when a job takes a slot, ("alive",) while a step
runs long, ("sampling", key or None).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ALIVE_EVERY_S = 1.0  # a busy engine says it is alive at least this often (the server's step watchdog)


class _Child:
    def __init__(self, conn: Connection, slots: Any):
        self.conn, self.slots = conn, slots
        self._send_lock = threading.Lock()
        self._jobs: dict[int, Any] = {}
        self._sent: dict[int, int] = {}  # tokens of each answer's record already sent
        self._last_send = time.monotonic()

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)
            self._last_send = time.monotonic()

    def deliver(self, events: list[tuple[Any, Any]]) -> None:
        """One step's events (the engine's thread), with every answer's tokens sampled since the last message."""
        records: dict[int, list[Any]] = {}
        for slot in self.slots.scheduler.slots:
            if slot is not None and slot.record is not None:
                key = slot.tag.key
                sent = self._sent.get(key, 0)
                if len(slot.record) > sent:
                    records[key] = slot.record[sent:]
                    self._sent[key] = len(slot.record)
        out, finished = [], False
        for job, event in events:
            out.append((job.key, event, job.failure))
            if type(event).__name__ == "Done":
                finished = True
                self._jobs.pop(job.key, None)
                self._sent.pop(job.key, None)
        self.send(("events", out, records, self.slots.status() if finished else None))

    def step_done(self) -> None:
        if time.monotonic() - self._last_send >= ALIVE_EVERY_S:
            self.send(("alive",))

    def read(self) -> None:
        """The socket's messages (its own thread); its end is this process's end."""
        from llmcli.decode.serving import Job

        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "submit":
                    _, key, tokens, generation, seed, clock, stable, images, resumed = message
                    job = Job(tokens, generation, seed, lambda event: None, clock=clock, stable=stable, images=images,
                              resumed=resumed, key=key)
                    self._jobs[key] = job
                    self._sent[key] = len(resumed)
                    self.slots.submit(job)
                elif kind == "cancel":
                    cancelled = self._jobs.get(message[1])
                    if cancelled is not None:
                        cancelled.cancelled.set()
                elif kind == "who":
                    slot = self.slots.scheduler.sampling
                    self.send(("sampling", None if slot is None else slot.tag.key))
                elif kind == "stop":
                    self.slots.stop()
        except (EOFError, OSError):
            pass
        os._exit(0)  # the server is gone (or told this process to stop and has): nothing here outlives it


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the server's: it stops this process)
    conn = Connection(fd)
    try:
        spec = conn.recv()
    except (EOFError, OSError):
        return
    if isinstance(spec, tuple) and spec[:1] == ("embedding",):  # (the model in embedding mode: /v1/embeddings)
        from llmcli.serve.embedding_process import serve_embeddings

        try:
            serve_embeddings(conn, spec[1])
        finally:
            os._exit(0)
    try:
        from llmcli.errors import ContextLost, LlmcliError
        from llmcli.serve.engine_spec import CONTEXT_LOST, failed_message, load_engine

        try:
            slots, facts = load_engine(spec)
        except LlmcliError as exc:
            conn.send(failed_message(exc))
            return
        child = _Child(conn, slots)
        slots.deliver = child.deliver
        slots.on_step = child.step_done
        slots.on_admit = lambda job: child.send(("admitted", job.key))  # (a death from now on may be its doing)
        slots.queue_size = 1 << 20  # (the server counts the queue's places)
        threading.Thread(target=child.read, name="llmcli-engine-reader", daemon=True).start()
        conn.send(("ready", dataclasses.replace(facts, pid=os.getpid())))
        try:
            slots.run()
        except ContextLost:  # (no KV cache left: the server starts another engine, where the answers go on)
            os._exit(CONTEXT_LOST)
    except Exception as exc:  # noqa: BLE001 — said to the server, which reports it as the load's failure
        try:
            conn.send(failed_message(LlmcliError(f"the engine failed: {exc}")))
        except OSError:
            pass
    finally:
        sys.stdout.flush()
    os._exit(0)


def _keep(weights: Any) -> None:
    """(The zygote.) Load those weights and keep them for the engines forked from now on, unless kept already; a file
    that is gone or no longer a well-formed GGUF is left to the engine (which loads it itself and says why not)."""
    from llmcli.errors import LlmcliError
    from llmcli.llama.engine_config import EngineConfig
    from llmcli.llama.weights import keep_loaded
    from llmcli.store.gguf_header import read_header

    path = Path(weights.path)
    try:
        read_header(path)  # (pre-flight: llama.cpp never sees a malformed file, here either)
        keep_loaded(path, EngineConfig(mmap=weights.mmap, mlock=weights.mlock))
    except (LlmcliError, OSError):
        pass


def zygote(fd: int) -> None:
    """`--zygote FD`: llmcli's engine modules imported once, then an engine forked for each "spawn" message (its socket
    passed along; first the weights it names loaded and kept, unless they are), while this process stays
    single-threaded; each one's exit reported; "drop" frees kept weights. Ends with the server's socket."""
    import select
    import socket

    from llmcli.serve.engine_zygote import MESSAGE_MAX, KeptWeights

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import llmcli.pipeline.local  # noqa: F401  (what every engine imports: before the first fork)
    import llmcli.serve.engine_spec  # noqa: F401
    from llmcli.llama.weights import release_kept

    control = socket.socket(fileno=fd)
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([control], [], [], 0.1)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            control.sendall(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, MESSAGE_MAX, 1)
        if not message:
            os._exit(0)  # the server is gone
        verb, _, named = message.decode().partition(" ")
        if verb == "drop":
            release_kept(Path(KeptWeights.read(named).path))
        elif named:  # spawn, with the weights to keep
            _keep(KeptWeights.read(named))
        for engine_fd in fds:
            pid = os.fork()
            if pid == 0:
                control.close()
                main(engine_fd)
                os._exit(0)
            os.close(engine_fd)
            children.add(pid)
            control.sendall(f"spawned {pid}\n".encode())


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote(int(sys.argv[2]))
    else:
        main(int(sys.argv[1]))
