"""Each model's engine in a supervised process of its own: nothing llama.cpp does takes the server down.

`EngineProcess` is what `serve` (and every warm server) answers through: the slot server's interface (`submit`,
`admit`, `stop`, `cancel_all`, `status`, `run`), with the pipeline — llama.cpp, scheduler, prompt store, draft model,
vision encoder — in a child process (llmcli/serve/engine_child.py, forked by the zygote: engine_zygote.py). The server
keeps HTTP, the protocols, templates and tokenizing (the vocabulary alone) and the queue's places.

`run`, the supervisor, reads each step's events and the tokens each answer sampled, forwards a client's departure at
once, and watches two things:
- the engine's death (a signal, an abort, the OOM killer): it starts the engine again and resumes every answer in
  flight from its prompt and the tokens it had sampled (their text is not sent again). From the first death on, the
  zygote keeps the model's weights, so later restarts load nothing; they are freed when the model is unloaded. A
  request that held a slot and made no progress before a death is resumed alone once the others in slots have
  progressed; if the engine dies again before it progresses, it ends with an error (500). One waiting for a slot is
  never a suspect.
- a step longer than `step_timeout` (a grammar that makes llama.cpp's sampler take minutes per token): the engine is
  asked which answer it was sampling, then killed and started again; that request ends with an error (400).
While an engine restarts, `status()` says so (`/health`: degraded); each restart is one line of the server's log.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from llmcli.answer.events import Done, TokenLogprob
from llmcli.decode.serving import Delivery, Failure, Job, JobEvent, QueueFull, deliver_here
from llmcli.errors import LlmcliError
from llmcli.serve import engine_zygote
from llmcli.serve.engine_spec import CONTEXT_LOST, EngineFacts, EngineSpec, handshake, spawn_child

STEP_TIMEOUT_S = 300.0  # the default --step-timeout: no honest step (a prompt chunk, an image) of a slow machine lasts it
POLL_S = 0.05  # how often the supervisor looks for clients that left (and stalls) while no message comes
WHO_WAIT_S = 2.0  # how long a stalled engine has to say which answer it was sampling


@dataclass
class _Flight:
    """A job the engine has (or will have, after a restart): the tokens it sampled so far, its strikes."""

    job: Job
    record: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    sent: bool = False  # the current engine has it
    cancel_sent: bool = False
    progressed: bool = False  # since the last death
    admitted: bool = False  # it holds a slot of the current engine (waiting in its queue, a death is not its doing)
    strikes: int = 0  # deaths in a row it was in flight at, without progress
    held: bool = False  # a suspect (one strike): resumed alone, once the answers resumed beside it have progressed


class EngineProcess:
    """One model's engine in a child process, supervised (see the module's note); `ready()` waits for its load."""

    def __init__(self, spec: EngineSpec, queue_size: int, step_timeout: float = STEP_TIMEOUT_S,
                 report: Callable[[str], None] | None = None):
        self.spec, self.n_slots, self.queue_size = spec, spec.parallel, queue_size
        self.step_timeout = step_timeout
        self.report = report
        self.deliver: Delivery = deliver_here
        self._lock = threading.Lock()  # the flights, the connection's sending side, the state
        self._flights: dict[int, _Flight] = {}
        self._next_key = 0
        self._stopping = False
        self._child_status: dict[str, Any] = {}
        self.served = 0
        self.restarts = 0
        self.state = "starting"
        self.last_restart: dict[str, Any] | None = None
        self.failure: LlmcliError | None = None  # why its engine could not start again (it is not tried again)
        self._proc: engine_zygote.EngineChild | None = None
        self._conn: Connection | None = None
        self._kept: engine_zygote.KeptWeights | None = None  # what the zygote keeps for this model's restarts
        self._last_heard = time.monotonic()
        self._spawned = self._spawn()  # (the model loads there while this process goes on)
        self.facts: EngineFacts | None = None

    def ready(self) -> EngineFacts:
        """The engine's facts once its model is loaded (LlmcliError: why not; nothing is left running then)."""
        self.facts = self._ready(*self._spawned)
        self.state = "running"
        return self.facts

    # -- the child ----------------------------------------------------------------------------------

    def _spawn(self) -> tuple[engine_zygote.EngineChild, Connection]:
        return spawn_child(self._kept)

    def _ready(self, proc: engine_zygote.EngineChild, conn: Connection) -> EngineFacts:
        facts: EngineFacts = handshake(proc, conn, self.spec)
        self._proc, self._conn = proc, conn
        self._last_heard = time.monotonic()
        return facts

    @property
    def name(self) -> str:
        return self.facts.names[0] if self.facts is not None else str(self.spec.request.settings.get("model"))

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    # -- the request side (any thread) --------------------------------------------------------------

    def admit(self) -> None:
        """QueueFull now if a request would be refused (before its images are decoded: the queue's limits first)."""
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if self.state == "failed" and self.failure is not None:
            raise self.failure  # (the model could not be loaded again: why, as a load says it)
        held = sum(1 for flight in self._flights.values() if not flight.job.cancelled.is_set())
        if held >= self.n_slots + self.queue_size:
            busy = min(held, self.n_slots)
            raise QueueFull(f"all {self.n_slots} slots are busy and {held - busy} requests wait")

    def submit(self, job: Job) -> None:
        with self._lock:
            self._check_room()
            self._next_key += 1
            job.key = self._next_key
            flight = _Flight(job)
            self._flights[job.key] = flight
            if self.state == "running":
                self._send_job(flight)

    def _send_job(self, flight: _Flight) -> None:
        """(Holding the lock.) The job to the current engine, resumed from what it sampled before."""
        job = flight.job
        assert self._conn is not None
        try:
            self._conn.send(("submit", job.key, job.tokens, job.generation, job.seed, job.clock, job.stable,
                             job.images, tuple(flight.record)))
            flight.sent = True
            self._last_heard = max(self._last_heard, time.monotonic())  # (an idle engine's silence was not a stall)
        except OSError:  # the engine has died: the supervisor sends the job to the next one
            flight.sent = False

    def stop(self) -> None:
        """Finish: waiting requests are cancelled; the engine ends once its answers are done."""
        with self._lock:
            self._stopping = True
            self._send(("stop",))

    def cancel_all(self) -> None:
        with self._lock:
            for flight in self._flights.values():
                flight.job.cancelled.set()

    def kill(self) -> None:
        """End the engine process now (the server is exiting)."""
        with self._lock:
            self._stopping = True
        if self._proc is not None:
            engine_zygote.kill(self._proc)

    def _send(self, message: Any) -> None:
        if self._conn is not None:
            try:
                self._conn.send(message)
            except OSError:
                pass

    def status(self) -> dict[str, Any]:
        with self._lock:
            held = sum(1 for flight in self._flights.values() if not flight.job.cancelled.is_set())
            busy = sum(1 for flight in self._flights.values() if flight.admitted and not flight.job.cancelled.is_set())
            return {"slots": self.n_slots, "busy": busy, "waiting": held - busy, "served": self.served,
                    "steps_by_busy": self._child_status.get("steps_by_busy", {}),
                    **({"kept": self._child_status["kept"]} if "kept" in self._child_status else {}),
                    "engine": {"pid": self.pid, "state": self.state, "restarts": self.restarts,
                               **({"last_restart": self.last_restart} if self.last_restart else {})}}

    # -- the supervisor (its own thread) ------------------------------------------------------------

    def run(self) -> None:
        """Until `stop` and the engine's end: messages in, departures out, deaths and stalls mended."""
        try:
            while True:
                conn = self._conn
                assert conn is not None
                cause = None
                try:
                    if conn.poll(POLL_S):
                        self._handle(conn.recv())
                except (EOFError, OSError):
                    cause = self._death_cause()
                self._forward_cancels()
                self._release_held()
                if cause is None and self._stalled():
                    cause = self._end_stall()
                if cause is not None:
                    if self._stopping:
                        return
                    self._restart(cause)
        except _EngineGone:
            return
        finally:
            self._fail_all("the server stopped")
            if self._conn is not None:
                self._conn.close()
            if self._proc is not None:
                engine_zygote.kill(self._proc)
            if self._kept is not None:
                engine_zygote.release(self._kept)

    def _handle(self, message: Any) -> None:
        self._last_heard = time.monotonic()
        if message[0] == "admitted":
            with self._lock:
                if (admitted := self._flights.get(message[1])) is not None:
                    admitted.admitted = True
            return
        if message[0] != "events":
            return
        _, events, records, status = message
        out: list[tuple[Job, JobEvent]] = []
        with self._lock:
            for key, tokens in records.items():
                flight = self._flights.get(key)
                if flight is not None:
                    flight.record.extend(tokens)
                    flight.progressed = True
            for key, event, failure in events:
                flight = self._flights.get(key)
                if flight is None:
                    continue
                flight.progressed = True
                if failure is not None:
                    flight.job.failure = failure
                out.append((flight.job, event))
                if isinstance(event, Done):
                    del self._flights[key]
                    self.served += 1
            if status is not None:
                self._child_status = status
        if out:
            self.deliver(out)

    def _forward_cancels(self) -> None:
        with self._lock:
            for key, flight in self._flights.items():
                if flight.sent and not flight.cancel_sent and flight.job.cancelled.is_set():
                    flight.cancel_sent = True
                    self._send(("cancel", key))

    def _release_held(self) -> None:
        """A suspect goes back to the engine alone: when every answer there has progressed since the restart, and no
        other suspect is there (if the engine dies again without it progressing, it is the cause)."""
        with self._lock:
            held = [flight for flight in self._flights.values() if flight.held]
            if not held or self.state != "running":
                return
            sent = [flight for flight in self._flights.values() if flight.sent and flight.admitted]
            if all(flight.progressed for flight in sent):
                held[0].held = False
                self._send_job(held[0])

    def _stalled(self) -> bool:
        with self._lock:
            busy = any(flight.sent for flight in self._flights.values())
        return busy and time.monotonic() - self._last_heard > self.step_timeout

    def _end_stall(self) -> str:
        """Ask the stalled engine which answer it was sampling, then kill it; that answer fails."""
        conn = self._conn
        assert conn is not None and self._proc is not None
        self.state = "stalled"  # (`/health`: degraded from now until it runs again)
        culprit = None
        with self._lock:
            self._send(("who",))
        deadline = time.monotonic() + WHO_WAIT_S
        try:
            while (left := deadline - time.monotonic()) > 0 and conn.poll(left):
                message = conn.recv()
                if message[0] == "sampling":
                    culprit = message[1]
                    break
                self._handle(message)
        except (EOFError, OSError):
            pass
        engine_zygote.kill(self._proc)
        if culprit is not None:
            with self._lock:
                flight = self._flights.pop(culprit, None)
            if flight is not None:
                limit = f"{self.step_timeout:g} s, serve --step-timeout"
                flight.job.failure = Failure(f"this request's grammar or JSON schema made llama.cpp take longer than the "
                                             f"step limit ({limit}) to sample one token", refused=True)
                self.deliver([(flight.job, _ended(flight))])
        return f"a step took longer than {self.step_timeout:g} s"

    def _death_cause(self) -> str:
        assert self._proc is not None
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            engine_zygote.kill(self._proc)
            code = self._proc.returncode or -signal.SIGKILL
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return "its KV cache could not be made again (memory)" if code == CONTEXT_LOST else f"exited with status {code}"

    def _restart(self, cause: str) -> None:
        """A new engine; the answers in flight resumed (a suspect failed)."""
        started = time.monotonic()
        with self._lock:
            self.state = "restarting"
            self.restarts += 1
            suspects = []
            for key, flight in list(self._flights.items()):
                if not flight.sent:
                    continue
                if flight.progressed or flight.admitted:
                    flight.strikes = 0 if flight.progressed else flight.strikes + 1
                flight.progressed = flight.sent = flight.cancel_sent = flight.admitted = False
                flight.held = flight.strikes == 1
                if flight.strikes >= 2 or flight.job.cancelled.is_set():
                    suspects.append(self._flights.pop(key))
            if self._conn is not None:
                self._conn.close()
        had_kept = self._kept is not None
        if self.facts is not None:
            self._kept = self.facts.kept_weights()  # (loaded by the zygote now, unless it has them)
        for flight in suspects:
            if not flight.job.cancelled.is_set():
                flight.job.failure = Failure(f"the model's engine died twice while answering this request, before any "
                                             f"progress ({cause}): the request is the likely cause", refused=False)
            self.deliver([(flight.job, _ended(flight))])
        try:
            facts = self._ready(*self._spawn())
        except LlmcliError as exc:  # (the file changed under it, memory taken meanwhile): each request is told why
            with self._lock:
                self.state, self.failure = "failed", exc
                failed, self._flights = list(self._flights.values()), {}
            self._say(f"engine of {self.name}: {cause}; could not start again: {exc.message}")
            for flight in failed:
                flight.job.failure = Failure(f"the model's engine died ({cause}) and could not start again: "
                                             f"{exc.message}", refused=False, cause=exc)
                self.deliver([(flight.job, _ended(flight))])
            raise _EngineGone from None
        with self._lock:
            self.facts = facts
            self.state = "running"
            if self._stopping:  # (told to stop while it started again: this engine finishes and ends too)
                self._send(("stop",))
            for flight in self._flights.values():
                if not flight.held:
                    self._send_job(flight)
        took = time.monotonic() - started
        weights = "kept" if had_kept and facts.weights_kept else "loaded"  # (kept by the zygote since a restart before)
        self.last_restart = {"cause": cause, "seconds": round(took, 3), "weights": weights}
        resumed = len(self._flights)
        self._say(f"engine of {self.name}: {cause}; started again in {took:.2f} s (pid {self.pid}, restart "
                  f"{self.restarts}, weights {weights}); {resumed} answer{'' if resumed == 1 else 's'} resumed")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            left, self._flights = list(self._flights.values()), {}
        for flight in left:
            if not flight.job.cancelled.is_set():
                flight.job.failure = Failure(reason, refused=False)
            self.deliver([(flight.job, _ended(flight))])

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)


class _EngineGone(Exception):
    """The engine could not be started again: its supervisor ends."""


def _ended(flight: _Flight) -> Done:
    """The Done of an answer the engine will not finish."""
    return Done("interrupted", flight.job.clock.stats(prompt_tokens=len(flight.job.tokens)))
