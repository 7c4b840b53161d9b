"""Saved conversations: what a conversation's record does to its messages, and finding, reading and listing the
conversations that can be resumed — recorded in the answer log, or an older chat's JSONL file (`chat --resume`,
`chat --list`, `run -C`). The conversation itself, and its record as it is written, are llmcli/chat/conversation.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.answer.answerer import exchange_starts, last_exchange_start, oldest_exchange_end
from llmcli.answer.batch_jsonl import read_json_line
from llmcli.answer.message import Message
from llmcli.errors import UsageError
from llmcli.store import answer_log

HISTORY_RECORDS = ("exchange", "undo", "clear", "drop", "load")


def apply_to_history(history: list[Message], record: dict[str, Any]) -> None:
    """What one record of a conversation file does to its messages: the one reading of the record, for
    --resume and for the exchange counts --list shows."""
    kind = record.get("type")
    if kind == "exchange" and isinstance(record.get("messages"), list):  # with tool calls: every message of it
        history.extend(Message.from_record(m) for m in record["messages"])
    elif kind == "exchange":
        reply = record["text"] if "text" in record else record["assistant"]  # older records: "assistant"
        history.extend([Message("user", record["user"]), Message("assistant", reply, bool(record.get("interrupted")))])
    elif kind == "undo":
        del history[last_exchange_start(history) or 0 :]
    elif kind == "clear":
        history.clear()
    elif kind == "drop":
        for _ in range(int(record.get("exchanges", 1))):
            del history[: oldest_exchange_end(history)]
    elif kind == "load":
        history[:] = [Message.from_record(m) for m in record["messages"]]


@dataclass(frozen=True)
class Recorded:
    """A conversation that can be resumed: its id, when it last changed, and the file of a chat an older llmcli saved
    as JSONL (None: its record is in the log)."""

    id: str
    changed: float  # seconds since the epoch
    file: Path | None = None

    def records(self) -> list[dict[str, Any]]:
        if self.file is not None:
            return read_records(self.file)
        with answer_log.AnswerLog(paths.answer_log_file()) as log:
            return log.events(self.id)


def recorded_conversations() -> list[Recorded]:
    """Every conversation that can be resumed — recorded in the log, or an older chat's JSONL file not yet carried
    into it — the most recent last."""
    found: dict[str, Recorded] = {}
    folder = paths.conversations_dir()
    for path in folder.glob("*.jsonl") if folder.exists() else ():
        found[path.stem] = Recorded(path.stem, path.stat().st_mtime, path)
    if paths.answer_log_file().exists():
        with answer_log.AnswerLog(paths.answer_log_file()) as log:
            for conversation_id, changed in log.conversations():
                found[conversation_id] = Recorded(conversation_id, changed)  # (the log's record wins over a file)
    return sorted(found.values(), key=lambda c: c.changed)


def find_conversation(which: str) -> Recorded:
    """`last` or an id (or a unique prefix of one) -> the conversation."""
    recorded = recorded_conversations()
    if not recorded:
        raise UsageError("there is no saved conversation to resume", hint="chat --list lists them once there are.")
    if which == "last":
        return recorded[-1]
    matches = [c for c in recorded if c.id == which] or [c for c in recorded if c.id.startswith(which)]
    if len(matches) != 1:
        raise UsageError(f"no single conversation matches {which!r}", hint="chat --list shows their ids; or use `last`.")
    return matches[0]


def read_records(path: Path) -> list[dict[str, Any]]:
    """An older chat's JSONL file: its records, as the log now keeps them."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            record, problem = read_json_line(line)
            if problem is not None:
                raise UsageError(f"{path}:{number} is not valid JSON ({problem}); the conversation file is damaged")
            records.append(record)
    return records


@dataclass(frozen=True)
class SavedConversation:
    id: str
    where: Path  # the log, or an older chat's JSONL file
    modified: float  # seconds since the epoch
    model: str
    exchanges: int
    first_message: str


def saved_conversations() -> list[SavedConversation]:
    """The saved conversations, the most recent last (as --resume last picks it); damaged records are skipped."""
    found = []
    for conversation in recorded_conversations():
        model, first = "", ""
        history: list[Message] = []
        try:
            records = conversation.records()
        except UsageError:
            records = []
        for record in records:
            try:
                if record.get("type") == "session":
                    model = str(record.get("model", ""))
                elif record.get("type") in HISTORY_RECORDS:
                    apply_to_history(history, record)
            except (ValueError, AttributeError, KeyError, TypeError):
                continue
            first = first or (history[0].content if history else "")
        found.append(SavedConversation(conversation.id, conversation.file or paths.answer_log_file(),
                                       conversation.changed, model, len(exchange_starts(history)), first))
    return found
