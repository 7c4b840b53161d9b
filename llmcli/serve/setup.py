"""Finding and loading the models of `llmcli serve`, and describing how requests become their tokens (no HTTP here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.config import settings
from llmcli.decode.kept_states import KEPT_MIB
from llmcli.errors import LlmcliError, ModelNotFoundError
from llmcli.pipeline import Request, fetch_for, resolve_settings, warm
from llmcli.pipeline.local import Tokenizer, open_tokenizer
from llmcli.prompt.rendering import thinking_variables
from llmcli.serve.answer_request import Limits, Prompter
from llmcli.serve.embedding_process import Embeddings
from llmcli.serve.engine_process import STEP_TIMEOUT_S, EngineProcess
from llmcli.serve.engine_spec import EngineFacts, EngineSpec
from llmcli.serve.model_facts import ModelFacts, read_facts
from llmcli.serve.model_pool import Served, is_path
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
    step_timeout: float = STEP_TIMEOUT_S  # the longest step an engine may take before it is restarted
    report: Callable[[str], None] | None = None  # a line for the server's log (an engine restarted)
    kept_mib: int = KEPT_MIB  # --cache-ram: what slots held when another request took them, kept in memory
    grows: bool = False  # --exit-when-idle: the slots' KV cells sized to the work (EngineSpec.grows)

    def request_for(self, name: str | None) -> Request:
        if name is None:
            return self.request
        return dataclasses.replace(self.request, settings={**self.request.settings, "model": name},
                                   offline=self.request.offline or not self.allow_pull)

    def resolve(self, name: str, pull: bool = False) -> Path:
        """The file `name` means, as -m resolves it (ModelNotFoundError), without loading it; a Hub model not
        downloaded yet is downloaded only for a request to answer (`pull`) under --allow-pull. A name that is a path
        must be one of llmcli's places (`placed`): any other file is not found, whatever it is."""
        request = self.request_for(name)
        path = resolve_settings(dataclasses.replace(request, offline=request.offline or not pull))[1].path
        if is_path(name) and not self.placed(path):
            raise ModelNotFoundError(f"{name} is not a model this server may load")
        return path

    def placed(self, path: Path) -> bool:
        """Whether a file is in llmcli's places: a model `llmcli list --all` shows (llmcli's store, the Hub cache,
        Ollama's and LM Studio's), a file an alias names, or the server's own -m model. Only these may a request name
        by their path: a client cannot make the server open, or tell it of, any other file on its disk."""
        wanted = path.resolve()
        known = [found for _, found in self.loadable()]
        known += [Path(value).expanduser() for value in settings.load_config_file().aliases.values()]
        try:  # (the server's own model: -m, LLMCLI_MODEL or the config's, as it was loaded)
            known.append(resolve_settings(dataclasses.replace(self.request, offline=True))[1].path)
        except LlmcliError:
            pass
        return any(_same_file(found, wanted) for found in known)

    def pull(self, name: str, on_progress: ProgressCallback, on_files: FilesCallback) -> str:
        """Ollama's /api/pull (under --allow-pull): `name` downloaded into the Hub cache or brought up to date, as
        `llmcli pull` does it (the server's --offline: only found there); the name it is listed by."""
        config = settings.load_config_file()
        effective = settings.resolve(self.request.settings, self.request.profile, config=config)
        fetch = dataclasses.replace(fetch_for(self.request, effective, on_progress), refresh=True, on_files=on_files)
        return models.resolve(name, config.aliases, fetch).name

    def load(self, name: str | None = None, on_progress: Any = None) -> Served:
        """The model loaded in an engine process of its own (llmcli/serve/engine_process.py) with `parallel` slots of a
        full context each (speculative decoding as --speculate says, for every slot); here its vocabulary and
        template (a request's prompt is rendered and tokenized in this process), its prompter, and what the model
        lists say of it."""
        request = self.request_for(name)
        resolve_settings(request, on_progress)  # (downloaded first, when it must be and may be)
        request = dataclasses.replace(request, offline=True)
        tokenizer = open_tokenizer(request)  # (a file llama.cpp would refuse is refused here, before any process starts)
        engine = None
        try:
            spec = EngineSpec(request, self.parallel, warm.own_sockets(), self.kept_mib, self.grows)
            engine = EngineProcess(spec, self.queue, self.step_timeout, self.report)
            return _served(tokenizer, engine.ready(), engine, request, self)
        except BaseException:
            if engine is not None:
                engine.kill()
            tokenizer.close()
            raise

    def loadable(self) -> list[tuple[str, Path]]:
        """What requests may name: the models `llmcli list --all` shows."""
        return [(entry.name, entry.path) for entry in catalog.entries(everywhere=True) if entry.header is not None]

    def describe(self, name: str, path: Path, n_ctx: int = 0) -> ModelFacts:
        """What the model lists say of a model not loaded (its header alone)."""
        template = read_header(path).chat_template or ""
        return read_facts(name, path, n_ctx, template, _capabilities(template))


def _same_file(found: Path, wanted: Path) -> bool:
    try:
        return found.resolve() == wanted
    except (OSError, RuntimeError):  # (a loop of links, a name too long)
        return False


def _capabilities(template: str) -> tuple[str, ...]:
    thinks = any(name in template for name in thinking_variables(True))
    return ("completion", "tools", "embedding", *(("thinking",) if thinks else ()))


def _served(tokenizer: Tokenizer, facts: EngineFacts, engine: EngineProcess, request: Request,
            shape: ServerModels) -> Served:
    vocabulary = tokenizer.vocabulary
    vocab = vocabulary.vocab
    names = facts.names
    limits = Limits(facts.n_ctx, min(shape.max_answer, facts.n_ctx), shape.max_body, facts.max_draft, facts.n_ctx_train)
    prompter = Prompter(tokenizer.render_conversation, lambda text: vocab.tokenize(text, add_special=True), names,
                        facts.values, limits, facts.tool_format, vocab.n_tokens,
                        lambda gbnf, origin: tokenizer.check_grammar(gbnf, origin, facts.n_ctx),
                        tokenizer.template_source or "", split_min=facts.split_min,
                        tokenize_piece=lambda text: vocab.tokenize(text, add_special=False),
                        logit_bias=facts.logit_bias, constraint=facts.constraint, render_raw=tokenizer.render_raw,
                        detokenize=vocab.detokenize, special_tokens=vocab.special_tokens())
    template = tokenizer.template_source or ""
    model_facts = read_facts(names[0], facts.path, facts.n_ctx, template, _capabilities(template))
    embeddings = Embeddings(request)

    def close() -> None:
        engine.kill()
        embeddings.close()
        vocabulary.close()

    return Served(facts.path, engine, prompter, model_facts, close, embeddings, facts.notices, facts.template_system)
