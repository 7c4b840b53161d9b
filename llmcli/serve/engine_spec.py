"""What a model's engine process is asked to load (`EngineSpec`) and what it says of the model once loaded
(`EngineFacts`): the server's side and the engine's side of one handshake (llmcli/serve/engine_process.py,
llmcli/serve/engine_child.py)."""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from llmcli import errors
from llmcli.answer.constraint import Constraint
from llmcli.decode.kept_states import KEPT_MIB
from llmcli.errors import LlmcliError
from llmcli.pipeline import Request, Shape
from llmcli.serve import engine_zygote


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads: the request of its model (as `serve -m` gives it) and its slots."""

    request: Request
    parallel: int
    own_sockets: tuple[Path, ...] = ()  # the server's (not asked by the load's memory check: nothing answers there yet)
    kept_mib: int = KEPT_MIB  # serve --cache-ram
    grows: bool = False  # the slots' KV cells sized to the work (serve --exit-when-idle), not made whole at load


@dataclass(frozen=True)
class EngineFacts:
    """What the engine process says of its model once loaded: what the server's prompter and lists need."""

    names: tuple[str, ...]
    path: Path
    values: dict[str, Any]  # the effective settings
    n_ctx: int
    n_ctx_train: int
    max_draft: int
    logit_bias: tuple[tuple[int, float], ...]
    constraint: Constraint
    tool_format: str
    split_min: int
    notices: tuple[str, ...]
    template_system: str | None
    load_s: float
    weights_kept: bool = False  # the zygote's kept weights (nothing loaded)
    pid: int = 0

    def kept_weights(self) -> engine_zygote.KeptWeights:
        """These weights, as the zygote keeps them for this model's later engines."""
        return engine_zygote.KeptWeights(str(self.path), bool(self.values["mmap"]), bool(self.values["mlock"]))


def load_engine(spec: EngineSpec) -> tuple[Any, EngineFacts]:
    """In the engine process: the model loaded with its slots (a SlotServer) and what the server needs to know."""
    from llmcli.pipeline import warm
    from llmcli.pipeline.local import open_pipeline

    for own in spec.own_sockets:
        warm.listening_here(own)
    pipeline = open_pipeline(dataclasses.replace(spec.request, shape=Shape(spec.parallel, served=True, grows=spec.grows)))
    session, engine = pipeline.session, pipeline.session.engine
    try:
        template_system = session.template_system
    except LlmcliError:  # (a template that cannot render it is refused by each request instead)
        template_system = None
    generation = pipeline.generation
    facts = EngineFacts(tuple(dict.fromkeys((pipeline.model.name, engine.path.stem, engine.path.name))),
                        engine.path.resolve(), dict(pipeline.settings.values), engine.n_ctx, engine.n_ctx_train,
                        generation.max_draft, tuple(generation.sampling.logit_bias), generation.constraint,
                        session.tool_format(pipeline.settings["tool_format"]),
                        session.split_min if session.prompt_cache is not None else 0, tuple(session.notices),
                        template_system, engine.load_s, engine.weights_kept)
    return session.slot_server(spec.parallel, 0, spec.kept_mib), facts


CONTEXT_LOST = 75  # an engine process's exit status when its KV cache could not be made again (ContextLost)


def failed_message(exc: LlmcliError) -> tuple[Any, ...]:
    """The engine's answer when its load failed: the error, as the server raises it again (`load_failure`)."""
    return ("failed", type(exc).__name__, exc.message, exc.hint, int(exc.exit_code))


def load_failure(message: tuple[Any, ...]) -> LlmcliError:
    """The error a "failed" answer carries: its kind, words, hint and exit code, as the load raised it."""
    _, kind, text, hint, code = message
    error_type = getattr(errors, kind, LlmcliError)
    error = error_type(text, hint) if isinstance(error_type, type) and issubclass(error_type, LlmcliError) \
        else LlmcliError(text, hint)
    error.exit_code = errors.ExitCode(code)
    return error


def died_loading(code: int) -> LlmcliError:
    """The engine's process ended (`code`, a Popen's) before it said its model was loaded."""
    what = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"status {code}"
    return errors.IntegrityError(f"llama.cpp ended the engine process while it loaded the model ({what})",
                                 hint="Check that the file is a complete GGUF model supported by this llama.cpp build.")


def spawn_child(keep: engine_zygote.KeptWeights | None = None) -> tuple[engine_zygote.EngineChild, Connection]:
    """A child process for a model (`python -m llmcli.serve.engine_child FD`, or forked by the server's zygote: with
    `keep`, one that has those weights loaded) and the connection to it; it waits for its first message (`handshake`)."""
    ours, theirs = socket.socketpair()
    try:
        command = [sys.executable, "-m", "llmcli.serve.engine_child", str(theirs.fileno())]
        proc = engine_zygote.spawn_engine(command, theirs.fileno(), keep)
    finally:
        theirs.close()
    return proc, Connection(ours.detach())


def handshake(proc: engine_zygote.EngineChild, conn: Connection, first: Any) -> Any:
    """Send the child what to load (`first`) and wait for its model: what its "ready" answer carries. The load's
    error (a "failed" answer, or the child's death) is raised, and nothing is left running then."""
    try:
        conn.send(first)
        while not conn.poll(0.2):
            if (ended := proc.poll()) is not None:
                raise died_loading(ended)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            raise died_loading(proc.wait()) from None
        if message[0] == "failed":
            raise load_failure(message)
    except BaseException:
        conn.close()
        engine_zygote.kill(proc)
        raise
    return message[1]
