"""A chat conversation over a Session: turns, edits, settings changes, context fitting and its record.

The KV cache is reused across turns by the engine (only tokens after the shared prefix are
prefilled). When the next prompt would not fit, the oldest exchanges are dropped, never the
system prompt. Every change is appended to a JSONL file under the data dir, so `--resume`
replays it exactly; each exchange carries the model's sha256, the template's hash and the
sampling settings that produced it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmcli import config
from llmcli.engine import Done, Token
from llmcli.hub import sha256_of
from llmcli.errors import ResourceError, UsageError
from llmcli.sampling import RULES
from llmcli.session import GenerationOptions, Notice, Session
from llmcli.settings import SETTINGS, check_value
from llmcli.templates import Message

# /set names -> GenerationOptions / SamplingConfig fields
_SAMPLING_ALIASES = {"temp": "temperature", "temperature": "temperature"}
_GENERATION_FIELDS = {"max_tokens", "stop", "on_overflow"}


def conversations_dir() -> Path:
    return config.data_dir() / "conversations"


def file_sha256(path: Path) -> str:
    """sha256 of a model file, remembered by (path, size, mtime) so a large model is hashed once."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    store = config.data_dir() / "hashes.json"
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = sha256_of(path)
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps(known))
    return known[key]


class Conversation:
    def __init__(self, session: Session, generation: GenerationOptions, model_name: str, model_path: Path,
                 save: bool = True, conversation_id: str | None = None):
        self.session = session
        self.generation = generation
        self.model_name = model_name
        self.model_path = model_path
        self.id = conversation_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.path: Path | None = conversations_dir() / f"{self.id}.jsonl" if save else None
        self.system = session.options.system
        self.turn_stats: list[Done] = []
        self._started = False

    # -- the record ------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if not self._started:
            self._started = True
            if not self.path.exists():
                template = self.session.template.source if self.session.template else ""
                self._write({
                    "type": "session", "id": self.id, "model": self.model_name, "model_path": str(self.model_path),
                    "model_sha256": file_sha256(self.model_path),
                    "template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
                    "system": self.system, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                })
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({**record, "time": time.time()}, ensure_ascii=False) + "\n")

    def settings_record(self) -> dict[str, Any]:
        sampling = dataclasses.asdict(self.generation.sampling)
        sampling.pop("grammar", None)
        return {**sampling, "max_tokens": self.generation.max_tokens, "stop": list(self.generation.stops)}

    # -- turns -----------------------------------------------------------------------------

    @property
    def history(self) -> list[Message]:
        return self.session.history

    def ask(self, text: str) -> Iterator[Token | Done | Notice]:
        """Answer `text`: fit the context first (dropping the oldest exchanges), then stream."""
        dropped = self._fit(text)
        if dropped:
            yield Notice(f"context nearly full: dropped the {dropped} oldest exchange(s) (the system prompt is kept)")
        for event in self.session.ask(text, self.generation):
            if isinstance(event, Done):
                self.turn_stats.append(event)
                interrupted = event.finish_reason == "interrupted"
                if interrupted and self.history:
                    self.history[-1] = dataclasses.replace(self.history[-1], interrupted=True)
                self._write({
                    "type": "exchange", "user": text, "assistant": self.history[-1].content if self.history else "",
                    "interrupted": interrupted, "finish_reason": event.finish_reason,
                    "usage": {"prompt_tokens": event.stats.prompt_tokens, "cached_tokens": event.stats.cached_tokens,
                              "completion_tokens": event.stats.completion_tokens},
                    "seed": event.stats.seed, "sampling": self.settings_record(),
                })
            yield event

    def _fit(self, text: str) -> int:
        """Drop the oldest exchanges until the prompt plus room for the answer fits; returns how many."""
        engine = self.session.engine
        room = self.generation.max_tokens or min(256, engine.n_ctx // 4)
        dropped = 0
        while len(self.session.render(text).tokens) + room > engine.n_ctx:
            if len(self.history) < 2:
                raise ResourceError(
                    f"this message does not fit the context of {engine.n_ctx} tokens even without history",
                    hint="Use a larger --ctx-size or a shorter message.",
                )
            del self.history[:2]
            dropped += 1
        if dropped:
            self._write({"type": "drop", "exchanges": dropped})
        return dropped

    def undo(self) -> bool:
        if len(self.history) < 2:
            return False
        del self.history[-2:]
        self._write({"type": "undo"})
        return True

    def retry(self) -> Iterator[Token | Done | Notice]:
        """Sample the last reply again (the same question, a new answer)."""
        if len(self.history) < 2:
            raise UsageError("nothing to retry yet")
        question = self.history[-2].content
        self.undo()
        yield from self.ask(question)

    def clear(self) -> None:
        self.history.clear()
        self._write({"type": "clear"})

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.session.options = dataclasses.replace(self.session.options, system=self.system)
        self._write({"type": "system", "system": self.system})

    def set(self, name: str, value: str) -> str:
        """`/set PARAM VALUE` for any sampling control, max_tokens or stop; validated like the flag."""
        key = name.strip().lstrip("-").replace("-", "_").lower()
        field = _SAMPLING_ALIASES.get(key, key)
        if key in ("system",):
            self.set_system(value)
            return "system prompt set"
        setting = SETTINGS.get("temp" if field == "temperature" else key)
        if setting is None or (field not in RULES and key not in _GENERATION_FIELDS):
            known = sorted({*_SAMPLING_ALIASES, *(f for f in RULES if f != "temperature"), *_GENERATION_FIELDS})
            raise UsageError(f"unknown setting {name!r}", hint="Settings: " + ", ".join(known))
        parsed = _parse(setting.kind, value, setting.flag)
        check_value(setting, parsed, "/set")
        if key in _GENERATION_FIELDS:
            changes = {"stops": tuple(parsed)} if key == "stop" else {key: parsed}
            self.generation = dataclasses.replace(self.generation, **changes)
        else:
            sampling = dataclasses.replace(self.generation.sampling, **{field: parsed})  # validates
            self.generation = dataclasses.replace(self.generation, sampling=sampling)
        self._write({"type": "set", "name": key, "value": parsed})
        return f"{setting.flag} = {parsed}"

    # -- save, load, resume ----------------------------------------------------------------

    def save(self, path: Path) -> None:
        data = {"model": self.model_name, "system": self.system,
                "messages": [dataclasses.asdict(m) for m in self.history], "settings": self.settings_record()}
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    def load(self, path: Path) -> int:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            messages = [Message(m["role"], m["content"], bool(m.get("interrupted"))) for m in data["messages"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"cannot load {path}: {exc}") from None
        self.history[:] = messages
        self.set_system(data.get("system"))
        self._write({"type": "load", "messages": [dataclasses.asdict(m) for m in messages]})
        return len(messages)

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Rebuild the state a conversation file describes (used by --resume)."""
        for record in records:
            kind = record.get("type")
            if kind == "session":
                self.system = record.get("system")
                self.session.options = dataclasses.replace(self.session.options, system=self.system)
            elif kind == "exchange":
                self.history.extend([Message("user", record["user"]),
                                     Message("assistant", record["assistant"], bool(record.get("interrupted")))])
            elif kind == "undo":
                del self.history[-2:]
            elif kind == "clear":
                self.history.clear()
            elif kind == "drop":
                del self.history[: 2 * int(record.get("exchanges", 1))]
            elif kind == "system":
                self.system = record.get("system")
                self.session.options = dataclasses.replace(self.session.options, system=self.system)
            elif kind == "load":
                self.history[:] = [Message(m["role"], m["content"], bool(m.get("interrupted"))) for m in record["messages"]]
            elif kind == "set":
                try:
                    self.set(record["name"], json.dumps(record["value"]) if isinstance(record["value"], list) else str(record["value"]))
                except UsageError:
                    pass
        self._started = True  # continue appending to the same file, without a second header


def find_conversation(which: str) -> Path:
    """`last` or an id (or a unique prefix of one) -> the conversation's JSONL file."""
    folder = conversations_dir()
    files = sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime) if folder.exists() else []
    if not files:
        raise UsageError("there is no saved conversation to resume", hint=f"Conversations are saved in {folder}.")
    if which == "last":
        return files[-1]
    matches = [f for f in files if f.stem == which] or [f for f in files if f.stem.startswith(which)]
    if len(matches) != 1:
        raise UsageError(f"no single conversation matches {which!r}", hint="Use an id from " + str(folder) + " or `last`.")
    return matches[0]


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise UsageError(f"{path}:{number} is not valid JSON; the conversation file is damaged") from None
    return records


def _parse(kind: type, value: str, flag: str) -> Any:
    text = value.strip()
    try:
        if kind is list:
            return json.loads(text) if text.startswith("[") else [bytes(text, "utf-8").decode("unicode_escape")]
        if kind is bool:
            return text.lower() in ("1", "true", "yes", "on")
        if text.lower() in ("none", "null", "") and kind is int:
            return None
        return kind(text)
    except ValueError:
        raise UsageError(f"{flag} takes a {kind.__name__} (got {value!r})") from None

