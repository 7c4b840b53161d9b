"""Every tunable value, declared once: its flags, type, default, check, help, config key and env name.

The table `SETTINGS` is the single source. The CLI generates its options from it
(llmcli/cli/options.py), the config file and the environment are validated against it,
`llmcli config show` and chat's `/set` list it. One precedence rule:

    flag > environment (LLMCLI_<NAME>) > profile in the config file > the model's own table in the config file
    ([models.NAME]: what `eval tools --calibrate --save` found for it) > config file > model defaults > built-in

The config file is TOML at $LLMCLI_CONFIG or `<user config dir>/llmcli/config.toml`:

    temp = 0.7
    model = "smollm2"

    [profiles.coder]
    temp = 0.2
    system = "You are a careful senior engineer."

Model defaults are the `general.sampling.*` keys some GGUF files carry.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli import paths
from llmcli.config.setting import Setting
from llmcli.config.setting_values import coerce, parse_text
from llmcli.errors import UsageError
from llmcli.text_escapes import unescape
from llmcli.units import DEFAULT_KEEP_ALIVE, is_duration

# Help panels
MODEL, SAMPLING, ENGINE, CACHE, OUTPUT, REMOTE, DOWNLOADS, TOOLS = ("Model and prompt", "Sampling and stopping", "Engine",
    "Prompt cache", "Output", "A server instead (--endpoint)", "Downloads (Hugging Face Hub)", "Tools")


def _s(name: str, kind: type, default: Any, help: str, *flags: str, panel: str = SAMPLING, **extra: Any) -> Setting:
    return Setting(name, kind, default, help, flags or (f"--{name.replace('_', '-')}",), panel, **extra)


MAX_THREADS = 512  # llama.cpp's GGML_MAX_N_THREADS


def _at_least(minimum: float) -> dict[str, Any]:
    return {"check": lambda v: v >= minimum, "rule": f"must be >= {minimum:g}"}


_SAMPLING_KEY = "general.sampling."

SETTINGS: dict[str, Setting] = {s.name: s for s in [
    _s("model", str, None, "A .gguf path, OWNER/REPO[:QUANT] from Hugging Face, an alias or an installed model.",
       "--model", "-m", panel=MODEL, default_text="the config file's, else the first installed model"),
    _s("mmproj", str, None, "The model's vision projector (an mmproj .gguf): images in prompts.", panel=MODEL,
       default_text="found with the model: beside its file, in its Hub repository or Ollama manifest"),
    _s("system", str, None, "System prompt.", "--system", "-s", panel=MODEL, chat=True),
    _s("think", bool, None, "Reasoning models: let the model think first, or not (the chat template's "
       "enable_thinking); no effect on models without the switch.", "--think/--no-think", panel=MODEL,
       default_text="the template's default", chat=True),
    _s("think_budget", int, None, "Reasoning models: after this many tokens of thinking the think block is closed "
       "and the answer follows.", panel=MODEL, default_text="none: as long as the model thinks", chat=True,
       check=lambda v: v >= 0, rule="must be >= 0"),
    _s("reasoning", str, "show", "Where a reasoning model's thinking goes: show (dimmed before the answer on a "
       "terminal, left out when piped), hide, stderr, or stdout (kept in the answer with its <think> tags).",
       choices=("show", "hide", "stderr", "stdout"), panel=OUTPUT),
    _s("temp", float, 0.8, "Temperature; 0 picks the most likely token (greedy).",
       check=lambda v: v >= 0, rule="must be >= 0", model_key=_SAMPLING_KEY + "temp", chat=True),
    _s("top_k", int, 40, "Keep the K most likely tokens; 0 disables.",
       check=lambda v: v >= 0, rule="must be >= 0 (0 disables it)", model_key=_SAMPLING_KEY + "top_k", chat=True),
    _s("top_p", float, 0.95, "Keep the smallest set of tokens whose probability sums to P, in (0, 1].",
       check=lambda v: 0 < v <= 1, rule="must be in (0, 1]", model_key=_SAMPLING_KEY + "top_p", chat=True),
    _s("min_p", float, 0.05, "Drop tokens less likely than P times the most likely one.",
       check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]", model_key=_SAMPLING_KEY + "min_p", chat=True),
    _s("typical_p", float, 1.0, "Locally typical sampling, in (0, 1]; 1 disables.",
       check=lambda v: 0 < v <= 1, rule="must be in (0, 1]", chat=True),
    _s("repeat_penalty", float, 1.0, "Penalise repeated tokens; 1 disables.",
       check=lambda v: v > 0, rule="must be > 0 (1 disables it)", model_key=_SAMPLING_KEY + "penalty_repeat", chat=True),
    _s("repeat_last_n", int, 64, "How many recent tokens the penalties look at; -1 the whole context.",
       check=lambda v: v >= -1, rule="must be >= -1 (-1: the whole context)", model_key=_SAMPLING_KEY + "penalty_last_n",
       chat=True),
    _s("presence_penalty", float, 0.0, "Penalise tokens that already appeared.",
       check=math.isfinite, rule="must be a finite number", chat=True),
    _s("frequency_penalty", float, 0.0, "Penalise tokens by how often they appeared.",
       check=math.isfinite, rule="must be a finite number", chat=True),
    _s("mirostat", int, 0, "Mirostat sampling: 0 off, 1 or 2 (replaces top-k/p and min-p).",
       check=lambda v: v in (0, 1, 2), rule="must be 0, 1 or 2", model_key=_SAMPLING_KEY + "mirostat", chat=True),
    _s("mirostat_tau", float, 5.0, "Mirostat target entropy.",
       check=lambda v: v > 0, rule="must be > 0", model_key=_SAMPLING_KEY + "mirostat_tau", chat=True),
    _s("mirostat_eta", float, 0.1, "Mirostat learning rate.",
       check=lambda v: v > 0, rule="must be > 0", model_key=_SAMPLING_KEY + "mirostat_eta", chat=True),
    _s("dry_multiplier", float, 0.0, "DRY: penalise tokens that would extend a repeated sequence (0.8 is typical); 0 disables.",
       check=lambda v: v >= 0, rule="must be >= 0", chat=True),
    _s("dry_base", float, 1.75, "DRY: how fast the penalty grows with the length of the repeat.",
       check=lambda v: v >= 1, rule="must be >= 1", chat=True),
    _s("dry_allowed_length", int, 2, "DRY: repeats up to this many tokens go unpenalised.",
       check=lambda v: v >= 1, rule="must be >= 1", chat=True),
    _s("dry_penalty_last_n", int, -1, "DRY: how many recent tokens it looks at; -1 the whole context, 0 disables.",
       check=lambda v: v >= -1, rule="must be >= -1", chat=True),
    _s("xtc_probability", float, 0.0, "XTC: chance per token of excluding the top choices (keeps the least likely "
       "one above the threshold); 0 disables.", check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]", chat=True),
    _s("xtc_threshold", float, 0.1, "XTC: tokens at least this likely are the top choices; above 0.5 disables.",
       check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]", chat=True),
    _s("seed", int, None, "Random seed; the same seed repeats a sampled answer.",
       check=lambda v: 0 <= v < 2**32 - 1, rule="must be in [0, 2^32 - 1)", default_text="random", chat=True),
    _s("max_tokens", int, None, "Stop after this many tokens (-1: no limit).", "--max-tokens", "-n",
       default_text="until the model stops or the context is full", chat=True, unset_by=-1,
       check=lambda v: v >= 1, rule="must be >= 1 (or -1, or no -n: until the model stops or the context is full)"),
    _s("stop", list, [], "Stop when the answer contains this text (never printed; \\n, \\t, \\uHHHH are interpreted). "
       "Repeatable.", chat=True, escapes=True),
    _s("repetition_guard", bool, True, "Stop an answer caught in a loop (the same run of tokens over and over), "
       "with finish reason `repetition`.", "--repetition-guard/--no-repetition-guard", chat=True),
    _s("on_overflow", str, "error", "When the prompt does not fit the context: error, or truncate "
       "(keep the system prompt and the end of the input).", choices=("error", "truncate"), chat=True),
    _s("keep_alive", str, DEFAULT_KEEP_ALIVE, "Keep the model loaded this long after an answer (30s, 10m, 1h; -1: until "
       "`llmcli stop`), in a private server on a Unix socket that the next run, chat, --batch or embed answers through "
       "at once; 0: load, answer and exit in this process.", panel=ENGINE, check=is_duration,
       rule="must be a duration: 30s, 10m, 1h, 0 or -1"),
    _s("max_models", int, 3, "Warm servers kept at once (each holds one model): starting another first stops the one "
       "idle the longest.", panel=ENGINE, check=lambda v: v >= 1, rule="must be >= 1"),
    _s("endpoint", str, None, "Use an OpenAI-compatible server (vLLM, llama-server, Ollama, llmcli serve) at this URL "
       "(…/v1) instead of a local model; -m names its model.", panel=REMOTE, default_text="none: a local model"),
    _s("endpoint_timeout", float, 60.0, "With --endpoint: seconds to wait for the server to connect or to send the "
       "next bytes.", panel=REMOTE, check=lambda v: v > 0, rule="must be > 0"),
    _s("hub_timeout", float, 10.0, "Seconds to wait for the Hub to connect or to send the next bytes before giving up.",
       panel=DOWNLOADS, check=lambda v: v > 0, rule="must be > 0"),
    _s("call_preference", float, 3.0, "With --tool-choice auto: how strongly the answer is led to begin with a call "
       "(added to the logit of the call's opening at the answer's first token, plus up to --call-gain more the more "
       "of the question is about what the tools do; 0: the model's own choice). A small model rarely opens a call by itself; "
       "too much and it calls where no tool fits (`llmcli eval tools` measures both).", panel=TOOLS,
       check=lambda v: 0 <= v <= 30, rule="must be between 0 and 30"),
    _s("call_gain", float, 3.0, "With --tool-choice auto: what --call-preference gains for a question wholly about "
       "what the tools do (times the share of its words the tools' names, descriptions and parameters use). `llmcli "
       "eval tools --calibrate` finds both for a model.", panel=TOOLS, check=lambda v: 0 <= v <= 30,
       rule="must be between 0 and 30"),
    _s("tool_format", str, "auto", "How the model writes a tool call: auto (recognised from its chat template, as "
       "llama-server does; generic when the template knows no tools), hermes (<tool_call>), mistral ([TOOL_CALLS]), "
       "llama3, or generic (llmcli describes the tools in the system prompt).",
       choices=("auto", "hermes", "generic", "mistral", "llama3"), panel=TOOLS),
    _s("ctx_size", int, None, "Context window in tokens (llama.cpp rounds it up to a multiple of 256).",
       "--ctx-size", "-c", panel=ENGINE, default_text="the model's, capped at 4096", **_at_least(16)),
    _s("threads", int, None, "CPU threads.", "--threads", "-t", panel=ENGINE,
       default_text="one per physical core",  # (llama.cpp's most, GGML_MAX_N_THREADS: more overflows its arrays)
       check=lambda v: 1 <= v <= MAX_THREADS, rule=f"must be between 1 and {MAX_THREADS}"),
    _s("batch_size", int, 512, "Prompt tokens evaluated per step.", "--batch-size", "-b", panel=ENGINE, **_at_least(1)),
    _s("mlock", bool, False, "Keep the weights in RAM.", "--mlock/--no-mlock", panel=ENGINE),
    _s("mmap", bool, True, "Map the model file instead of reading it.", "--mmap/--no-mmap", panel=ENGINE),
    _s("speculate", str, "auto", "Speculative decoding: several tokens a pass when a draft is right. auto drafts (from the "
       "prompt, or --draft-model) when its cost model expects a gain; lookup and draft always do; off never.",
       choices=("auto", "lookup", "draft", "off"), panel=ENGINE),
    _s("draft_model", str, None, "A small model with the same vocabulary that drafts tokens (--speculate auto, unless "
       "given).",
       panel=ENGINE, default_text="none: drafts come from the prompt and the answer"),
    _s("draft_max", int, 16, "The most tokens drafted for one pass.", panel=ENGINE,
       check=lambda v: 1 <= v <= 32, rule="must be in [1, 32]"),
    _s("flash_attn", str, "auto", "Flash attention: auto (llama.cpp decides), on or off. A quantized KV cache "
       "(--kv-type q8_0, q4_0) needs it.", choices=("auto", "on", "off"), panel=ENGINE),
    _s("kv_type", str, "f16", "Type of the KV cache's keys and values: q8_0 halves its memory, q4_0 quarters it "
       "(with flash attention).", choices=("f16", "q8_0", "q4_0"), panel=ENGINE),
    _s("markdown", bool, True, "On a terminal, render the answer's Markdown as it streams; --plain writes the model's "
       "text as is (as piped output always is).", "--markdown/--plain", panel=OUTPUT),
    _s("answer_color", str, None, "The answer's colour on a terminal: a name (cyan, the old look), color(N) or #rrggbb. "
       "Thinking stays dimmed, notices and stats keep theirs.", panel=OUTPUT, default_text="none: the terminal's own",
       check=lambda v: re.fullmatch(r"[a-z_]+[0-9]*|color\([0-9]{1,3}\)|#[0-9a-fA-F]{6}", v) is not None,
       rule="must be a colour name, color(N) or #rrggbb"),
    _s("special", bool, False, "Keep the text of control tokens in the answer (<|im_end|>, <start_of_image>); "
       "without it they are left out.", "--special/--no-special", panel=OUTPUT),
    _s("logprobs", int, None, "With --json: each answer token's logprob (the model's own distribution) and the N most "
       "likely tokens at its place (0: the token's own only).", panel=OUTPUT, default_text="none",
       check=lambda v: 0 <= v <= 20, rule="must be in [0, 20]"),
    _s("log", bool, True, "Record every answer in the log (llmcli logs: search, list, remove).", "--log/--no-log",
       panel=OUTPUT),
    _s("prompt_cache", bool, True, "Save the KV state of long prompts on disk and start later prompts that share "
       "their beginning from it (prefill once across runs).", "--prompt-cache/--no-prompt-cache", panel=CACHE),
    _s("prompt_cache_min", int, 256, "Save a prompt's KV state when at least this many of its tokens were evaluated.",
       panel=CACHE, **_at_least(1)),
    _s("prompt_cache_size", float, 4.0, "Disk budget of the prompt cache in GiB; the least recently used states go first.",
       panel=CACHE, check=lambda v: v > 0, rule="must be > 0"),
]}

RESERVED_TABLES = ("profiles", "aliases", "templates", "models")


def unknown_hint(name: str, known: Collection[str], label: str = "Known") -> str:
    """The hint of an unknown setting's error: the nearest known names first (a typo), then all of them."""
    near = difflib.get_close_matches(name, known, n=2, cutoff=0.75)
    guess = f"Did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    return f"{guess}{label}: {', '.join(known)}"


