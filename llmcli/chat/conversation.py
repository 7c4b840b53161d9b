"""A chat conversation over a Session: turns, edits, settings changes, context fitting and its record.

The KV cache is reused across turns by the engine (only tokens after the shared prefix are
prefilled). When the next prompt would not fit, the oldest exchanges are dropped, never the
system prompt. Every change is appended to the conversation's record in the log (SQLite, the
answers' own database), so `chat --resume` and `run -C` replay it exactly; the record's header
carries the model's sha256 and the template's hash, each exchange the messages it added (tool
calls and results too) and the sampling settings that produced it. Chats saved by older versions
as JSONL files still resume (and continue in the log); `/save` and `/load` write and read JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmcli.answer.answerer import (
    Answerer,
    ContextInfo,
    Resumed,
    ServedFacts,
    exchange_starts,
    last_exchange_start,
    template_source,
)
from llmcli.answer.context_budget import dropped_notice
from llmcli.answer.events import AnswerEvent, Done, Notice, answer_record
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.answer.sampling_config import SETTING_FIELDS
from llmcli.chat.saved import HISTORY_RECORDS, apply_to_history
from llmcli.config.setting import show_value
from llmcli.config.setting_values import parse_text
from llmcli.config.settings import SETTINGS, check_value, unknown_hint
from llmcli.errors import UsageError
from llmcli.interrupt import Cancellation
from llmcli.store import answer_log
from llmcli.store.file_hashes import remembered_sha256
from llmcli.tools.tool_loop import ToolRunner, answer_with_tools

# What chat's /set may change: every setting marked for chat in the table.
CHAT_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.chat)


class Conversation:
    def __init__(self, session: Answerer, generation: GenerationOptions, model_name: str,
                 model_path: Path | None,
                 save: bool = True, conversation_id: str | None = None, pinned: frozenset[str] = frozenset(),
                 log: Callable[[str, dict[str, Any], list[Message]], answer_log.Entry] | None = None,
                 tools: ToolRunner | None = None,
                 cancel: Cancellation | None = None, served: ServedFacts | None = None):
        self.session = session
        self.generation = generation
        self.model_name = model_name
        self.model_path = model_path
        self.id = conversation_id or answer_log.new_conversation_id()
        self.saved = save  # whether changes are recorded in the log (until a write fails)
        self.system = session.options.system
        self.turn_stats: list[Done] = []
        self.pinned = pinned  # settings given now: a resumed conversation's saved values do not replace them
        self.save_failure: str | None = None  # why the record could not be written, until it is reported
        self.log = log  # an exchange as the answer log keeps it: (user text, its --json record, the messages it
        # added) -> its entry (None: answers are not logged)
        self.answer_id: int | None = None  # the last exchange's id in the answer log (`llmcli logs`, --json's log_id)
        self._started = False
        self.tools = tools  # --functions: the calls run between a message and its reply
        self.cancel = cancel or Cancellation()
        self.served = served  # a warm server's facts (its context, its template): what a local model tells itself

    # -- the record ------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        """Append to the record (its header first); a failure turns saving off and is reported once."""
        if not self.saved:
            return
        failure = answer_log.record_conversation(self.id, [*self._header(), record])
        if failure is not None:  # one notice, then the session goes on unsaved
            self.saved, self.save_failure = False, failure

    def _header(self) -> list[dict[str, Any]]:
        """The record's first entry, when nothing is recorded yet (then it is taken as written)."""
        if self._started:
            return []
        self._started = True
        template = template_source(self.session) or ""
        template_sha256 = hashlib.sha256(template.encode()).hexdigest() if template else \
            self.served.template_sha256 if self.served is not None else None
        return [{
            "type": "session", "id": self.id, "model": self.model_name, "model_path": str(self.model_path),
            "model_sha256": remembered_sha256(self.model_path) if self.model_path else None,
            "template_sha256": template_sha256,
            "system": self.system, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }]

    def settings_record(self) -> dict[str, Any]:
        """The settings that shape the next answer, as the record and /show list them."""
        return {**self.generation.sampling.record(), "max_tokens": self.generation.max_tokens,
                "stop": list(self.generation.stops), "repetition_guard": self.generation.repetition_guard,
                "on_overflow": self.session.options.on_overflow}

    # -- turns -----------------------------------------------------------------------------

    @property
    def history(self) -> list[Message]:
        return self.session.history

    def ask(self, text: str, images: tuple[ImageInput, ...] = ()) -> Iterator[AnswerEvent]:
        """Answer `text` (about `images`): fit the context first (dropping the oldest exchanges), then stream; the
        exchange is logged and recorded."""
        dropped = self._fit(text, images)
        if dropped and self.session.local is not None:
            shifted = self.session.local.shift_for(text)
            how = ("" if shifted is None else "; the rest of the KV cache was shifted, not evaluated again" if shifted
                   else "; this model's KV cache cannot shift: the conversation is evaluated again")
            yield Notice(dropped_notice(dropped, how))
        start, before = len(self.history), list(self.history)
        generation = dataclasses.replace(self.generation, fit_history=True)  # (a server fits it as _fit does here)
        events = answer_with_tools(self.session, text, generation, self.tools, self.cancel, images=images) \
            if self.tools is not None else self.session.ask(text, generation, images=images)
        for event in events:
            if isinstance(event, Done):
                if event.dropped:  # a server fitted the conversation (and the session's history): the record too
                    starts = exchange_starts(before)
                    start -= starts[event.dropped] if event.dropped < len(starts) else len(before)
                    self._write({"type": "drop", "exchanges": event.dropped})
                self.turn_stats.append(event)
                warning = self.record_exchange(text, event, start)
                if warning:
                    yield Notice(warning)
            yield event
        if self.save_failure is not None:
            yield Notice(self.take_save_failure() or "")

    def record_exchange(self, text: str, done: Done, start: int) -> str | None:
        """The exchange that began at history[start] and ended with `done`, with every message it added (tool calls
        and results too), recorded once: in the answer log (its texts) and the conversation's record (its place,
        naming the answer) together; an answer not logged (interrupted, or the log off) in the record alone. A warning
        when the answer could not be logged."""
        interrupted = done.finish_reason == "interrupted"
        if interrupted and len(self.history) > start:
            self.history[-1] = dataclasses.replace(self.history[-1], interrupted=True)
        record = answer_record(done)
        added = self.history[start:]
        exchange = {"type": "exchange", "user": text, **record, "interrupted": interrupted,
                    "sampling": self.settings_record(), "messages": [m.record() for m in added]}
        entry = self.log(text, record, added) if self.log is not None and not interrupted else None
        self.answer_id = None
        if entry is None:
            self._write(exchange)
            return None
        if not self.saved:  # (chat --no-save: the answer is logged, no conversation is recorded)
            ids: list[int] = []
            warning = answer_log.record([entry], ids)
            self.answer_id = ids[-1] if ids else None
            return warning
        self.answer_id, failure = answer_log.record_exchange(entry, self._header(), exchange)
        if failure is not None:
            self.saved, self.save_failure = False, failure
        return None

    def take_save_failure(self) -> str | None:
        """Why the record could not be written (once)."""
        failure, self.save_failure = self.save_failure, None
        return failure

    # -- what the model in this process keeps (a server keeps its own) ---------------------------------------

    def keep_state(self) -> list[str]:
        """The conversation ends: its KV state kept for `chat --resume` (a server keeps its own); notices."""
        local = self.session.local
        return local.keep_state() if local is not None else []

    def resume(self) -> Resumed:
        """A resumed conversation: its KV state restored now, if the prompt cache kept it (a server keeps its own)."""
        local = self.session.local
        return local.resume() if local is not None else Resumed()

    def context(self) -> ContextInfo:
        """The context and what the conversation takes of it: the local model's own figures; through a server, the
        last answer's prompt and answer (n_ctx 0: the server does not say its context)."""
        local = self.session.local
        if local is not None:
            return local.context()
        last = self.turn_stats[-1].stats if self.turn_stats and self.history else None
        used = last.prompt_tokens + last.completion_tokens if last is not None else 0
        return ContextInfo(self.served.n_ctx if self.served is not None else 0, used,
                           last.cached_tokens if last is not None else 0, last_answer=True)

    @property
    def template_system(self) -> str | None:
        """The system prompt the chat template adds when none is given (None: none, or a server's template)."""
        local = self.session.local
        if local is not None:
            return local.template_system
        return self.served.template_system if self.served is not None else None

    def _fit(self, text: str, images: tuple[ImageInput, ...] = ()) -> int:
        """Drop the oldest exchanges until the prompt plus room for the answer fits; returns how many (a server says
        itself when the conversation no longer fits)."""
        local = self.session.local
        dropped = local.fit(text, self.generation.max_tokens, images) if local is not None else 0
        if dropped:
            self._write({"type": "drop", "exchanges": dropped})
        return dropped

    def undo(self) -> bool:
        start = last_exchange_start(self.history)
        if start is None:
            return False
        del self.history[start:]
        self._write({"type": "undo"})
        return True

    def retry(self) -> Iterator[AnswerEvent]:
        """Sample the last reply again (the same question, a new answer)."""
        start = last_exchange_start(self.history)
        if start is None:
            raise UsageError("nothing to retry yet")
        question = self.history[start].content
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
        """`/set NAME VALUE` for any setting marked for chat in the table; parsed and checked like its flag."""
        key = name.strip().lstrip("-").replace("-", "_").lower()
        key = "temp" if key == "temperature" else key
        if key not in CHAT_SETTINGS:
            raise UsageError(f"unknown setting {name!r}", hint=unknown_hint(key, CHAT_SETTINGS, "Settings"))
        setting = SETTINGS[key]
        parsed = parse_text(setting, value, f"/set {key}")
        check_value(setting, parsed, "/set")
        if key == "system":
            self.set_system(parsed)
            return "system prompt set" if parsed else "system prompt removed"
        if key in ("on_overflow", "think"):
            self.session.options = dataclasses.replace(self.session.options, **{key: parsed})
        elif key in SETTING_FIELDS:
            sampling = dataclasses.replace(self.generation.sampling, **{key: parsed})
            self.generation = dataclasses.replace(self.generation, sampling=sampling)
        else:
            changes = {"stops": tuple(parsed)} if key == "stop" else {key: parsed}
            self.generation = dataclasses.replace(self.generation, **changes)
        self._write({"type": "set", "name": key, "value": parsed})
        unused = f" (not used: {self.session.where} decides it)" if key in self.session.not_sent else ""
        return f"{setting.flag} = {show_value(parsed)}{unused}"

    # -- save, load, resume ----------------------------------------------------------------

    def save(self, path: Path) -> None:
        data = {"model": self.model_name, "system": self.system,
                "messages": [m.record() for m in self.history], "settings": self.settings_record()}
        try:
            path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot save to {path}: {exc.strerror or exc}") from None

    def load(self, path: Path) -> tuple[int, list[str]]:
        """The conversation /save wrote: its messages, system prompt and settings (those given on the command line
        stay). (messages loaded, settings changed)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            messages = [Message.from_record(m) for m in data["messages"]]
        except OSError as exc:
            raise UsageError(f"cannot load {path}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"cannot load {path}: not a conversation saved with /save ({type(exc).__name__}: {exc})") from None
        if not all(isinstance(m.role, str) and isinstance(m.content, str) for m in messages) or not isinstance(
                data.get("system"), (str, type(None))):
            raise UsageError(f"cannot load {path}: roles, contents and the system prompt must be strings")
        self.history[:] = messages
        self.set_system(data.get("system"))
        self._write({"type": "load", "messages": [m.record() for m in messages]})
        saved_settings = data.get("settings")
        current = self.settings_record()
        changed = []
        for name, value in (saved_settings.items() if isinstance(saved_settings, dict) else ()):
            if name in self.pinned or value is None or current.get(name) == value:
                continue
            try:
                self.set(name, json.dumps(value) if isinstance(value, list) else str(value).lower()
                         if isinstance(value, bool) else str(value))
            except UsageError:
                continue  # (a value this llmcli does not take: the current one stays)
            changed.append(name)
        return len(messages), changed

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Rebuild the state a conversation's record describes (`chat --resume`, `run -C`); settings given now stay.
        Later changes continue the same record."""
        saved, self.saved = self.saved, False  # what is replayed is recorded already
        try:
            self._replay(records)
        finally:
            self.saved = saved
        self._started = True  # continue appending to the same record, without a second header

    def _replay(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            kind = record.get("type")
            if kind in ("session", "system") and "system" in self.pinned:
                continue
            if kind == "session":
                self.system = record.get("system")
                self.session.options = dataclasses.replace(self.session.options, system=self.system)
            elif kind in HISTORY_RECORDS:
                apply_to_history(self.history, record)
            elif kind == "system":
                self.system = record.get("system")
                self.session.options = dataclasses.replace(self.session.options, system=self.system)
            elif kind == "set" and record.get("name") not in self.pinned:
                try:
                    value = record["value"]
                    self.set(record["name"], json.dumps(value) if isinstance(value, list) else str(value))
                except UsageError:
                    pass

    def carry_over(self, records: list[dict[str, Any]]) -> None:
        """An older chat's JSONL records, copied into the log as they are: the conversation goes on there."""
        failure = answer_log.record_conversation(self.id, records)
        if failure is not None:
            self.saved, self.save_failure = False, failure
