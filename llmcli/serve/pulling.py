"""A model downloaded at a client's request (Ollama's /api/pull, with `serve --allow-pull`), as `llmcli pull`
downloads it, on a worker thread; what happens comes back as events for the route to write in its protocol. No HTTP.

One download at a time per server: a second pull waits for the first to end before it starts (they may well be the
same model, which is then already there). A client that goes away stops its pull at the next bytes received, and
huggingface_hub removes the file it had begun; a pull a client no longer waits for never starts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from llmcli.errors import LlmcliError, ModelNotFoundError
from llmcli.store.cache import FilesCallback, ProgressCallback, RemoteFile
from llmcli.text_escapes import neutralised
from llmcli.units import human_size


@dataclass(frozen=True)
class Started:
    """The pull has its turn: the Hub is being asked what the model's files are."""


@dataclass(frozen=True)
class Listed:
    files: tuple[RemoteFile, ...]  # what will be fetched (already there: fetched in no time)


@dataclass(frozen=True)
class Progress:
    file: str
    done: int
    total: int | None


@dataclass(frozen=True)
class Pulled:
    name: str  # what the model is listed by now
    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class Failed:
    error: LlmcliError


PullEvent = Started | Listed | Progress | Pulled | Failed
# Download `name` (progress and the files told to the callbacks); the name it is listed by. LlmcliError if it cannot.
PullModel = Callable[[str, ProgressCallback, FilesCallback], str]


class ClientGone(LlmcliError):
    """Raised from the download's progress once nobody waits for it any more (stops huggingface_hub's download)."""


class Puller:
    """`report`: one line a pull for the server's log (what was pulled, its size and time, or why not)."""

    def __init__(self, pull: PullModel, report: Callable[[str], None] | None = None):
        self._pull = pull
        self._report = report
        self._turn = threading.Lock()  # held by the worker thread that downloads: one download at a time

    def _say(self, line: str) -> None:
        if self._report is not None:  # (a client's name in it: its control characters shown, one line)
            self._report(neutralised(" ".join(line.splitlines())))

    async def events(self, name: str) -> AsyncGenerator[PullEvent, None]:
        """The pull of `name`, as it happens, to its Pulled or Failed; closing the iterator early stops it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[PullEvent] = asyncio.Queue()
        gone = threading.Event()

        def put(event: PullEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the server's loop has ended (it was stopped mid-pull): nobody is listening
                pass

        def progress(file: str, done: int, total: int | None) -> None:
            if gone.is_set():
                raise ClientGone("the client went away")
            put(Progress(file, done, total))

        listed: list[RemoteFile] = []

        def files(found: tuple[RemoteFile, ...]) -> None:
            listed.extend(found)
            put(Listed(found))

        def attempt() -> Pulled | Failed:
            try:
                return Pulled(self._pull(name, progress, files), tuple(listed))
            except LlmcliError as exc:
                return Failed(exc)
            except (OSError, ValueError):  # a name no file may have (as ModelPool.key takes it)
                return Failed(ModelNotFoundError(f"model '{name}' not found"))
            except Exception as exc:  # a bug: the client still gets its answer, the log the reason
                logging.getLogger("llmcli.serve").error("internal error pulling %s", name, exc_info=exc)
                return Failed(LlmcliError(f"internal error: {type(exc).__name__}"))

        def work() -> None:
            with self._turn:
                if gone.is_set():
                    return
                put(Started())
                started = time.perf_counter()
                ended = attempt()
                put(ended)
                if isinstance(ended, Pulled):
                    size = human_size(sum(f.size or 0 for f in ended.files))
                    self._say(f"pull {name}: {ended.name} ready ({size}) in {time.perf_counter() - started:.1f} s")
                else:
                    how = "stopped" if isinstance(ended.error, ClientGone) else "failed"
                    self._say(f"pull {name}: {how}: {ended.error.message}")

        worker = threading.Thread(target=work, name=f"llmcli-pull-{name[:40]}", daemon=True)
        worker.start()
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, (Pulled, Failed)):
                    return
        finally:
            gone.set()
