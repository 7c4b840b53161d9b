"""The pipeline of `--endpoint URL`: an OpenAI-compatible server answers; nothing of llama.cpp is loaded."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmcli.answer.answerer import Answerer, PromptOptions
from llmcli.answer.constraint import Constraint
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.reasoning import no_switch_notice
from llmcli.answer.sampling_config import SamplingConfig, check_grammar, logit_bias_pair
from llmcli.config import settings
from llmcli.errors import LlmcliError, ModelNotFoundError, ResourceError
from llmcli.interrupt import Cancellation
from llmcli.pipeline import Pipeline, Request
from llmcli.remote.client import Client, Endpoint
from llmcli.remote.session import RemoteRequest, RemoteSession

if TYPE_CHECKING:
    from llmcli.store.gguf_header import GGUFHeader


@dataclass(frozen=True)
class RemoteModel:
    name: str  # as the server lists it
    path: None = None
    source: str = "endpoint"


def open_warm(request: Request, constraint: Constraint, cancel: Cancellation, on_progress: Any = None,
              on_waiting: Any = None, config: Any = None) -> Pipeline[Answerer]:
    """--keep-alive: the pipeline of this model's private warm server (started if none answers; LlmcliError if it
    will not start). The model is resolved here (downloaded if it must be), its weights loaded by the server."""
    from llmcli.llama.context_size import default_context
    from llmcli.pipeline import check_fits, fetch_for, projector_of, resolve_settings, speculation_mode
    from llmcli.pipeline.warm import LOAD_SETTINGS, ensure, first_start_notice
    from llmcli.store import models

    config = config or settings.load_config_file()
    effective, model = resolve_settings(request, on_progress, on_waiting, config)
    installed = model.name if model.source.startswith("package:") else None  # (named as `list` names it)
    draft = None
    if effective["draft_model"] and speculation_mode(effective) not in ("off", "lookup"):  # (here too: a name that
        # is no model is said before a server starts, and a download shows its progress)
        draft = models.resolve(effective["draft_model"], config.aliases,
                               fetch_for(request, effective, on_progress, on_waiting)).path

    def fits(header: GGUFHeader) -> None:  # (the server's own check, before it starts: -P 1, a whole context)
        try:
            check_fits(model, header, effective["ctx_size"] or default_context(header.context_length),
                       effective["kv_type"], False)
        except ResourceError:
            if not request.force:
                raise
            raise LlmcliError("--force: a warm server would refuse a model that may not fit in memory") from None

    warm = ensure(model.path, effective, request.template_file, installed, projector_of(effective, model), draft, fits)
    endpoint = Endpoint("http://llmcli/v1", None, max(effective["endpoint_timeout"], 600.0), socket=str(warm.socket),
                        name="the warm server")
    settings_for_server = dataclasses.replace(effective, values={**effective.values, "model": warm.model})
    pipeline = open_remote(request, settings_for_server, constraint, cancel, endpoint, sent_at_start=LOAD_SETTINGS,
                           extra={"keep_alive": effective["keep_alive"]})  # this run's keep-alive is the server's now
    session = pipeline.session
    assert isinstance(session, RemoteSession)
    session.loaded = (warm.start_s or 0.0, warm.start_s is None)
    pipeline.model = model  # named as an in-process run names it (the log, --json, `logs -m`)
    pipeline.served = warm.facts
    notice = first_start_notice(model.name, str(effective["keep_alive"])) if warm.start_s is not None else None
    think = no_switch_notice(warm.thinking_switch, effective["think"]) if warm.thinking_switch is not None else None
    session.notices[:0] = [*([notice] if notice else []), *warm.notices, *([think] if think else [])]
    return pipeline


def open_remote(request: Request, effective: settings.Settings, constraint: Constraint, cancel: Cancellation,
                endpoint: Endpoint | None = None, sent_at_start: tuple[str, ...] = (),
                extra: dict[str, Any] | None = None) -> Pipeline[Answerer]:
    """The server's pipeline: its model (-m, else the first it lists), the settings it is sent, one connection pool.
    `endpoint`: a given one (a warm server's socket) rather than --endpoint's; `sent_at_start`: the settings that
    server was started with (no notice names them)."""
    endpoint = endpoint or Endpoint.parse(effective["endpoint"], request.api_key or os.environ.get("LLMCLI_API_KEY")
                                          or None, effective["endpoint_timeout"])
    client = Client(endpoint, lambda: bool(cancel))
    try:
        model = effective["model"] or next(iter(client.models()), None)
        if model is None:
            raise ModelNotFoundError(f"{endpoint.where} lists no model", hint="Name one with -m.")
        defaults = {name: setting.default for name, setting in settings.SETTINGS.items()}
        biases = _logit_bias(request.logit_bias, own_server=bool(sent_at_start))
        unsent: list[str] = []
        gbnf = constraint.grammar if not constraint.json else None
        remote = RemoteRequest(model, defaults, gbnf, constraint.schema, constraint.json and constraint.schema is None,
                               biases, extra or {}, own_server=bool(sent_at_start), grammar_origin=constraint.origin)
        if gbnf is not None:  # against llmcli's limits, named by its flag, before it is sent (as for a local model)
            check_grammar(gbnf, constraint.origin)
        sampling = SamplingConfig.from_settings(effective.values)  # checked as for a local model
        prompt = PromptOptions(effective["system"], request.raw, None, effective["on_overflow"], effective["think"])
        generation = GenerationOptions.from_settings(effective.values, sampling,  # (the server drafts, if it does)
                                                     Constraint(json=constraint.json, schema=constraint.schema),
                                                     speculate="off")
    except BaseException:
        client.close()
        raise
    session = RemoteSession(client, remote, prompt)
    unsent += [settings.SETTINGS[name].flag for name in sorted(session.not_sent)  # flags: the environment and config
               if effective.sources[name].startswith("flag") and name not in sent_at_start]  # files serve local runs
    unsent += [flag for flag, given in (("--chat-template-file", request.template_file and not sent_at_start),
                                        ("--force", request.force)) if given]
    if unsent:
        where = "--keep-alive's server" if sent_at_start else "--endpoint (the server decides)"
        session.notices.append(f"not used with {where}: {', '.join(unsent)}")
    pipeline: Pipeline[Answerer] = Pipeline(effective, RemoteModel(model), session, generation, cancel)
    pipeline.resources.callback(session.close)
    return pipeline


def _logit_bias(specs: tuple[str, ...], own_server: bool) -> dict[str, float] | list[list[Any]]:
    """--logit-bias for a server. Token ids go in OpenAI's form, their bias in its range (-100 bans); a token given
    as text (or any bias, to a warm server) in llama-server's, which llmcli serve takes too: [token id or text, bias
    or false (-inf: banned)], the text read by the server's vocabulary as run reads it. A server that takes neither
    refuses the request, saying so: a bias is never dropped without a word."""
    pairs = [logit_bias_pair(spec) for spec in specs]
    if own_server or any(isinstance(token, str) for token, _ in pairs):
        return [[token, False if bias == -math.inf else max(-100.0, min(100.0, bias))] for token, bias in pairs]
    return {str(token): max(-100.0, min(100.0, bias)) for token, bias in pairs}
