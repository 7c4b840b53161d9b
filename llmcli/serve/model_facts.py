"""What the model lists say about the served model (Ollama's /api/tags, /api/ps and /api/show; OpenAI's
/v1/models): read once from its GGUF header when the server starts. No HTTP here."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.store.gguf_header import read_header
from llmcli.units import human_count


@dataclass(frozen=True)
class ModelFacts:
    name: str
    path: Path
    size: int  # bytes on disk
    modified: float  # the file's mtime
    architecture: str
    parameters: int
    quant: str
    context_length: int | None  # what it was trained on
    n_ctx: int  # a slot's context here
    template: str
    capabilities: tuple[str, ...]  # Ollama's words: completion, tools, embedding, thinking
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)  # the header's scalar values
    loaded: float = field(default_factory=time.time)

    @property
    def digest(self) -> str:
        """An identity of this file (path, size, time), not a hash of its bytes: hashing gigabytes at start-up
        would delay the server by seconds."""
        return hashlib.sha256(f"{self.path}\0{self.size}\0{self.modified}".encode()).hexdigest()

    @property
    def parameter_size(self) -> str:
        return human_count(self.parameters)


def read_facts(name: str, path: Path, n_ctx: int, template: str, capabilities: tuple[str, ...]) -> ModelFacts:
    header = read_header(path)
    stat = path.stat()
    scalars = {key: value for key, value in header.metadata.items()
               if isinstance(value, (str, int, float, bool)) and not key.startswith("tokenizer.chat_template")}
    return ModelFacts(name, path, stat.st_size, stat.st_mtime, header.architecture, header.n_params, header.quant,
                      header.context_length, n_ctx, template, capabilities, scalars)
