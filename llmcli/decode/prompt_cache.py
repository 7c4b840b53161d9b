"""Prefill once across runs: before step 3, start from the saved KV state that shares the longest prefix
with the prompt; after the answer, save the state when enough of the prompt was evaluated.

The files (format, checks, the block index, the disk budget) are `llmcli.store.prompt_store`'s;
this module puts them into and takes them out of an `Engine`. Nothing here runs between the
request and the first token except the lookup and the restore; saving happens after the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmcli.llama.engine import Engine
from llmcli.store.file_hashes import known_sha256, remembered_sha256
from llmcli.store.prompt_store import BLOCK, PromptStore, fingerprint

GIB = 2**30


@dataclass(frozen=True)
class PromptCacheConfig:
    root: Path  # paths.prompt_cache_dir()
    min_tokens: int  # save when at least this many prompt tokens were evaluated
    budget_bytes: int
    model_name: str = ""


class PromptCache:
    def __init__(self, engine: Engine, config: PromptCacheConfig):
        self.engine = engine
        self.config = config
        self.notices: list[str] = []
        self._store: PromptStore | None = None

    def _open(self, compute_sha: bool) -> PromptStore | None:
        """The store of this model and engine's key. The model's sha256 is computed only when saving:
        a model never hashed has nothing saved, so a first run's lookup costs nothing."""
        if self._store is None:
            sha = remembered_sha256(self.engine.path) if compute_sha else known_sha256(self.engine.path)
            if sha is None:
                return None
            key = fingerprint({"model_sha256": sha, **self.engine.kv_signature()})
            self._store = PromptStore(self.config.root, key, self.config.budget_bytes, self.config.model_name)
        return self._store

    def take_notices(self) -> list[str]:
        store = self._store
        found = self.notices + (store.notices if store is not None else [])
        self.notices = []
        if store is not None:
            store.notices = []
        return found

    def restore(self, prompt: Sequence[int], limit: int | None = None, seq: int = 0,
                make_room: Callable[[int], None] | None = None) -> int:
        """Before prefill: load into sequence `seq` the saved state sharing the most of `prompt` (of its first
        `limit` tokens) if it shares at least a block more than the sequence holds now. Returns the prompt tokens it
        covers (0: none). `make_room(n)` gives the sequence n cells first when the state holds more than it has (a
        cache sized to its work)."""
        engine = self.engine
        usable = len(prompt) - 1  # the last prompt token is always evaluated: its logits give the first token
        if limit is not None:
            usable = min(usable, limit)
        held = engine.kv.shared_prefix(prompt[:usable], seq)
        if usable - held < BLOCK:
            return 0
        store = self._open(compute_sha=False)
        # A sliding-window model's state holds the window before its end only: usable where it ends, not before.
        whole = engine.n_swa > 0
        found = store.find(prompt[:usable], at_least=held + BLOCK, whole=whole) if store is not None else None
        if store is None or found is None:
            return 0
        if make_room is not None and len(found.tokens) > engine.kv.n_ctx:
            make_room(len(found.tokens))
        if not engine.kv.restore_state(found.tokens, found.payload, seq):
            self.notices.append(f"prompt cache: llama.cpp refused {found.path.name}; removed it, evaluating the prompt")
            store.remove(found.path)
            return 0
        if len(found.tokens) > usable:
            engine.kv.remove(seq, usable, -1)
        return min(found.shared, usable)

    def save(self, evaluated: int, stable: int | None = None, seq: int = 0) -> None:
        """After an answer: save the KV state if `evaluated` (prompt tokens evaluated now) reaches the threshold.

        `stable`: the prompt's tokens that a later prompt is likely to share (a piped document before the
        question). A sliding-window model's state can only be resumed from where it ends: what is saved
        for it is the checkpoint the engine took there (and nothing mid-chat without one)."""
        if evaluated < self.config.min_tokens:
            return
        engine = self.engine
        if engine.n_swa > 0:
            checkpoint = engine.kv.checkpoints.get(seq)
            if checkpoint is None or len(checkpoint[0]) != stable:
                return
            self._write(*checkpoint)
        else:
            self._write(*engine.kv.save_state(seq))

    def keep(self, resume_at: int) -> None:
        """A conversation ends: save its state for `chat --resume` (if not saved already). A sliding-window
        model's is cut first at `resume_at`, where the next prompt surely goes on as this one did (the end of
        the last prompt: the reply after it may be tokenized differently when the conversation is rendered)."""
        engine = self.engine
        if engine.n_swa > 0 and 0 < resume_at < engine.kv.n_cached:
            engine.kv.remove(0, resume_at, -1)
        self._write(*engine.kv.save_state())

    def _write(self, tokens: list[int], payload: memoryview) -> None:
        if len(tokens) < self.config.min_tokens:
            return
        store = self._open(compute_sha=True)
        if store is None:  # pragma: no cover - _open computes the sha256 when asked to
            return
        if store.holds(tokens, len(tokens) - self.config.min_tokens + 1, whole=self.engine.n_swa > 0):
            return  # a saved state already covers all but a few of these tokens
        store.save(tokens, payload)
