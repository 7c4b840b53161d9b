"""Assembling the pipeline for one command from what the user asked: settings, model, answerer.

`run`, `chat`, `serve` and `config show` describe the request in a `Request`; `resolve_settings` gives the
effective settings and the model file (downloading it if it must), reading the config file once;
`open_answering` opens what answers — the server of --endpoint (llmcli/pipeline/remote.py, no llama.cpp
loaded) or the local model (llmcli/pipeline/local.py) — as one `Pipeline` whose `session` is an `Answerer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from llmcli import paths
from llmcli.answer.answerer import Answerer, RenderedPrompt, ServedFacts
from llmcli.answer.constraint import Constraint, build_constraint
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.images import ImageInput
from llmcli.answer.message import Message
from llmcli.answer.sampling_config import logit_bias_pair
from llmcli.answer.tool_calls import ToolSpec
from llmcli.config import settings
from llmcli.errors import LlmcliError, ResourceError, UsageError
from llmcli.interrupt import Cancellation
from llmcli.store import answer_log, memory, models
from llmcli.store.cache import Fetch, ProgressCallback, WaitingNotice
from llmcli.store.file_hashes import known_sha256
from llmcli.store.gguf_header import GGUFHeader, read_metadata
from llmcli.units import keeps_loaded


@dataclass(frozen=True)
class Shape:
    """How many sequences the command decodes: one answer at a time (run, chat: the KV cache starts small and grows
    with the conversation), a batch of N decoded together (run --batch: the KV cache is sized once the prompts are
    known), or N server slots of a whole context each (`served`: the memory a server holds stays put) — unless the
    server `grows` (one that exits when idle: a warm server, launch's): its slots' cells grow with the work, as run's."""

    sequences: int = 1
    batch: bool = False
    served: bool = False
    grows: bool = False

    @property
    def sized_to_work(self) -> bool:
        """The KV cache is made small at load and sized to the work (`Engine.grow_to`, `resize`)."""
        return self.batch or not self.served or self.grows

    @property
    def slots(self) -> int:
        """Sequences with a whole context each, made when the model loads (0: sized later, for a batch)."""
        return 0 if self.batch else self.sequences


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
    shape: Shape = field(default_factory=Shape)
    api_key: str | None = None  # --endpoint's server (else $LLMCLI_API_KEY)


    def constraint(self) -> Constraint:
        """What the answer must be (--grammar, --json-schema, --format json), checked before anything loads."""
        if self.output_format not in (None, "json"):
            raise UsageError(f"--format {self.output_format!r}: the only format is 'json'")
        return build_constraint(self.grammar, self.grammar_file, self.json_schema, self.output_format == "json")


class NamedModel(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path | None: ...


A = TypeVar("A", bound=Answerer, covariant=True)


@dataclass
class Pipeline(Generic[A]):
    """What `run`, `chat` and `--batch` need, local or remote alike; `close` releases all of it (an ExitStack)."""

    settings: settings.Settings
    model: NamedModel
    session: A
    generation: GenerationOptions
    cancel: Cancellation
    resources: ExitStack = field(default_factory=ExitStack)
    served: ServedFacts | None = None  # a warm server's model, as it says it (its context, its template)

    def close(self) -> None:
        self.resources.close()

    def __enter__(self) -> Pipeline[A]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_settings(request: Request, on_progress: ProgressCallback | None = None,
                     on_waiting: WaitingNotice | None = None,
                     config: settings.ConfigFile | None = None) -> tuple[settings.Settings, models.ResolvedModel]:
    """The effective settings and model (downloaded if it must be), without loading any weights: the flags, the
    profile and the config file, then the model's own defaults under them."""
    config = config or settings.load_config_file()
    first = settings.resolve(request.settings, request.profile, config=config)
    model = models.resolve(first["model"], config.aliases, fetch_for(request, first, on_progress, on_waiting))
    defaults = {**settings.model_defaults(read_metadata(model.path)), **model.defaults}
    return settings.resolve(request.settings, request.profile, defaults, config, model.name), model


def open_answering(request: Request, on_progress: ProgressCallback | None = None, cancel: Cancellation | None = None,
                   on_waiting: WaitingNotice | None = None) -> Pipeline[Answerer]:
    """What answers `run`, `chat` and `--batch`: the server of --endpoint, else the local model. The config file is
    read once, here."""
    constraint = request.constraint()
    for spec in request.logit_bias:  # (its form, before anything loads or a warm server starts: the tokens it names
        logit_bias_pair(spec)  # are looked up in the model's vocabulary later)
    config = settings.load_config_file()
    first = settings.resolve(request.settings, request.profile, config=config)
    cancel = cancel if cancel is not None else Cancellation()
    if first["endpoint"]:
        from llmcli.pipeline.remote import open_remote  # speaks HTTP only

        return open_remote(request, first, constraint, cancel)
    speculation_mode(first)  # (--speculate draft without a draft model: said before a load, warm or here; an
    # --endpoint's server decides how it decodes)
    notices: list[str] = []
    chosen = first.sources["keep_alive"] != "default"
    if keeps_loaded(first["keep_alive"]) and not (request.shape.batch and not chosen) and _warm_possible(chosen, notices):
        # (--batch answers in this process unless a keep-alive is set: it sizes the KV cache to its prompts and decodes
        # them together, where a warm server has one slot; its load is a small part of a batch's time)
        from llmcli.pipeline.remote import open_warm  # speaks HTTP only

        try:
            warm = open_warm(request, constraint, cancel, on_progress, on_waiting, config)
        except ResourceError:  # (the model does not fit: said before a server started, as this process says it)
            raise
        except LlmcliError as exc:  # no warm server: this process answers, as without --keep-alive
            notices.append(f"{exc.message}; answering in this process")
        else:
            from llmcli.pipeline.fallback import FallbackAnswerer

            def open_here() -> Pipeline[Answerer]:
                from llmcli.pipeline.local import open_local  # loads llama.cpp

                return open_local(request, on_progress, cancel, on_waiting, config, constraint)

            fallback = FallbackAnswerer(warm.session, open_here)
            warm.resources.callback(fallback.close)
            return dataclasses.replace(warm, session=fallback)
    from llmcli.pipeline.local import open_local  # loads llama.cpp

    pipeline = open_local(request, on_progress, cancel, on_waiting, config, constraint)
    pipeline.session.notices[:0] = notices
    return pipeline


def check_fits(model: models.ResolvedModel, header: GGUFHeader, cells: int, kv_type: str, force: bool,
               resident: bool = False) -> None:
    """The one memory check (ResourceError): the model's weights — none where this process holds them already
    (`resident`) — and a KV cache of `cells` cells of `kv_type`, against what is available less what other warm
    servers hold. Made where a model loads, and by a warm server's client before it starts one."""
    from llmcli.pipeline.warm import held_by_others

    weights = 0 if resident else sum(p.stat().st_size for p in model.files)
    memory.check_memory(model.name, weights, memory.kv_cache_bytes(header, cells, 1, kv_type) if cells else 0, force,
                        0 if force else held_by_others(model.path))


def projector_of(effective: settings.Settings, model: models.ResolvedModel) -> Path | None:
    """The vision projector to use: --mmproj, else the one found with the model (None: the model reads text only)."""
    given = effective["mmproj"]
    if not given:
        return model.projector
    path = Path(given).expanduser()
    if not path.is_file():
        raise UsageError(f"--mmproj {given}: no such file")
    return path


def speculation_mode(effective: settings.Settings) -> str:
    """How --speculate applies: a --draft-model given is a draft model to use (auto, unless --speculate was set);
    `draft` without one is a UsageError."""
    mode, reference = effective["speculate"], effective["draft_model"]
    if reference and effective.sources["speculate"] == "default":
        mode = "auto"
    if mode == "draft" and not reference:
        raise UsageError("--speculate draft needs a --draft-model", hint="Or --speculate lookup: drafts from the prompt.")
    return str(mode)


@dataclass(frozen=True)
class ShownPrompt:
    """`run --show-prompt`: the prompt as the model will see it, how it was made, and the context it goes into."""

    rendered: RenderedPrompt
    templated: bool  # by the chat template (False: raw)
    n_ctx: int


def shown_prompt(pipeline: Pipeline[Answerer], request: Request, text: str | None, tools: ToolSpec | None = None,
                 images: tuple[ImageInput, ...] = ()) -> ShownPrompt:
    """The prompt of `text` after the conversation, with `tools`: rendered by the model in this process, or, when a
    warm server holds it, by its vocabulary and template read here (no weights loaded); --endpoint's server renders
    its own (UsageError)."""
    session, local = pipeline.session, pipeline.session.local
    if local is not None:
        return ShownPrompt(local.render(text, tools=tools, images=images), local.template_source is not None,
                           local.context().n_ctx)
    if pipeline.settings["endpoint"]:
        raise UsageError("the server renders the prompt with --endpoint: --show-prompt is not available")
    from llmcli.pipeline.local import open_tokenizer  # (the vocabulary alone: milliseconds)

    with open_tokenizer(request) as tokenizer:
        rendered = tokenizer.render(text, session.history, session.options, tools, images)
        return ShownPrompt(rendered, not session.options.raw and tokenizer.template is not None, tokenizer.n_ctx)


def prompt_text(pipeline: Pipeline[Answerer], request: Request) -> Callable[[ToolSpec | None], str] | None:
    """The conversation's prompt as it stands (it ends with tool results), rendered as the model sees it, with these
    tools: what --tools-debug shows after a round of calls; None where a server renders its own (--endpoint)."""
    if pipeline.session.local is None and pipeline.settings["endpoint"]:
        return None
    return lambda tools: shown_prompt(pipeline, request, None, tools).rendered.text


def _warm_possible(chosen: bool, notices: list[str]) -> bool:
    """A warm server needs the serve extra: without it, answers are given in this process (said when a keep-alive
    was asked for)."""
    from llmcli.pipeline.warm import without_serve

    why_not = without_serve(chosen, "answering")
    if why_not:
        notices.append(why_not)
    return why_not is None


def log_entry(pipeline: Pipeline[Answerer], kind: str, prompt: str, record: Mapping[str, Any],
              generation: GenerationOptions, conversation_id: str | None = None,
              messages: Sequence[Message] | None = None) -> answer_log.Entry:
    """One answer (its `--json` record) as the log keeps it: model (and its sha256 when already known: nothing is
    hashed for the log), system prompt, prompt, answer, reasoning, the settings that shaped it, why it ended, its
    timings; and the messages it added to its conversation, unless they are the prompt and the answer alone (tool
    calls and results, pictures: what the conversation's record replays). `generation`: the options the answer was
    given with (chat's /set changes them)."""
    path = pipeline.model.path
    used = {**generation.sampling.record(), "max_tokens": generation.max_tokens, "stop": list(generation.stops)}
    return answer_log.Entry(kind, pipeline.model.name, known_sha256(path) if path else None,
                            pipeline.session.options.system, prompt, record.get("text") or "", record.get("reasoning"),
                            used, record.get("finish_reason") or "", record.get("timings") or {}, conversation_id,
                            None if not messages or _plain(prompt, record.get("text") or "", messages)
                            else [m.record() for m in messages])


def _plain(prompt: str, answer: str, messages: Sequence[Message]) -> bool:
    """Whether an exchange's messages are its prompt and its answer alone (its record replays them from those)."""
    return list(messages) == [Message("user", prompt), Message("assistant", answer)]


def continued(conversation_id: str | None) -> tuple[str, list[dict[str, Any]]]:
    """`run --continue` (the latest conversation in the log, a run's or a chat's) or `--cid ID`: its id and its
    record (what `Conversation.replay` reads: exchanges with their tool calls, /set, /system, /undo...)."""
    with answer_log.AnswerLog(paths.answer_log_file()) as log:
        chosen = conversation_id or log.latest_conversation()
        records = log.events(chosen) if chosen else []
        if chosen and not records:  # logged before conversations had a record: its answers, as exchanges
            records = [{"type": "exchange", "user": a["prompt"], "text": a["answer"], "messages": a.get("messages")}
                       for a in reversed(log.find(limit=10_000, conversation_id=chosen))]
            records = [{k: v for k, v in r.items() if v is not None} for r in records]
    if not chosen or not records:
        raise UsageError(f"no conversation {conversation_id!r} in the log" if conversation_id else
                         "nothing to continue: the log holds no conversation yet", hint="llmcli logs lists what it holds.")
    return chosen, records


def fetch_for(request: Request, effective: settings.Settings, on_progress: ProgressCallback | None = None,
              on_waiting: WaitingNotice | None = None) -> Fetch:
    """How this request may reach the Hub (--offline, --force, --hub-timeout)."""
    return Fetch(offline=request.offline, force=request.force, timeout=effective["hub_timeout"],
                 on_progress=on_progress, on_waiting=on_waiting)


