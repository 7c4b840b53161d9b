"""Loading the model for `llmcli serve` and describing how requests become tokens (no HTTP here)."""

from __future__ import annotations

from typing import Any

from llmcli.answer.sampling_config import SamplingConfig
from llmcli.answer.tool_calls import ToolSpec
from llmcli.chat.answerer import with_system
from llmcli.chat.chat_template import Message
from llmcli.chat.session import Session, render_prompt, thinking_variables
from llmcli.decode.serving import SlotServer
from llmcli.pipeline import Pipeline, Request, Shape
from llmcli.pipeline.local import open_pipeline
from llmcli.serve.answer_request import Limits, Prompter
from llmcli.serve.model_facts import ModelFacts, read_facts


def open_server(request: Request, parallel: int, queue: int, max_body: int, max_answer: int,
                on_progress: Any = None) -> tuple[SlotServer, Prompter, ModelFacts, Pipeline[Session]]:
    """The model loaded with `parallel` slots of a full context each, its slot server (speculative decoding as
    --speculate says, for every slot), its prompter, and what the model lists say of it."""
    import dataclasses

    pipeline = open_pipeline(dataclasses.replace(request, shape=Shape(parallel)), on_progress)
    session = pipeline.session
    engine = session.engine

    def render_chat(messages: list[Message], think: bool | None, tools: ToolSpec | None) -> Any:
        options = session.options if think is None else dataclasses.replace(session.options, think=think)
        return render_prompt(session.template, engine.vocab, with_system(options.system, messages), options, tools)

    names = tuple(dict.fromkeys((pipeline.model.name, engine.path.stem, engine.path.name)))
    limits = Limits(engine.n_ctx, min(max_answer, engine.n_ctx), max_body, pipeline.generation.max_draft)
    def check_grammar(gbnf: str, origin: str) -> None:  # llama.cpp's parser, on the vocabulary alone
        engine.sampler(SamplingConfig(temp=0, grammar=gbnf, grammar_origin=origin), 0).close()

    prompter = Prompter(render_chat, lambda text: engine.vocab.tokenize(text, add_special=True), names,
                        dict(pipeline.settings.values), limits, session.tool_format(pipeline.settings["tool_format"]),
                        engine.vocab.n_tokens, check_grammar)
    thinks = any(name in (session.template_source or "") for name in thinking_variables(True))
    facts = read_facts(names[0], engine.path, engine.n_ctx, session.template_source or "",
                       ("completion", "tools", "embedding", *(("thinking",) if thinks else ())))
    return SlotServer(engine, parallel, queue, speculation=session.speculation), prompter, facts, pipeline


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
