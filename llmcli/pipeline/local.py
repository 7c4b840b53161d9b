"""The pipeline of a local model: its settings resolved, the memory checked once, the weights loaded, the session
(the local `Answerer`) with its scheduler, prompt cache and draft model; the tokenizer and the embedder."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from llmcli import paths
from llmcli.answer.answerer import PromptOptions, RenderedPrompt, with_system
from llmcli.answer.constraint import Constraint
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message, user_message
from llmcli.answer.sampling_config import SamplingConfig, parse_logit_bias
from llmcli.answer.tool_calls import ToolSpec
from llmcli.chat.session import Session
from llmcli.config import settings
from llmcli.decode.prompt_cache import GIB, PromptCache, PromptCacheConfig
from llmcli.decode.speculative import DraftModel, Speculation
from llmcli.embed.embedding import Embedder, pooling_of
from llmcli.errors import UsageError
from llmcli.interrupt import Cancellation
from llmcli.llama.context_size import default_context
from llmcli.llama.cpu_topology import physical_cores
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig, padded_cells
from llmcli.llama.sampler_chain import parse_grammar
from llmcli.llama.schema_grammar import with_grammar
from llmcli.llama.vision import Vision
from llmcli.llama.vocab import VocabularyFile
from llmcli.llama.weights import kept_model
from llmcli.pipeline import Pipeline, Request, check_fits, fetch_for, projector_of, resolve_settings, speculation_mode
from llmcli.prompt.chat_template import ChatTemplate
from llmcli.prompt.rendering import find_template, render_prompt
from llmcli.store import models
from llmcli.store.cache import Fetch, ProgressCallback, WaitingNotice
from llmcli.store.gguf_header import GGUFHeader, read_header
from llmcli.store.projector import check_projector, read_projector
from llmcli.units import counted


def check_memory(model: models.ResolvedModel, header: GGUFHeader, cells: int, kv_type: str, force: bool) -> None:
    """pipeline.check_fits, for a load in this process (its weights not counted twice where it keeps them)."""
    check_fits(model, header, cells, kv_type, force, kept_model(model.path) is not None)


def open_pipeline(request: Request, on_progress: ProgressCallback | None = None, cancel: Cancellation | None = None,
                  on_waiting: WaitingNotice | None = None) -> Pipeline[Session]:
    """Resolve (and download) the model, then load it; Ctrl-C during the load aborts it at once."""
    constraint = request.constraint()
    return open_local(request, on_progress, cancel or Cancellation(), on_waiting, settings.load_config_file(), constraint)


def open_local(request: Request, on_progress: ProgressCallback | None, cancel: Cancellation,
               on_waiting: WaitingNotice | None, config: settings.ConfigFile, constraint: Constraint) -> Pipeline[Session]:
    constraint = with_grammar(constraint)
    effective, model = resolve_settings(request, on_progress, on_waiting, config)
    if effective["kv_type"] != "f16" and effective["flash_attn"] == "off":
        raise UsageError(f"--kv-type {effective['kv_type']} needs flash attention: it cannot be --flash-attn off",
                         hint="Use --kv-type f16 without flash attention.")
    header = read_header(model.path)
    n_ctx = effective["ctx_size"] or default_context(header.context_length)
    shape = request.shape
    check_memory(model, header, n_ctx * shape.slots, effective["kv_type"], request.force)
    engine_config = EngineConfig(
        n_ctx=effective["ctx_size"],
        n_threads=effective["threads"],
        n_batch=effective["batch_size"],
        verbose=request.verbose,
        mmap=effective["mmap"],
        mlock=effective["mlock"],
        kv_type=effective["kv_type"],
        flash_attn=effective["flash_attn"],
        kv_later=shape.sized_to_work,
        n_seq_max=max(1, shape.slots),
    )
    with cancel.on_signals():  # llama.cpp calls back into Python while loading: no exceptions there
        engine = Engine(model.path, engine_config, cancel)
    with ExitStack() as resources:  # a failure from here on closes what was opened, in reverse
        resources.callback(engine.close)
        projector = projector_of(effective, model)
        if projector is not None:
            engine.use_projector(projector)
        vocab = engine.vocab
        biases = parse_logit_bias(list(request.logit_bias), lambda t: vocab.tokenize(t, add_special=False), vocab.n_tokens)
        sampling = SamplingConfig.from_settings(effective.values, logit_bias=biases, grammar=constraint.grammar,
                                                grammar_origin=constraint.origin)
        prompt = PromptOptions(effective["system"], request.raw, request.template_file, effective["on_overflow"],
                               effective["think"])
        cache = None
        if effective["prompt_cache"] and not shape.batch:  # (serve's slots use it too: an agent's long prefix)
            cache = PromptCache(engine, PromptCacheConfig(paths.prompt_cache_dir(), effective["prompt_cache_min"],
                                                          int(effective["prompt_cache_size"] * GIB), model.name))
        speculation, draft_max = _speculation(effective, engine, engine_config, fetch_for(request, effective), cancel,
                                              config.aliases)
        if speculation.draft_model is not None:
            resources.callback(speculation.draft_model.close)
        session = Session(engine, prompt, cache, split_min=effective["prompt_cache_min"], speculation=speculation,
                          check_kv=lambda cells: check_memory(model, header, cells, effective["kv_type"], request.force))
        resources.callback(session.close)
        session.notices[:0] = model.notices
        if engine.n_ctx > engine.n_ctx_train > 0:
            session.notices.append(f"the context of {engine.n_ctx} tokens exceeds the {engine.n_ctx_train} this model was "
                                   "trained on: answers that reach past it may lose coherence")
        if engine.sharing_problem:
            session.notices.append(engine.sharing_problem)
        cores = physical_cores()
        if effective["threads"] and effective["threads"] > cores:
            session.notices.append(f"--threads {effective['threads']} is more than the {counted(cores, 'physical core')} "
                                   "this process may use: the extra threads only wait on each other (one per core is "
                                   "fastest, as without -t)")
        mode = effective["speculate"]
        if effective["draft_model"] and effective.sources["speculate"] == "default":
            mode = "auto"  # a draft model given is a draft model to use
        generation = GenerationOptions.from_settings(effective.values, sampling, constraint, speculate=mode,
                                                     max_draft=draft_max)
        pipeline: Pipeline[Session] = Pipeline(effective, model, session, generation, cancel, resources.pop_all())
    return pipeline


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
    projector: Path | None = None  # the model's vision projector (checked): images are counted with it

    def raw(self, text: str, images: tuple[ImageInput, ...] = ()) -> list[int]:
        """The tokens of `text` sent as-is (as `run --raw` sends it), its images first."""
        if not images:
            return self.vocabulary.vocab.tokenize(text, add_special=True)
        return render_prompt(None, self.vocabulary.vocab, [user_message(text, images)], self.prompt,
                             vision=self._vision).tokens

    def chat(self, text: str, images: tuple[ImageInput, ...] = ()) -> RenderedPrompt:
        """The rendered prompt of `text` (and its images) as a new message: system prompt and template applied (as
        `run` does)."""
        return self.render(text, [], self.prompt, images=images)

    def render(self, text: str | None, history: list[Message], options: PromptOptions, tools: ToolSpec | None = None,
               images: tuple[ImageInput, ...] = ()) -> RenderedPrompt:
        """The exact prompt a session of this model renders for `text` after `history`, with `options` (its system
        prompt, --think, --raw) and `tools`: what `run --show-prompt` shows of a model a warm server holds."""
        new = [user_message(text, images)] if text is not None else []
        template = None if options.raw else self.template
        return render_prompt(template, self.vocabulary.vocab, with_system(options.system, [*history, *new]), options,
                             tools, vision=self._vision)

    def render_conversation(self, messages: list[Message], think: bool | None = None,
                            tools: ToolSpec | None = None) -> RenderedPrompt:
        """A whole conversation as a request gives it, rendered as the model's session renders it (serve, whose
        engine is in another process)."""
        options = self.prompt if think is None else dataclasses.replace(self.prompt, think=think)
        return render_prompt(self.template, self.vocabulary.vocab, with_system(options.system, messages), options, tools,
                             self._vision)

    def render_raw(self, text: str, images: tuple[ImageInput, ...]) -> RenderedPrompt:
        """A raw prompt with pictures (serve): as `run --raw --image` renders it."""
        return render_prompt(None, self.vocabulary.vocab, [user_message(text, images)],
                             dataclasses.replace(self.prompt, raw=True), vision=self._vision)

    @property
    def template_source(self) -> str | None:
        return self.template.source if self.template is not None else None

    def check_grammar(self, gbnf: str, origin: str, n_ctx: int) -> None:
        """llama.cpp's grammar parser on `gbnf`, with this vocabulary alone (LlmcliError: what it refused)."""
        parse_grammar(self.vocabulary.vocab, gbnf, origin, n_ctx)

    def _vision(self) -> Vision:
        if self.projector is None:
            raise UsageError("this model does not see images: it has no vision projector",
                             hint="Give the model's mmproj file with --mmproj PATH, or use a vision model.")
        vision: Vision = self.vocabulary.vision(self.projector)
        return vision

    def close(self) -> None:
        self.vocabulary.close()

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tokenizer(request: Request, on_progress: ProgressCallback | None = None) -> Tokenizer:
    """The vocabulary (llama.cpp's vocab_only load: no weights) and template of the request's model."""
    effective, model = resolve_settings(request, on_progress)
    header = read_header(model.path)
    prompt = PromptOptions(effective["system"], request.raw, request.template_file, effective["on_overflow"],
                           effective["think"])
    template, notices = find_template(header, prompt)
    requested = effective["ctx_size"] or default_context(header.context_length)
    n_ctx = padded_cells(requested)  # as llama.cpp pads it
    projector = projector_of(effective, model)
    if projector is not None:
        check_projector(read_projector(projector), header)
    return Tokenizer(effective, model, VocabularyFile(model.path), template, prompt, n_ctx, notices, projector)