def default(name: str) -> Any:
    """The built-in default of a setting: the one place its literal lives is the table above."""
    return SETTINGS[name].default


@dataclass(frozen=True)
class Settings:
    """The effective value of every setting, and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    profile: str | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def chosen_now(self) -> frozenset[str]:
        """The settings given for this run (flag, environment, profile): they outrank what a resumed
        conversation saved, which ranks where the config file does."""
        return frozenset(name for name, source in self.sources.items() if source.split()[0] in ("flag", "env", "profile"))


@dataclass(frozen=True)
class ConfigFile:
    """The parsed, validated config file: top-level settings, profiles and aliases."""

    settings: dict[str, Any]
    profiles: dict[str, dict[str, Any]]
    aliases: dict[str, str]
    templates: dict[str, Any] = field(default_factory=dict)  # [templates.NAME], checked by llmcli/config/saved_templates.py
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # [models.NAME]: settings of one model, by its name


def load_config_file() -> ConfigFile:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

    path = paths.config_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ConfigFile({}, {}, {})
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config file {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise UsageError(f"config file {path}: [profiles.NAME] must be tables")
    aliases = data.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise UsageError(f"config file {path}: [aliases] maps names to model references (strings)")
    models = data.get("models", {})
    if not isinstance(models, dict) or not all(isinstance(m, dict) for m in models.values()):
        raise UsageError(f"config file {path}: [models.NAME] must be tables")
    top = {k: v for k, v in data.items() if k not in RESERVED_TABLES}
    tables = [("", top)] + [(f"[profiles.{name}] ", table) for name, table in profiles.items()] + [
        (f"[models.{name}] ", table) for name, table in models.items()]
    for where, table in tables:
        for key, value in table.items():
            if key not in SETTINGS:
                raise UsageError(f"config file {path}: {where}unknown setting {key!r}", hint=unknown_hint(key, SETTINGS))
            table[key] = coerce(SETTINGS[key], value, f"config file {path}: {where}{key}")
    templates = data.get("templates", {})
    for name, table in (templates.items() if isinstance(templates, dict) else ()):
        for key in table if isinstance(table, dict) else ():  # (checked on every read, as the settings above are)
            if key != "prompt" and key not in SETTINGS:
                raise UsageError(f"config file {path}: [templates.{name}] unknown key {key!r}",
                                 hint="system, prompt, or a setting (temp, model, …)")
    return ConfigFile(top, profiles, {name.lower(): ref for name, ref in aliases.items()},
                      templates if isinstance(templates, dict) else {}, models)


def resolve(
    flags: Mapping[str, Any],
    profile: str | None = None,
    model_defaults: Mapping[str, Any] | None = None,
    config: ConfigFile | None = None,
    model_name: str | None = None,
) -> Settings:
    """Merge the layers. `flags` holds only what was given on the command line; `model_name` the resolved model's
    name, whose [models.NAME] table applies."""
    config = load_config_file() if config is None else config
    profile = profile or os.environ.get("LLMCLI_PROFILE") or None
    if profile is not None and profile not in config.profiles:
        known = ", ".join(config.profiles) or "none defined"
        raise UsageError(f"unknown profile {profile!r} (profiles: {known})",
                         hint=f"Define [profiles.{profile}] in {paths.config_file()}.")
    file_name = paths.config_file().name
    layers: list[tuple[str, Mapping[str, Any]]] = [
        ("flag", {k: _typed(SETTINGS[k], v) if k in SETTINGS else v for k, v in flags.items() if v is not None}),
        ("env", _from_env()),
        (f"profile {profile} ({file_name})", config.profiles.get(profile, {}) if profile else {}),
        (f"[models.{model_name}] ({file_name})", config.models.get(model_name, {}) if model_name else {}),
        (file_name, config.settings),
        ("model", model_defaults or {}),
    ]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS.values():
        for label, layer in layers:
            if setting.name in layer:
                values[setting.name] = layer[setting.name]
                sources[setting.name] = _describe(label, setting)
                break
        else:
            values[setting.name], sources[setting.name] = setting.default, "default"
        check_value(setting, values[setting.name], sources[setting.name])
        values[setting.name] = setting.normalised(values[setting.name])
    return Settings(values, sources, profile)


def _typed(setting: Setting, value: Any) -> Any:
    """A flag's value as the setting holds it: escapes interpreted where the setting takes them."""
    if setting.escapes and isinstance(value, list):
        return [unescape(v) for v in value]
    return value


def model_defaults(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a GGUF declares (`general.sampling.*`)."""
    found = {}
    for setting in SETTINGS.values():
        if setting.model_key and setting.model_key in metadata:
            try:
                found[setting.name] = coerce(setting, metadata[setting.model_key], setting.model_key)
            except UsageError:
                continue  # a malformed model default is ignored, not fatal
    return found


def _describe(label: str, setting: Setting) -> str:
    if label == "flag":
        return f"flag {setting.flag}"
    if label == "env":
        return f"env {setting.env}"
    if label == "model":
        return f"model ({setting.model_key})"
    return label


def _from_env() -> dict[str, Any]:
    found = {}
    for setting in SETTINGS.values():
        raw = os.environ.get(setting.env)
        if raw:
            found[setting.name] = parse_text(setting, raw, setting.env)
    return found


def check_value(setting: Setting, value: Any, source: str) -> None:
    """Values from any layer obey the same rules as the flag; the message names flag and source."""
    problem = setting.problem(value)
    if problem:
        origin = "" if source.startswith(("flag", "/set")) else f", from {source}"
        raise UsageError(f"{setting.flag} {problem} (got {value}{origin})")
