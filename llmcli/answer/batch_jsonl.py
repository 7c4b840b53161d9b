"""The input and output of `--batch`: one prompt per line (or JSONL objects with a `prompt` field) in, one
record per prompt out, in input order; and the summary of the whole batch (local or --endpoint)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.answer.images import MAX_IMAGES

Record = dict[str, Any]


@dataclass(frozen=True)
class BatchItem:
    index: int
    prompt: str | None
    extra: dict[str, Any] = field(default_factory=dict)  # other JSONL fields, carried to the output
    error: str | None = None
    images: tuple[str, ...] = ()  # the record's `images`: paths (relative to the batch file's folder) or data URIs

    def error_record(self, message: str) -> Record:
        return {**self.extra, "index": self.index, "error": message}


def read_json_line(line: str) -> tuple[Any, str | None]:
    """One line of JSONL read: (its value, None), or (None, why it is not one) — malformed, nested too deep for
    Python's parser (100,000 brackets: a RecursionError), or holding a lone surrogate escape (`"\\ud800"`: no file or
    terminal can carry it). Every JSONL llmcli reads goes through here: one bad line is that line's error."""
    try:
        value = json.loads(line)
    except RecursionError:
        return None, "malformed JSON: nested too deep"
    except ValueError as exc:
        return None, f"malformed JSON: {exc}"
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, "not text: a lone surrogate escape (half of a character)"
    except RecursionError:
        return None, "malformed JSON: nested too deep"
    return value, None


def parse_items(lines: Iterable[str], base: Path | None = None) -> list[BatchItem]:
    """One prompt per line, or JSONL objects with a `prompt` field (and `images`: paths, relative to `base`, or data
    URIs); bad lines become error items."""
    items = []
    for index, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if not line.strip():
            items.append(BatchItem(index, None, error="empty line"))
            continue
        if not line.lstrip().startswith("{"):
            items.append(BatchItem(index, line))
            continue
        record, problem = read_json_line(line)
        if problem is not None:
            items.append(BatchItem(index, None, error=problem))
            continue
        prompt = record.pop("prompt", None) if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            extra = record if isinstance(record, dict) else {}
            items.append(BatchItem(index, None, extra, 'no "prompt" string in the object'))
            continue
        images = record.pop("images", None) or []
        if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images) or len(images) > MAX_IMAGES:
            items.append(BatchItem(index, None, record, f'"images" must be a list of at most {MAX_IMAGES} paths or data URIs'))
            continue
        refs = tuple(i if i.startswith("data:") or base is None else str(base / Path(i).expanduser()) for i in images)
        items.append(BatchItem(index, prompt, record, images=refs))
    return items


def in_order(write: Callable[[Record], None], order: list[int] | None = None) -> Callable[[int, Record], None]:
    """Results arrive in any order; `write` sees them in input order (`order`: the indices, else 0, 1, 2…), each as
    soon as it can."""
    waiting: dict[int, Record] = {}
    position = [0]

    def expected() -> int:
        return position[0] if order is None else order[position[0]] if position[0] < len(order) else -1

    def accept(index: int, record: Record) -> None:
        waiting[index] = record
        while expected() in waiting:
            write(waiting.pop(expected()))
            position[0] += 1

    return accept


def answered(lines: Iterable[str]) -> dict[int, Record]:
    """The records of an earlier output (--resume) that answer their prompt: not an error, not interrupted."""
    kept: dict[int, Record] = {}
    for line in lines:
        record, problem = read_json_line(line)
        if problem is not None:
            continue  # (a line cut short when the job was killed)
        index = record.get("index") if isinstance(record, dict) else None
        if isinstance(index, int) and "error" not in record and record.get("finish_reason") not in (None, "interrupted"):
            kept[index] = record
    return kept


@dataclass
class Summary:
    prompts: int = 0
    errors: int = 0  # lines that could not be answered (empty, malformed, too long)
    not_started: int = 0  # prompts an interrupt left unanswered
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    decode_steps_s: float = 0.0  # time in steps that only decoded (no prompt chunk)
    decode_step_tokens: int = 0  # tokens sampled in those steps
    interrupted: bool = False
    parallel: int = 1  # sequences decoded (or requests sent) together
    where: str | None = None  # the server that answered (--endpoint), else None
    shared_prefix_tokens: int = 0  # the prefix every prompt shares, evaluated once
    prefill_tokens: int = 0  # prompt tokens evaluated (the shared prefix once, then each prompt's rest)
    grown: int = 0  # times the KV cache was made larger for a long answer
    draft_tokens: int = 0  # speculative decoding: tokens drafted and verified, over all answers
    accepted_tokens: int = 0

    @property
    def decode_tps(self) -> float:
        """Aggregate decode rate: tokens per second over all slots, in steps without prefill."""
        return self.decode_step_tokens / self.decode_steps_s if self.decode_steps_s > 0 else 0.0
