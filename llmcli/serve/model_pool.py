"""The models one `llmcli serve` answers with: any that `-m` names, loaded on first use and kept warm.

A request's `model` is resolved as `-m` resolves it (a path, an alias, a packaged model, another tool's store, a Hub
reference already cached; downloading only with --allow-pull). A model is loaded on its first request (other
requests are served meanwhile), kept `keep_alive` seconds after its last one (a request's own `keep_alive`, as
Ollama's, sets it), and at most `max_models` are loaded: the least recently used idle one is unloaded to make room,
never one with answers in flight (a request waits for one to be idle, then is a 503). The server's `-m` models are
loaded at start and never expire (room under `max_models` may still swap them out; they come back on demand).
No HTTP here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.decode.serving import deliver_here
from llmcli.errors import LlmcliError, ModelNotFoundError
from llmcli.serve.answer_request import ApiError, Prompter
from llmcli.serve.engine_process import EngineProcess
from llmcli.serve.model_facts import ModelFacts
from llmcli.units import parse_keep_alive

WAIT_FOR_ROOM_S = 120.0  # how long a request for an unloaded model waits for a loaded one to be idle
MAX_NAME_BYTES = 1024  # a model name: an alias, a Hub reference or a path


@dataclass
class Served:
    """One loaded model: its slot server (on its own engine thread), how requests become its tokens, its facts."""

    key: Path  # the file: two names of one model are one Served
    slots: EngineProcess
    prompter: Prompter
    facts: ModelFacts
    close: Callable[[], None]  # the pipeline and the embedding model
    embeddings: Any = None
    notices: tuple[str, ...] = ()  # what the user should know about it (printed when the server starts)
    template_system: str | None = None  # the system prompt its chat template adds when none is given
    keep_alive: float | None = None  # seconds after its last request (None: forever)
    pinned: bool = False  # a -m model: never expires
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.prompter.model_names[0]

    def expires_in(self) -> float | None:
        """Seconds until it is unloaded (None: never; 0 once due)."""
        if self.pinned or self.keep_alive is None:
            return None
        if self.in_flight:
            return self.keep_alive
        return max(0.0, self.last_used + self.keep_alive - time.monotonic())

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def deliver(events: list[Any]) -> None:  # on the engine's thread: one wake-up a step
            loop.call_soon_threadsafe(deliver_here, events)

        self.slots.deliver = deliver
        self.thread = threading.Thread(target=self.slots.run, name=f"llmcli-engine-{self.name}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Finish its answers, stop its engine thread, free its memory (on a worker thread: it waits)."""
        self.slots.stop()
        if self.thread is not None:
            self.thread.join(60)
        self.close()


