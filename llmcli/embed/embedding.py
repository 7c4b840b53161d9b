"""Embeddings: texts in, one pooled vector each out, many texts per `llama_decode`.

The engine is made with `EngineConfig(pooling=…)`: llama.cpp's embedding mode, the sequences of a batch in one
pool of cells, each text its own sequence (so a text's vector does not depend on what shares its batch, up to
floating-point rounding). A batch holds as many texts as fit its cells and sequences; the cache is emptied
after each. Any GGUF embeds: a chat model with mean pooling is a poor but valid embedder; an embedding model
brings its own pooling (`pooling_type` in its metadata).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from llmcli.embed.embedded import Embedded
from llmcli.errors import LlmcliError
from llmcli.llama.batch import Batch
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import POOLING
from llmcli.store.gguf_header import GGUFHeader

POOLINGS = ("model", *POOLING)  # model: the model's own, else mean


def pooling_of(header: GGUFHeader, asked: str) -> str:
    """The pooling to use: the one asked for, else the model's (`{arch}.pooling_type`), else mean."""
    if asked != "model":
        return asked
    own = header.metadata.get(f"{header.architecture}.pooling_type")
    by_code = {code: name for name, code in POOLING.items()}
    return by_code.get(own, "mean") if isinstance(own, int) else "mean"


class Embedder:
    def __init__(self, engine: Engine, normalize: bool = False, truncate: bool = False):
        self.engine, self.normalize, self.truncate = engine, normalize, truncate
        self.n_embd = int(engine.header.metadata.get(f"{engine.header.architecture}.embedding_length") or 0)
        self.cells = engine.kv.n_ctx  # the tokens one batch may hold, all its texts together
        self.n_seq = engine.config.n_seq_max

    def embed(self, texts: Sequence[str], on_progress: Callable[[int], None] | None = None) -> Iterator[Embedded]:
        """One result per text, in order; a text longer than a batch is an error result (or, `truncate`, its
        first tokens are embedded). `on_progress(texts done)` after each batch."""
        pending: list[list[int]] = []
        done = 0

        def flush() -> Iterator[Embedded]:
            nonlocal pending, done
            if pending:
                yield from self._run(pending)
                done += len(pending)
                pending = []
                if on_progress is not None:
                    on_progress(done)

        for text in texts:
            tokens, error = self._tokens(text)
            full = len(pending) == self.n_seq or sum(map(len, pending)) + len(tokens) > self.cells
            if error is not None or full:
                yield from flush()
            if error is not None:
                done += 1
                yield Embedded(None, len(tokens), error, too_long=len(tokens) > self.cells)
            else:
                pending.append(tokens)
        yield from flush()

    def _tokens(self, text: str) -> tuple[list[int], str | None]:
        tokens = self.engine.vocab.tokenize(text, add_special=True)
        if not tokens:
            return tokens, "empty text"
        if len(tokens) > self.cells:
            if not self.truncate:
                return tokens, f"{len(tokens)} tokens do not fit the context of {self.cells} (--truncate embeds the first)"
            tokens = tokens[: self.cells]
        return tokens, None

    def _run(self, batch_tokens: list[list[int]]) -> Iterator[Embedded]:
        engine = self.engine
        with Batch(sum(len(t) for t in batch_tokens)) as batch:
            for seq, tokens in enumerate(batch_tokens):
                for pos, token in enumerate(tokens):
                    batch.add(token, pos, seq, True)
            engine.embed(batch)
            vectors = []
            for seq in range(len(batch_tokens)):
                vector = engine.embedding(seq, self.n_embd)
                if vector is None:
                    raise LlmcliError("llama.cpp gave no pooled embedding: this model cannot pool (try --pooling mean)")
                vectors.append(vector)
        engine.kv.clear()
        for tokens, vector in zip(batch_tokens, vectors, strict=True):
            if self.normalize:
                norm = math.sqrt(sum(v * v for v in vector)) or 1.0
                vector = [v / norm for v in vector]
            yield Embedded(vector, len(tokens))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0
