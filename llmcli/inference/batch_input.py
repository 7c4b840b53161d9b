"""The input and output of `--batch`: one prompt per line (or JSONL objects with a `prompt` field) in, one
record per prompt out, in input order."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True)
class BatchItem:
    index: int
    prompt: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # other JSONL fields, carried to the output
    error: str | None = None

    def error_record(self, message: str) -> Record:
        return {**self.extra, "index": self.index, "error": message}


def parse_items(lines: Iterable[str]) -> list[BatchItem]:
    """One prompt per line, or JSONL objects with a `prompt` field; bad lines become error items."""
    items = []
    for index, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if not line.strip():
            items.append(BatchItem(index, None, error="empty line"))
            continue
        if not line.lstrip().startswith("{"):
            items.append(BatchItem(index, line))
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            items.append(BatchItem(index, None, error=f"malformed JSON: {exc}"))
            continue
        prompt = record.pop("prompt", None) if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            extra = record if isinstance(record, dict) else {}
            items.append(BatchItem(index, None, extra, 'no "prompt" string in the object'))
            continue
        items.append(BatchItem(index, prompt, record))
    return items


def in_order(write: Callable[[Record], None]) -> Callable[[int, Record], None]:
    """Results arrive in any order; `write` sees them in input order, each as soon as it can."""
    waiting: dict[int, Record] = {}
    next_index = [0]

    def accept(index: int, record: Record) -> None:
        waiting[index] = record
        while next_index[0] in waiting:
            write(waiting.pop(next_index[0]))
            next_index[0] += 1

    return accept
