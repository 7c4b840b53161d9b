"""Every answer, recorded: a SQLite database (WAL mode, full-text search with FTS5) under the data dir.

Many processes write at once (`xargs -P 8 llmcli run`, `--batch`): SQLite serialises the writers (each waits up
to BUSY_TIMEOUT_S for the lock). The log never fails a run: the caller turns an `sqlite3.Error`/`OSError` into
one warning. The schema carries its version (`PRAGMA user_version`) and `MIGRATIONS` bring an older file up to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.errors import UsageError

BUSY_TIMEOUT_S = 10.0
MIGRATIONS = (  # MIGRATIONS[n] takes a database from version n to n + 1 (idempotent: two processes may both run it)
    """
    CREATE TABLE IF NOT EXISTS answers (
        id INTEGER PRIMARY KEY,
        time REAL NOT NULL,
        kind TEXT NOT NULL,              -- run, chat, batch
        model TEXT, model_sha256 TEXT,
        system TEXT, prompt TEXT NOT NULL, answer TEXT NOT NULL, reasoning TEXT,
        settings TEXT, finish_reason TEXT, timings TEXT,
        conversation_id TEXT
    );
    CREATE INDEX IF NOT EXISTS answers_time ON answers(time);
    CREATE INDEX IF NOT EXISTS answers_conversation ON answers(conversation_id, id);
    CREATE VIRTUAL TABLE IF NOT EXISTS answers_fts USING fts5(prompt, answer, reasoning, content='answers',
                                                              content_rowid='id');
    CREATE TRIGGER IF NOT EXISTS answers_ai AFTER INSERT ON answers BEGIN
        INSERT INTO answers_fts(rowid, prompt, answer, reasoning) VALUES (new.id, new.prompt, new.answer, new.reasoning);
    END;
    CREATE TRIGGER IF NOT EXISTS answers_ad AFTER DELETE ON answers BEGIN
        INSERT INTO answers_fts(answers_fts, rowid, prompt, answer, reasoning)
        VALUES ('delete', old.id, old.prompt, old.answer, old.reasoning);
    END;
    """,
    # 2: the messages an exchange added to its conversation (the assistant's tool calls, the tools' results), so that
    # `run -C/--cid` continues a conversation as it was, not as plain user/assistant pairs
    "ALTER TABLE answers ADD COLUMN messages TEXT;",
    # 3: every conversation's record, in order (its header, each exchange with the messages it added, /set, /system,
    # /undo, /clear, drops, /load): what `chat --resume`, `run -C/--cid` and `chat --list` read
    """
    CREATE TABLE IF NOT EXISTS conversation_events (
        id INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL,
        time REAL NOT NULL,
        type TEXT NOT NULL,
        record TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS conversation_events_by_conversation ON conversation_events(conversation_id, id);
    """,
    # 4: an exchange that was logged is recorded once: its texts (prompt, answer, reasoning, messages) in `answers`, its
    # place in the conversation an event naming that row (`answer_id`): `logs rm` removes exactly it, everywhere
    "ALTER TABLE conversation_events ADD COLUMN answer_id INTEGER;",
    "CREATE INDEX IF NOT EXISTS conversation_events_by_answer ON conversation_events(answer_id);",
)
# What a logged exchange's event leaves to its `answers` row — the texts: the prompt, the answer, its reasoning, the
# messages it added (whose calls and results are its tool_calls), its tokens (logprobs). It keeps the rest (timings, sampling).
TEXT_KEYS = frozenset({"user", "text", "reasoning", "messages", "tool_calls", "logprobs"})
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class Entry:
    kind: str
    model: str
    model_sha256: str | None
    system: str | None
    prompt: str
    answer: str
    reasoning: str | None
    settings: Mapping[str, Any]
    finish_reason: str
    timings: Mapping[str, Any]
    conversation_id: str | None = None
    messages: Sequence[Mapping[str, Any]] | None = None  # what the exchange added (Message records), tool calls too


def _open_read_only(path: Path) -> sqlite3.Connection:
    """Read-only: SQLite's own mode, else (a WAL log in a directory this user cannot write: its -shm file cannot be
    made) the file as it is on disk, taken as unchanging."""
    uri = "file:" + urllib.parse.quote(str(path.resolve()))
    try:
        db = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        db.execute("PRAGMA user_version").fetchone()
        return db
    except sqlite3.OperationalError:
        return sqlite3.connect(uri + "?immutable=1", uri=True, isolation_level=None)


class AnswerLog:
    def __init__(self, path: Path, read_only: bool = False):
        """The log at `path`; `read_only`: opened for reading alone (a read-only data dir or file works; nothing is
        created or migrated)."""
        self.path = path
        if read_only:
            self.db = _open_read_only(path)
            self.db.row_factory = sqlite3.Row
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                self.db.close()
                raise sqlite3.DatabaseError(f"{self.path} has schema {version}, this llmcli reads {SCHEMA_VERSION} "
                                            "(a run that logs an answer brings it up to date)")
            return
        paths.private_dir(path.parent, path.parent)  # the data dir: this user's alone (0700)
        os.close(paths.open_private(path, os.O_RDWR | os.O_CREAT))  # 0600 (its -wal and -shm files take its mode)
        if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
            os.chmod(path, 0o600)  # (a log an earlier llmcli made readable by others)
        self.db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"{self.path} was written by a newer llmcli (schema {version})")
        for step in range(version, SCHEMA_VERSION):
            try:
                self.db.executescript(MIGRATIONS[step])
            except sqlite3.OperationalError as exc:  # another process ran this step meanwhile
                if "duplicate column" not in str(exc):
                    raise
        if version < SCHEMA_VERSION:
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> AnswerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, entries: Sequence[Entry]) -> list[int]:
        """Insert `entries` in one transaction; their ids (what `llmcli logs` shows, and --json's log_id)."""
        with self._transaction():
            return [self._insert(entry) for entry in entries]

    def add_exchange(self, entry: Entry, records: Sequence[Mapping[str, Any]], exchange: Mapping[str, Any]) -> int:
        """A conversation's logged exchange, recorded once, in one transaction: `entry` in the answers (its texts), then
        `records` (the conversation's header, when it is new) and the `exchange` event without those texts, naming its
        answer; the answer's id."""
        assert entry.conversation_id is not None
        with self._transaction():
            answer_id = self._insert(entry)
            self._append(entry.conversation_id, [*records, {k: v for k, v in exchange.items() if k not in TEXT_KEYS}],
                         answer_id)
        return answer_id

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _insert(self, e: Entry) -> int:
        row = (time.time(), e.kind, e.model, e.model_sha256, e.system, e.prompt, e.answer, e.reasoning,
               json.dumps(dict(e.settings), default=str), e.finish_reason, json.dumps(dict(e.timings)), e.conversation_id,
               None if e.messages is None else json.dumps([dict(m) for m in e.messages], default=str))
        return int(self.db.execute("INSERT INTO answers (time, kind, model, model_sha256, system, prompt, answer, "
                                   "reasoning, settings, finish_reason, timings, conversation_id, messages) "
                                   "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", row).lastrowid or 0)

    def find(self, limit: int = 10, text: str | None = None, model: str | None = None, since: float | None = None,
             conversation_id: str | None = None) -> list[dict[str, Any]]:
        """The newest matching records first; `text` is an FTS5 query over prompt, answer and reasoning."""
        where: list[str] = []
        args: list[Any] = []
        if text:
            where.append("a.id IN (SELECT rowid FROM answers_fts WHERE answers_fts MATCH ?)")
            args.append(fts_query(text))
        if model:
            where.append("a.model = ?")
            args.append(model)
        if since is not None:
            where.append("a.time >= ?")
            args.append(since)
        if conversation_id:
            where.append("a.conversation_id = ?")
            args.append(conversation_id)
        sql = "SELECT * FROM answers a" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY a.id DESC LIMIT ?"
        try:
            rows = self.db.execute(sql, [*args, limit]).fetchall()
        except sqlite3.OperationalError as exc:
            if not text or "fts5" not in str(exc) and "syntax" not in str(exc):
                raise
            raise UsageError(f"cannot search for {text!r}: {QUERY_HELP}") from None
        return [_record(row) for row in rows]

    def latest_conversation(self) -> str | None:
        """The conversation (a chat's or a run's) that changed last."""
        row = self.db.execute("SELECT conversation_id FROM conversation_events ORDER BY id DESC LIMIT 1").fetchone() or \
            self.db.execute("SELECT conversation_id FROM answers WHERE conversation_id IS NOT NULL "
                            "ORDER BY id DESC LIMIT 1").fetchone()  # (logged before conversations had a record)
        return str(row[0]) if row else None

    # -- conversations' records ------------------------------------------------------------

    def append(self, conversation_id: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Add `records` (each with its "type") to the end of a conversation's record, at once."""
        with self._transaction():
            self._append(conversation_id, records)

    def _append(self, conversation_id: str, records: Sequence[Mapping[str, Any]], answer_id: int | None = None) -> None:
        """`records`, the last naming `answer_id` (an exchange whose texts are that answer's)."""
        rows = [(conversation_id, time.time(), str(r.get("type")), json.dumps(dict(r), ensure_ascii=False, default=str),
                 answer_id if index == len(records) - 1 else None) for index, r in enumerate(records)]
        self.db.executemany("INSERT INTO conversation_events (conversation_id, time, type, record, answer_id) "
                            "VALUES (?,?,?,?,?)", rows)

    def events(self, conversation_id: str) -> list[dict[str, Any]]:
        """A conversation's record, oldest first (each record's "time" as it was written); a logged exchange with the
        texts its answer holds, as it was written."""
        rows = self.db.execute("SELECT e.time, e.record, e.answer_id, a.prompt, a.answer, a.reasoning, a.messages "
                               "FROM conversation_events e LEFT JOIN answers a ON a.id = e.answer_id "
                               "WHERE e.conversation_id = ? ORDER BY e.id", (conversation_id,)).fetchall()
        found = []
        for row in rows:
            record = {**json.loads(row["record"]), "time": row["time"]}
            if row["answer_id"] is not None:
                if row["prompt"] is None:  # (its answer was removed: so is the exchange)
                    continue
                record.update(user=row["prompt"], text=row["answer"])
                if row["reasoning"] is not None:
                    record["reasoning"] = row["reasoning"]
                if row["messages"]:
                    record["messages"] = json.loads(row["messages"])
            found.append(record)
        return found

    def conversations(self) -> list[tuple[str, float]]:
        """Every recorded conversation's id and when it last changed, the most recent last."""
        rows = self.db.execute("SELECT conversation_id, max(time) AS changed FROM conversation_events "
                               "GROUP BY conversation_id ORDER BY max(id)").fetchall()
        return [(str(row["conversation_id"]), float(row["changed"])) for row in rows]

    def remove(self, record_id: int | None = None, before: float | None = None) -> int:
        removed, prompts = self._remove(record_id, before)
        if prompts:
            forget_typed(paths.chat_history_file(), prompts)
        return removed

    def _remove(self, record_id: int | None, before: float | None) -> tuple[int, list[str]]:
        """Remove one answer (or every answer before a time) from everything that can show or replay it: the answers,
        their exchanges in the conversations' records (`chat --resume`, `run -C`, `chat --list`), the search index;
        then no byte of them is left in the file: deleted content zeroed (secure_delete), the index's segments
        merged, the file rebuilt without free pages (VACUUM) and the write-ahead log emptied. How many answers."""
        self.db.execute("PRAGMA secure_delete = ON")
        self.db.execute("BEGIN IMMEDIATE")
        try:
            prompts: list[str] = []
            if record_id is not None:
                found = self.db.execute("SELECT conversation_id, prompt, answer FROM answers WHERE id = ?",
                                        (record_id,)).fetchone()
                prompts = [found["prompt"]] if found is not None else []
                removed = self.db.execute("DELETE FROM answers WHERE id = ?", (record_id,)).rowcount
                self.db.execute("DELETE FROM conversation_events WHERE answer_id = ?", (record_id,))
                if found is not None and found["conversation_id"]:  # (an exchange recorded before schema 4: its texts)
                    self.db.execute("DELETE FROM conversation_events WHERE conversation_id = ? AND type = 'exchange' "
                                    "AND answer_id IS NULL AND json_extract(record, '$.user') = ? "
                                    "AND json_extract(record, '$.text') = ?",
                                    (found["conversation_id"], found["prompt"], found["answer"]))
            else:
                self.db.execute("DELETE FROM conversation_events WHERE answer_id IN (SELECT id FROM answers "
                                "WHERE time < ?) OR type = 'exchange' AND time < ?", (before, before))
                removed = self.db.execute("DELETE FROM answers WHERE time < ?", (before,)).rowcount
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("INSERT INTO answers_fts(answers_fts) VALUES ('optimize')")  # (deleted terms stay in old segments)
        self.db.execute("VACUUM")
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return removed, prompts

    def count(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM answers").fetchone()[0])


def forget_typed(history: Path, prompts: Sequence[str]) -> None:
    """Chat's line history (the up arrow's: one typed line a line) without the lines of `prompts`; rewritten whole
    in place of the old file (never partly), 0600."""
    typed = {line for prompt in prompts for line in prompt.splitlines() if line.strip()}
    try:
        lines = history.read_text(errors="replace").splitlines(keepends=True)
    except OSError:
        return
    kept = [line for line in lines if line.rstrip("\n") not in typed]
    if len(kept) == len(lines):
        return
    partial = history.with_name(history.name + ".partial")
    partial.unlink(missing_ok=True)
    with os.fdopen(paths.open_private(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as out:
        out.writelines(kept)
    partial.replace(history)


QUERY_HELP = 'words match as typed; "a phrase", OR, AND, NOT and pre* are the search syntax'
_QUERY_PART = re.compile(r'"[^"]*"|\S+')
_OPERATORS = ("OR", "AND", "NOT")
_PREFIX = re.compile(r"\w+\*", re.UNICODE)


def fts_query(text: str) -> str:
    """Everyday text as an FTS5 query: every word is searched for literally (`what?`, `a-b`, `it's`, `C++` are no
    syntax); quoted phrases, OR/AND/NOT and `pre*` keep their FTS5 meaning. UsageError on an unbalanced quote."""
    if text.count('"') % 2:
        raise UsageError(f"cannot search for {text!r}: a quote is not closed; {QUERY_HELP}")
    parts = []
    for part in _QUERY_PART.findall(text):
        if part.startswith('"') or part in _OPERATORS:
            parts.append(part)
        elif _PREFIX.fullmatch(part):
            parts.append(f'"{part[:-1]}"*')
        else:
            parts.append('"' + part.replace('"', '""') + '"')
    return " ".join(parts)


def _record(row: sqlite3.Row) -> dict[str, Any]:
    record = dict(row)
    for key in ("settings", "timings", "messages"):
        record[key] = json.loads(record[key]) if record.get(key) else None
    record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(record["time"]))
    return record


def record(entries: Sequence[Entry], ids: list[int] | None = None) -> str | None:
    """Add `entries` to the log (their ids appended to `ids`); a warning (not an exception) when it cannot: the
    answer was given anyway."""
    path = paths.answer_log_file()
    try:
        with AnswerLog(path) as log:
            added = log.add(entries)
        if ids is not None:
            ids.extend(added)
    except (sqlite3.Error, OSError) as exc:
        return f"the answer is not in the log ({path}: {exc}); --no-log stops trying"
    return None


def record_conversation(conversation_id: str, records: Sequence[Mapping[str, Any]]) -> str | None:
    """Add `records` to a conversation's record in the log; why not (for one notice), None when they were."""
    path = paths.answer_log_file()
    try:
        with AnswerLog(path) as log:
            log.append(conversation_id, records)
    except (sqlite3.Error, OSError) as exc:
        return f"cannot save the conversation to {path}: {exc}; it is not saved from now on"
    return None


def record_exchange(entry: Entry, records: Sequence[Mapping[str, Any]],
                    exchange: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """A conversation's logged exchange (`AnswerLog.add_exchange`): its answer's id, or why it could not be recorded
    (for one notice)."""
    path = paths.answer_log_file()
    try:
        with AnswerLog(path) as log:
            return log.add_exchange(entry, records, exchange), None
    except (sqlite3.Error, OSError) as exc:
        return None, (f"the answer is not in the log ({path}: {exc}); the conversation is not saved from now on "
                      "(--no-log stops trying)")


def new_conversation_id() -> str:
    import uuid

    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