class ModelPool:
    """`resolve(name, pull)`: the file a name means (ModelNotFoundError; `pull`: downloaded if it must be and may be);
    `load(name)`: that model, loaded (a Served not started yet; None: the server's own -m model). Both are called on
    worker threads."""

    def __init__(self, resolve: Callable[[str, bool], Path], load: Callable[[str | None], Served], max_models: int,
                 keep_alive: float | None):
        self.resolve, self.load = resolve, load
        self.max_models, self.keep_alive = max_models, keep_alive
        self.loaded: dict[Path, Served] = {}
        self.default: Served | None = None
        self._names: dict[str, Path] = {}
        self._pinned: set[Path] = set()
        self._reserved = 0  # loads under way: each counts as a loaded model
        self.on_empty: Callable[[], None] | None = None  # called when the last model is unloaded (a private server)
        self._loading: dict[Path, asyncio.Lock] = {}
        self._changed = asyncio.Condition()
        self._reaper: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def preloaded(self, served: Served, pinned: bool = True) -> None:
        """A -m model, loaded before the server started: the default of requests that name none; `pinned`: it
        never expires (else it does, as the others)."""
        served.pinned = pinned
        served.keep_alive = self.keep_alive
        if pinned:
            self._pinned.add(served.key)
        self.loaded[served.key] = served
        self._names[served.name] = served.key
        self.default = self.default or served

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for served in self.loaded.values():
            served.start(self.loop)
        self._reaper = asyncio.ensure_future(self._reap())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for served in list(self.loaded.values()):
            await asyncio.to_thread(served.stop)
        self.loaded.clear()

    def cancel_all(self) -> None:
        for served in list(self.loaded.values()):
            served.slots.cancel_all()

    # -- a request's model ---------------------------------------------------------------------------------

    async def get(self, name: Any) -> Served:
        """The model a request names (None: the server's default), loaded if it is not; ApiError 404 / 503."""
        if name is None or (self.default is not None and name in self.default.prompter.model_names):
            if self.default is not None and self.default.key in self.loaded:
                return self.default
        if not isinstance(name, str) and name is not None:
            raise ApiError(400, "model must be a string", param="model")
        if name is None:
            assert self.default is not None
            name = self.default.name
        key = await self.key(name, pull=True)
        if key in self.loaded:
            return self.loaded[key]
        lock = self._loading.setdefault(key, asyncio.Lock())
        async with lock:  # one load per model, however many requests wait for it
            if key in self.loaded:
                return self.loaded[key]
            await self._make_room()  # (and reserve it)
            try:  # the server's own model by its flags (its name may resolve elsewhere: a package named the same)
                own = self.default is not None and key == self.default.key
                served = await asyncio.to_thread(self.load, None if own else name)
            except LlmcliError as exc:
                if is_path(name):  # (a file a request names: one answer whatever it is, telling nothing of it)
                    raise self._not_found(name) from None
                status = 404 if isinstance(exc, ModelNotFoundError) else 503
                raise ApiError(status, f"model '{name}' could not be loaded: {exc.message}", param="model") from None
            finally:
                self._reserved -= 1
                asyncio.ensure_future(self._notify())
            served.keep_alive = self.keep_alive
            served.pinned = key in self._pinned  # a -m model swapped out and back: pinned again
            assert self.loop is not None
            served.start(self.loop)
            self.loaded[key] = served
            if self.default is not None and self.default.key == key:
                self.default = served
            return served

    async def key(self, name: str, pull: bool = False) -> Path:
        """The file a name means (404 if none); `pull`: a request to answer, for which a Hub model not downloaded yet
        is downloaded under --allow-pull (503 if that fails), never a request that only describes it."""
        bare = checked_name(name)
        if bare not in self._names:
            try:
                self._names[bare] = await asyncio.to_thread(self.resolve, bare, pull)
            except LlmcliError as exc:
                if not isinstance(exc, ModelNotFoundError) and not is_path(bare):  # found, and its download failed
                    raise ApiError(503, f"model '{name}' could not be downloaded: {exc.message}", param="model") from None
                raise self._not_found(name) from None  # (a path: whether it exists, or what it holds, is not said)
            except (OSError, ValueError):  # (a name the file system refuses: too long a component)
                raise self._not_found(name) from None
        return self._names[bare]

    @staticmethod
    def _not_found(name: str) -> ApiError:
        return ApiError(404, f"model '{name}' not found (the server loads what `llmcli list --all` shows, by its name "
                        "or its path, or a Hub model already downloaded)", param="model", code="model_not_found")

    async def _make_room(self) -> None:
        """Unload the least recently used idle model while `max_models` are loaded or loading (waiting for one to be
        idle), then reserve the room for the load to come."""
        deadline = time.monotonic() + WAIT_FOR_ROOM_S
        async with self._changed:
            while len(self.loaded) + self._reserved >= self.max_models:
                idle = [s for s in self.loaded.values() if s.in_flight == 0]
                if idle:
                    await self._unload(min(idle, key=lambda s: s.last_used))
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(503, f"all {len(self.loaded)} loaded models are answering (--max-models "
                                   f"{self.max_models}); retry later", code="busy")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    continue
            self._reserved += 1

    async def _unload(self, served: Served) -> None:
        del self.loaded[served.key]
        await asyncio.to_thread(served.stop)
        await asyncio.to_thread(_give_back_freed_memory)
        if not self.loaded and not self._reserved and self.on_empty is not None:
            self.on_empty()

    def hold(self, served: Served, keep_alive: Any = None) -> Callable[[], None]:
        """A request starts on `served` (its `keep_alive`, when given, is the model's from now on); the callable
        returned ends it."""
        if keep_alive is not None:
            try:
                served.keep_alive = parse_keep_alive(keep_alive)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="keep_alive") from None
        served.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                served.in_flight -= 1
                served.last_used = time.monotonic()
                asyncio.ensure_future(self._notify())

        return release

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        await self._expire()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self._expire()

    async def _expire(self) -> None:
        for served in list(self.loaded.values()):
            if served.in_flight == 0 and served.expires_in() == 0 and served.key in self.loaded:
                await self._unload(served)


def is_path(name: str) -> bool:
    """Whether a request's model name is a file's path (not a name `llmcli list` shows, nor a Hub reference)."""
    return name.startswith(("/", "~", ".")) or name.lower().endswith(".gguf")


def checked_name(name: str) -> str:
    """A request's model name without Ollama's `:latest`, if it is one a model may have (400 if not)."""
    bare = name.removesuffix(":latest")
    if len(bare.encode("utf-8", "replace")) > MAX_NAME_BYTES or "\0" in bare:
        raise ApiError(400, f"model: a model's name is at most {MAX_NAME_BYTES} bytes, with no NUL", param="model")
    return bare


def _give_back_freed_memory() -> None:
    """After an unload: the model's weights were unmapped and its KV cache freed, but glibc keeps the small blocks
    it freed (the vocabulary, the template, Python's objects) for reuse; hand them back to the system so that the
    server's RSS falls back to what it was (measured: +15 % after three swaps without this)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        return
