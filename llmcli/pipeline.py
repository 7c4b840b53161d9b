"""Assembling the pipeline for one command from its settings: model, engine, session, generation options.

`run` and `chat` describe what the user asked for in a `Request`; `open_pipeline`
resolves the settings (llmcli/settings.py), the model file, loads the engine and
returns everything a command needs to ask questions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli import models, resources, settings
from llmcli.engine import Engine, EngineConfig, default_context
from llmcli.interrupt import Cancellation
from llmcli.errors import UsageError
from llmcli.gguf_header import read_header
from llmcli.sampling import build_grammar, parse_logit_bias
from llmcli.session import GenerationOptions, PromptOptions, Session


@dataclass(frozen=True)
class Request:
    flags: dict[str, Any]  # settings given on the command line (None = not given)
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


@dataclass
class Pipeline:
    settings: settings.Settings
    model: models.ResolvedModel
    engine: Engine
    session: Session
    generation: GenerationOptions
    cancel: Cancellation = field(default_factory=Cancellation)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_settings(request: Request, on_progress: models.ProgressCallback | None = None) -> tuple[settings.Settings, models.ResolvedModel]:
    """The effective settings and model (downloaded if it must be), without loading any weights."""
    data = settings.load_config_file()
    first = settings.resolve(request.flags, request.profile, config_data=data)
    model = models.resolve(first["model"], offline=request.offline, on_progress=on_progress,
                           aliases=data.get("aliases"), force=request.force)
    defaults = settings.model_defaults(read_header(model.path).metadata)
    return settings.resolve(request.flags, request.profile, defaults, data), model


def open_pipeline(request: Request, on_progress: models.ProgressCallback | None = None,
                  cancel: Cancellation | None = None) -> Pipeline:
    """Resolve (and download) the model, then load it; Ctrl-C during the load aborts it at once."""
    if request.output_format not in (None, "json"):
        raise UsageError(f"--format {request.output_format!r}: the only format is 'json'")
    grammar, grammar_origin = build_grammar(
        request.grammar, request.grammar_file, request.json_schema, request.output_format == "json"
    )
    effective, model = resolve_settings(request, on_progress)
    header = read_header(model.path)
    n_ctx = effective["ctx_size"] or default_context(header.context_length)
    weights = sum(p.stat().st_size for p in model.files)
    resources.check_memory(model.name, weights, resources.kv_cache_bytes(header, n_ctx, request.parallel), request.force)
    cancel = cancel if cancel is not None else Cancellation()
    with cancel.on_signals():  # llama.cpp calls back into Python while loading: no exceptions there
        engine = Engine(
            model.path,
            EngineConfig(
                n_ctx=effective["ctx_size"],
                n_threads=effective["threads"],
                n_batch=effective["batch_size"],
                verbose=request.verbose,
                mmap=effective["mmap"],
                mlock=effective["mlock"],
                n_seq_max=request.parallel,
            ),
            cancel,
        )
    try:
        biases = parse_logit_bias(list(request.logit_bias), lambda t: engine.tokenize(t, add_special=False), engine.n_vocab)
        sampling = effective.sampling(logit_bias=biases, grammar=grammar, grammar_origin=grammar_origin)
        session = Session(engine, PromptOptions(effective["system"], request.raw, request.template_file))
    except BaseException:
        engine.close()
        raise
    generation = GenerationOptions(sampling, effective["max_tokens"], tuple(effective["stop"]), effective["on_overflow"])
    return Pipeline(effective, model, engine, session, generation, cancel)
