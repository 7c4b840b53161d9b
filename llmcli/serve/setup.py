"""Finding and loading the models of `llmcli serve`, and describing how requests become their tokens (no HTTP here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.answer.sampling_config import SamplingConfig
from llmcli.chat.session import Session
from llmcli.config import settings
from llmcli.errors import LlmcliError
from llmcli.pipeline import Pipeline, Request, Shape, fetch_for, resolve_settings
from llmcli.pipeline.local import open_pipeline
from llmcli.prompt.rendering import thinking_variables
from llmcli.serve.answer_request import Limits, Prompter
from llmcli.serve.model_facts import ModelFacts, read_facts
from llmcli.serve.model_pool import Served
from llmcli.store import catalog, models
from llmcli.store.cache import FilesCallback, ProgressCallback
from llmcli.store.gguf_header import read_header


@dataclass(frozen=True)
class ServerModels:
    """How `serve` finds and loads the models requests name: its flags (`request`, the slots' shape) apply to each."""

    request: Request
    parallel: int
    queue: int
    max_body: int
    max_answer: int
    allow_pull: bool = False  # a Hub model not downloaded yet may be downloaded (else: 404)

    def request_for(self, name: str | None) -> Request:
        if name is None:
            return self.request
        return dataclasses.replace(self.request, settings={**self.request.settings, "model": name},
                                   offline=self.request.offline or not self.allow_pull)

    def resolve(self, name: str, pull: bool = False) -> Path:
        """The file `name` means, as -m resolves it (ModelNotFoundError), without loading it; a Hub model not
        downloaded yet is downloaded only for a request to answer (`pull`) under --allow-pull."""
        request = self.request_for(name)
        return resolve_settings(dataclasses.replace(request, offline=request.offline or not pull))[1].path

    def pull(self, name: str, on_progress: ProgressCallback, on_files: FilesCallback) -> str:
        """Ollama's /api/pull (under --allow-pull): `name` downloaded into the Hub cache or brought up to date, as
        `llmcli pull` does it (the server's --offline: only found there); the name it is listed by."""
        config = settings.load_config_file()
        effective = settings.resolve(self.request.settings, self.request.profile, config=config)
        fetch = dataclasses.replace(fetch_for(self.request, effective, on_progress), refresh=True, on_files=on_files)
        return models.resolve(name, config.aliases, fetch).name

    def load(self, name: str | None = None, on_progress: Any = None) -> Served:
        """The model loaded with `parallel` slots of a full context each, its slot server (speculative decoding as
        --speculate says, for every slot), its prompter, and what the model lists say of it."""
        request = self.request_for(name)
        pipeline = open_pipeline(dataclasses.replace(request, shape=Shape(self.parallel, served=True)), on_progress)
        try:
            return _served(pipeline, request, self)
        except BaseException:
            pipeline.close()
            raise

    def loadable(self) -> list[tuple[str, Path]]:
        """What requests may name: the models `llmcli list --all` shows."""
        return [(entry.name, entry.path) for entry in catalog.entries(everywhere=True) if entry.header is not None]

    def describe(self, name: str, path: Path, n_ctx: int = 0) -> ModelFacts:
        """What the model lists say of a model not loaded (its header alone)."""
        template = read_header(path).chat_template or ""
        return read_facts(name, path, n_ctx, template, _capabilities(template))


def _capabilities(template: str) -> tuple[str, ...]:
    thinks = any(name in template for name in thinking_variables(True))
    return ("completion", "tools", "embedding", *(("thinking",) if thinks else ()))


def _served(pipeline: Pipeline[Session], request: Request, shape: ServerModels) -> Served:
    session = pipeline.session
    engine = session.engine

    def check_grammar(gbnf: str, origin: str) -> None:  # llama.cpp's parser, on the vocabulary alone
        engine.sampler(SamplingConfig(temp=0, grammar=gbnf, grammar_origin=origin), 0).close()

    names = tuple(dict.fromkeys((pipeline.model.name, engine.path.stem, engine.path.name)))
    limits = Limits(engine.n_ctx, min(shape.max_answer, engine.n_ctx), shape.max_body, pipeline.generation.max_draft,
                    engine.n_ctx_train)
    prompter = Prompter(session.render_conversation, lambda text: engine.vocab.tokenize(text, add_special=True), names,
                        dict(pipeline.settings.values), limits, session.tool_format(pipeline.settings["tool_format"]),
                        engine.vocab.n_tokens, check_grammar, session.template_source or "",
                        split_min=session.split_min if session.prompt_cache is not None else 0,
                        tokenize_piece=lambda text: engine.vocab.tokenize(text, add_special=False),
                        logit_bias=pipeline.generation.sampling.logit_bias, constraint=pipeline.generation.constraint,
                        render_raw=session.render_raw)
    template = session.template_source or ""
    facts = read_facts(names[0], engine.path, engine.n_ctx, template, _capabilities(template))
    slots = session.slot_server(shape.parallel, shape.queue)  # the session's own engine, drafts and prompt store
    embeddings = Embeddings(request)

    def close() -> None:
        embeddings.close()
        pipeline.close()

    try:  # (what a warm chat's /show says; a template that cannot render it is refused by each request instead)
        template_system = session.template_system
    except LlmcliError:
        template_system = None
    return Served(engine.path.resolve(), slots, prompter, facts, close, embeddings, tuple(session.notices),
                  template_system)


class Embeddings:
    """`/v1/embeddings`: the model in embedding mode (as `llmcli embed` loads it: the model's own pooling, else
    mean; 32 texts a pass), loaded on the first request — checked against memory then — and kept; one request at a
    time, off the event loop. The same vectors as `llmcli embed`."""

    def __init__(self, request: Request):
        import threading

        self.request = request
        self._lock = threading.Lock()
        self._embedder: Any = None

    def embed(self, texts: list[str], normalize: bool = False, truncate: bool = False) -> list[Any]:
        """One result per text: `normalize` scales vectors to length 1 (Ollama's /api/embed), `truncate` embeds
        the first tokens of a text too long (else its result is an error)."""
        from llmcli.pipeline.local import open_embedder

        with self._lock:
            if self._embedder is None:
                _, _, self._embedder = open_embedder(self.request, "model", normalize=False, truncate=False,
                                                     texts_per_batch=32)
            self._embedder.normalize, self._embedder.truncate = normalize, truncate
            return list(self._embedder.embed(texts))

    @property
    def dimensions(self) -> int:
        with self._lock:
            return int(self._embedder.n_embd) if self._embedder is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._embedder is not None:
                self._embedder.engine.close()
                self._embedder = None
