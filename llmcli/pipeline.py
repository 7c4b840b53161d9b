"""Assembling the pipeline for one command from what the user asked: settings, model, engine, session.

`run`, `chat` and `config show` describe the request in a `Request`; `resolve_settings`
gives the effective settings and the model file (downloading it if it must), `open_pipeline`
loads it and returns everything a command needs to ask questions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli import paths, settings
from llmcli.chat.session import PromptOptions, RenderedPrompt, Session, find_template, render_prompt, with_system
from llmcli.chat.templates import ChatTemplate, Message
from llmcli.errors import ModelNotFoundError, UsageError
from llmcli.files import known_sha256
from llmcli.inference.embedding import Embedder, pooling_of
from llmcli.inference.engine import CELL_PADDING, Engine, EngineConfig, default_context
from llmcli.inference.generation import GenerationOptions
from llmcli.inference.grammar import Constraint, build_constraint
from llmcli.inference.prompt_cache import GIB, PromptCache, PromptCacheConfig
from llmcli.inference.reasoning import opens_thinking
from llmcli.inference.sampling import SamplingConfig, parse_logit_bias
from llmcli.inference.speculative import DraftModel, Speculation
from llmcli.inference.vocab import VocabularyFile
from llmcli.interrupt import Cancellation
from llmcli.remote.client import Client, Endpoint
from llmcli.remote.session import RemoteRequest, RemoteSession
from llmcli.store import answer_log, memory, models
from llmcli.store.cache import Fetch, ProgressCallback, WaitingNotice
from llmcli.store.gguf_header import read_header


@dataclass(frozen=True, kw_only=True)
class Request:
    settings: Mapping[str, Any] = field(default_factory=dict)  # settings given as flags, by name (None: not given)
    profile: str | None = None
    raw: bool = False
    template_file: Path | None = None
    logit_bias: tuple[str, ...] = ()
    grammar: str | None = None
    grammar_file: Path | None = None
    json_schema: str | None = None
    output_format: str | None = None
    verbose: bool = False
    offline: bool = False  # never ask the Hub; use only the cache
    force: bool = False  # skip the memory check
    parallel: int = 1  # sequences decoded together (run --batch)
    batch: bool = False  # run --batch: the KV cache is made by Pipeline.resize_kv once the prompts are known
    slots: int = 1  # serve: sequences with a full context each, for requests answered together
    api_key: str | None = None  # --endpoint's server (else $LLMCLI_API_KEY)


@dataclass
class Pipeline:
    settings: settings.Settings
    model: models.ResolvedModel
    engine: Engine
    session: Session
    generation: GenerationOptions
    cancel: Cancellation = field(default_factory=Cancellation)
    force: bool = False  # skip the memory check

    def resize_kv(self, cells: int, n_seq_max: int) -> None:
        """A KV cache of `cells` cells shared by `n_seq_max` sequences (run --batch), checked against memory first."""
        header = self.engine.header
        weights = sum(p.stat().st_size for p in self.model.files)
        kv_bytes = memory.kv_cache_bytes(header, cells, 1, self.settings["kv_type"])
        memory.check_memory(self.model.name, weights, kv_bytes, self.force)
        self.engine.resize(cells, n_seq_max)

    def close(self) -> None:
        draft = self.generation.speculation.draft_model
        if draft is not None:
            draft.close()
        self.engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generation_for_batch(self) -> GenerationOptions:
        """The generation options of a --batch: its prompts share the template, so whether the template opens
        a think block for the model is the same for all of them."""
        if self.generation.reasoning and opens_thinking(self.session.render("").text):
            return dataclasses.replace(self.generation, thinking_open=True)
        return self.generation

    def prompt_tokens(self, text: str) -> list[int]:
        """The tokens of `text` as a new user message (template and system prompt applied)."""
        return self.session.render(text).tokens


def resolve_settings(request: Request, on_progress: ProgressCallback | None = None,
                     on_waiting: WaitingNotice | None = None) -> tuple[settings.Settings, models.ResolvedModel]:
    """The effective settings and model (downloaded if it must be), without loading any weights."""
    config = settings.load_config_file()
    first = settings.resolve(request.settings, request.profile, config=config)
    model = models.resolve(first["model"], config.aliases, fetch_for(request, first, on_progress, on_waiting))
    defaults = {**settings.model_defaults(read_header(model.path).metadata), **model.defaults}
    return settings.resolve(request.settings, request.profile, defaults, config), model


def open_answering(request: Request, on_progress: ProgressCallback | None = None,
                   cancel: Cancellation | None = None, on_waiting: WaitingNotice | None = None) -> Pipeline | RemotePipeline:
    """What answers `run`, `chat` and `--batch`: the server of --endpoint, else the local model (`open_pipeline`)."""
    first = settings.resolve(request.settings, request.profile)
    if not first["endpoint"]:
        return open_pipeline(request, on_progress, cancel, on_waiting)
    if request.output_format not in (None, "json"):
        raise UsageError(f"--format {request.output_format!r}: the only format is 'json'")
    constraint = build_constraint(request.grammar, request.grammar_file, request.json_schema, request.output_format == "json")
    return open_remote(request, first, constraint, cancel or Cancellation())


def open_pipeline(request: Request, on_progress: ProgressCallback | None = None,
                  cancel: Cancellation | None = None, on_waiting: WaitingNotice | None = None) -> Pipeline:
    """Resolve (and download) the model, then load it; Ctrl-C during the load aborts it at once."""
    if request.output_format not in (None, "json"):
        raise UsageError(f"--format {request.output_format!r}: the only format is 'json'")
    constraint = build_constraint(request.grammar, request.grammar_file, request.json_schema, request.output_format == "json")
    effective, model = resolve_settings(request, on_progress, on_waiting)
    if effective["kv_type"] != "f16" and effective["flash_attn"] == "off":
        raise UsageError(f"--kv-type {effective['kv_type']} needs flash attention: it cannot be --flash-attn off",
                         hint="Use --kv-type f16 without flash attention.")
    header = read_header(model.path)
    n_ctx = effective["ctx_size"] or default_context(header.context_length)
    weights = sum(p.stat().st_size for p in model.files)
    kv_bytes = 0 if request.batch else memory.kv_cache_bytes(header, n_ctx, request.slots, effective["kv_type"])
    memory.check_memory(model.name, weights, kv_bytes, request.force)
    cancel = cancel if cancel is not None else Cancellation()
    config = EngineConfig(
        n_ctx=effective["ctx_size"],
        n_threads=effective["threads"],
        n_batch=effective["batch_size"],
        verbose=request.verbose,
        mmap=effective["mmap"],
        mlock=effective["mlock"],
        kv_type=effective["kv_type"],
        flash_attn=effective["flash_attn"],
        kv_later=request.batch,
        n_seq_max=request.slots,
    )
    with cancel.on_signals():  # llama.cpp calls back into Python while loading: no exceptions there
        engine = Engine(model.path, config, cancel)
    try:
        vocab = engine.vocab
        biases = parse_logit_bias(list(request.logit_bias), lambda t: vocab.tokenize(t, add_special=False), vocab.n_tokens)
        sampling = SamplingConfig.from_settings(effective.values, logit_bias=biases, grammar=constraint.grammar,
                                                grammar_origin=constraint.origin)
        prompt = PromptOptions(effective["system"], request.raw, request.template_file, effective["on_overflow"],
                               effective["think"])
        cache = None
        if effective["prompt_cache"] and not request.batch and request.slots == 1:
            cache = PromptCache(engine, PromptCacheConfig(paths.prompt_cache_dir(), effective["prompt_cache_min"],
                                                          int(effective["prompt_cache_size"] * GIB), model.name))
        session = Session(engine, prompt, cache, split_min=effective["prompt_cache_min"])
        session.notices[:0] = model.notices
        if engine.n_ctx > engine.n_ctx_train > 0:
            session.notices.append(f"the context of {engine.n_ctx} tokens exceeds the {engine.n_ctx_train} this model was "
                                   "trained on: answers that reach past it may lose coherence")
    except BaseException:
        engine.close()
        raise
    try:
        speculation = _speculation(effective, engine, config, fetch_for(request, effective), cancel)
    except BaseException:
        engine.close()
        raise
    generation = GenerationOptions(sampling, effective["max_tokens"], tuple(effective["stop"]), constraint,
                                   effective["repetition_guard"], speculation, reasoning=effective["reasoning"] != "stdout")
    return Pipeline(effective, model, engine, session, generation, cancel, request.force)


@dataclass
class Tokenizer:
    """A model's vocabulary and chat template without its weights (`llmcli count`, `llmcli tokenize`): the
    tokens a prompt will have, as `run` would evaluate them, in milliseconds."""

    settings: settings.Settings
    model: models.ResolvedModel
    vocabulary: VocabularyFile
    template: ChatTemplate | None
    prompt: PromptOptions
    n_ctx: int  # the context `run` would have, with these settings
    notices: list[str]

    def raw(self, text: str) -> list[int]:
        """The tokens of `text` sent as-is (as `run --raw` sends it)."""
        return self.vocabulary.vocab.tokenize(text, add_special=True)

    def chat(self, text: str) -> RenderedPrompt:
        """The rendered prompt of `text` as a new message: system prompt and template applied (as `run` does)."""
        messages = with_system(self.prompt.system, [Message("user", text)])
        return render_prompt(self.template, self.vocabulary.vocab, messages, self.prompt)

    def close(self) -> None:
        self.vocabulary.close()

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tokenizer(request: Request) -> Tokenizer:
    """The vocabulary (llama.cpp's vocab_only load: no weights) and template of the request's model."""
    effective, model = resolve_settings(request)
    header = read_header(model.path)
    prompt = PromptOptions(effective["system"], request.raw, request.template_file, effective["on_overflow"],
                           effective["think"])
    template, notices = find_template(header, prompt)
    requested = effective["ctx_size"] or default_context(header.context_length)
    n_ctx = -(-requested // CELL_PADDING) * CELL_PADDING  # as llama.cpp pads it
    return Tokenizer(effective, model, VocabularyFile(model.path), template, prompt, n_ctx, notices)


@dataclass(frozen=True)
class RemoteModel:
    name: str  # as the server lists it
    path: None = None
    source: str = "endpoint"


@dataclass
class RemotePipeline:
    """What `run`, `chat` and `--batch` need, answered by an OpenAI-compatible server (--endpoint)."""

    settings: settings.Settings
    model: RemoteModel
    session: RemoteSession
    generation: GenerationOptions
    client: Client
    cancel: Cancellation = field(default_factory=Cancellation)
    engine: None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RemotePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_remote(request: Request, effective: settings.Settings, constraint: Constraint,
                cancel: Cancellation) -> RemotePipeline:
    import os

    endpoint = Endpoint.parse(effective["endpoint"], request.api_key or os.environ.get("LLMCLI_API_KEY") or None,
                              effective["endpoint_timeout"])
    client = Client(endpoint, lambda: bool(cancel))
    try:
        model = effective["model"] or next(iter(client.models()), None)
        if model is None:
            raise ModelNotFoundError(f"{endpoint.url} lists no model", hint="Name one with -m.")
        defaults = {name: setting.default for name, setting in settings.SETTINGS.items()}
        remote = RemoteRequest(model, defaults, constraint.grammar if not constraint.json else None,
                               constraint.schema, constraint.json and constraint.schema is None)
        sampling = SamplingConfig.from_settings(effective.values)  # checked as for a local model
        prompt = PromptOptions(effective["system"], request.raw, None, effective["on_overflow"], effective["think"])
        generation = GenerationOptions(sampling, effective["max_tokens"], tuple(effective["stop"]),
                                       Constraint(json=constraint.json, schema=constraint.schema))
    except BaseException:
        client.close()
        raise
    return RemotePipeline(effective, RemoteModel(model), RemoteSession(client, remote, prompt), generation, client, cancel)


def log_entry(pipeline: Pipeline | RemotePipeline, kind: str, prompt: str, record: Mapping[str, Any],
              conversation_id: str | None = None) -> answer_log.Entry:
    """One answer (its `--json` record) as the log keeps it: model (and its sha256 when already known: nothing is
    hashed for the log), system prompt, prompt, answer, reasoning, the settings that shaped it, why it ended, its
    timings."""
    generation = pipeline.generation
    path = pipeline.model.path
    used = {**generation.sampling.record(), "max_tokens": generation.max_tokens, "stop": list(generation.stops)}
    return answer_log.Entry(kind, pipeline.model.name, known_sha256(path) if path else None,
                            pipeline.session.options.system, prompt, record.get("text") or "", record.get("reasoning"),
                            used, record.get("finish_reason") or "", record.get("timings") or {}, conversation_id)


def new_conversation_id() -> str:
    return answer_log.new_conversation_id()


def continued(conversation_id: str | None) -> tuple[str, list[Message]]:
    """`run --continue` (the latest conversation in the log) or `--cid ID`: its id and its exchanges, in order."""
    with answer_log.AnswerLog(paths.answer_log_file()) as log:
        chosen = conversation_id or log.latest_conversation()
        records = log.find(limit=10_000, conversation_id=chosen) if chosen else []
    if not chosen or not records:
        raise UsageError(f"no conversation {conversation_id!r} in the log" if conversation_id else
                         "nothing to continue: the log holds no conversation yet", hint="llmcli logs lists what it holds.")
    history: list[Message] = []
    for record in reversed(records):
        history += [Message("user", record["prompt"]), Message("assistant", record["answer"])]
    return chosen, history


def fetch_for(request: Request, effective: settings.Settings, on_progress: ProgressCallback | None = None,
              on_waiting: WaitingNotice | None = None) -> Fetch:
    """How this request may reach the Hub (--offline, --force, --hub-timeout)."""
    return Fetch(offline=request.offline, force=request.force, timeout=effective["hub_timeout"],
                 on_progress=on_progress, on_waiting=on_waiting)


def _speculation(effective: settings.Settings, engine: Engine, config: EngineConfig, fetch: Fetch,
                 cancel: Cancellation) -> Speculation:
    """How to decode; with --draft-model, that model loaded beside the target and checked against its vocabulary."""
    mode, reference = effective["speculate"], effective["draft_model"]
    draft_max = min(effective["draft_max"], config.n_batch - 1)  # a draft and its pending token fit one llama_decode
    if reference and effective.sources["speculate"] == "default":
        mode = "auto"  # a draft model given is a draft model to use
    if mode == "draft" and not reference:
        raise UsageError("--speculate draft needs a --draft-model", hint="Or --speculate lookup: drafts from the prompt.")
    if not reference or mode in ("off", "lookup"):
        return Speculation(mode, draft_max)
    draft_file = models.resolve(reference, settings.load_config_file().aliases, fetch)
    with cancel.on_signals():
        draft = DraftModel(Engine(draft_file.path, dataclasses.replace(config, n_seq_max=1, kv_later=False), cancel))
    problem = draft.check_vocabulary(engine)
    if problem is not None:
        draft.close()
        raise UsageError(f"--draft-model {reference} cannot draft for this model: {problem}",
                         hint="A draft model must share the model's vocabulary (usually: a smaller model of the same family).")
    return Speculation(mode, draft_max, draft)


def open_embedder(request: Request, pooling: str, normalize: bool, truncate: bool, texts_per_batch: int,
                  on_progress: ProgressCallback | None = None) -> tuple[settings.Settings, models.ResolvedModel, Embedder]:
    """The model loaded in embedding mode: `pooling` (or the model's own), up to `texts_per_batch` texts sharing a
    context of --ctx-size tokens (default 2048) per llama_decode."""
    effective, model = resolve_settings(request, on_progress)
    header = read_header(model.path)
    n_ctx = effective["ctx_size"] or min(2048, default_context(header.context_length))
    memory.check_memory(model.name, sum(p.stat().st_size for p in model.files),
                        memory.kv_cache_bytes(header, n_ctx, 1, effective["kv_type"]), request.force)
    config = EngineConfig(n_ctx=n_ctx, n_threads=effective["threads"], n_batch=n_ctx, verbose=request.verbose,
                          mmap=effective["mmap"], mlock=effective["mlock"], n_seq_max=texts_per_batch,
                          pooling=pooling_of(header, pooling))
    cancel = Cancellation()
    with cancel.on_signals():
        engine = Engine(model.path, config, cancel)
    return effective, model, Embedder(engine, normalize, truncate)