def _speculation(effective: settings.Settings, engine: Engine, config: EngineConfig, fetch: Fetch,
                 cancel: Cancellation, aliases: dict[str, str]) -> tuple[Speculation, int]:
    """How to decode; with --draft-model, that model loaded beside the target and checked against its vocabulary."""
    mode, reference = speculation_mode(effective), effective["draft_model"]
    draft_max = min(effective["draft_max"], config.n_batch - 1)  # a draft and its pending token fit one llama_decode
    if not reference or mode in ("off", "lookup"):
        return Speculation(), draft_max
    draft_file = models.resolve(reference, aliases, fetch)
    with cancel.on_signals():
        draft = DraftModel(Engine(draft_file.path, dataclasses.replace(config, n_seq_max=1, kv_later=False), cancel))
    problem = draft.check_vocabulary(engine)
    if problem is not None:
        draft.close()
        raise UsageError(f"--draft-model {reference} cannot draft for this model: {problem}",
                         hint="A draft model must share the model's vocabulary (usually: a smaller model of the same family).")
    return Speculation(draft), draft_max


def open_embedder(request: Request, pooling: str, normalize: bool, truncate: bool, texts_per_batch: int,
                  on_progress: ProgressCallback | None = None) -> tuple[settings.Settings, models.ResolvedModel, Embedder]:
    """The model loaded in embedding mode: `pooling` (or the model's own), up to `texts_per_batch` texts sharing a
    context of --ctx-size tokens (default 2048) per llama_decode."""
    effective, model = resolve_settings(request, on_progress)
    header = read_header(model.path)
    n_ctx = effective["ctx_size"] or min(2048, default_context(header.context_length))
    check_memory(model, header, n_ctx, effective["kv_type"], request.force)
    config = EngineConfig(n_ctx=n_ctx, n_threads=effective["threads"], n_batch=n_ctx, verbose=request.verbose,
                          mmap=effective["mmap"], mlock=effective["mlock"], n_seq_max=texts_per_batch,
                          pooling=pooling_of(header, pooling))
    cancel = Cancellation()
    with cancel.on_signals():
        engine = Engine(model.path, config, cancel)
    return effective, model, Embedder(engine, normalize, truncate)
