"""Every tunable value, where it came from, and the one precedence rule:

    flag > environment (LLMCLI_<NAME>) > profile in the config file > config file > model defaults > built-in

The config file is TOML at $LLMCLI_CONFIG or `<user config dir>/llmcli/config.toml`:

    temp = 0.7
    model = "smollm2"

    [profiles.coder]
    temp = 0.2
    system = "You are a careful senior engineer."

Model defaults are the `general.sampling.*` keys some GGUF files carry.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli import config
from llmcli.errors import UsageError
from llmcli.sampling import RULES, SamplingConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Setting:
    name: str  # key in the config file; LLMCLI_<NAME> in the environment
    kind: type
    default: Any
    flag: str
    model_key: str | None = None  # GGUF metadata key holding the model's own default
    choices: tuple[Any, ...] = ()
    minimum: float | None = None

    @property
    def env(self) -> str:
        return f"LLMCLI_{self.name.upper()}"


def _s(name: str, kind: type, default: Any, flag: str, model_key: str | None = None, **extra: Any) -> Setting:
    return Setting(name, kind, default, flag, model_key, **extra)


SETTINGS: dict[str, Setting] = {s.name: s for s in [
    _s("model", str, None, "--model"),
    _s("system", str, None, "--system"),
    _s("temp", float, 0.8, "--temp", "general.sampling.temp"),
    _s("top_k", int, 40, "--top-k", "general.sampling.top_k"),
    _s("top_p", float, 0.95, "--top-p", "general.sampling.top_p"),
    _s("min_p", float, 0.05, "--min-p", "general.sampling.min_p"),
    _s("typical_p", float, 1.0, "--typical-p"),
    _s("repeat_penalty", float, 1.0, "--repeat-penalty", "general.sampling.penalty_repeat"),
    _s("repeat_last_n", int, 64, "--repeat-last-n", "general.sampling.penalty_last_n"),
    _s("presence_penalty", float, 0.0, "--presence-penalty"),
    _s("frequency_penalty", float, 0.0, "--frequency-penalty"),
    _s("mirostat", int, 0, "--mirostat", "general.sampling.mirostat"),
    _s("mirostat_tau", float, 5.0, "--mirostat-tau", "general.sampling.mirostat_tau"),
    _s("mirostat_eta", float, 0.1, "--mirostat-eta", "general.sampling.mirostat_eta"),
    _s("seed", int, None, "--seed"),
    _s("max_tokens", int, None, "--max-tokens", minimum=1),
    _s("stop", list, [], "--stop"),
    _s("ctx_size", int, None, "--ctx-size", minimum=16),
    _s("threads", int, None, "--threads", minimum=1),
    _s("batch_size", int, 512, "--batch-size", minimum=1),
    _s("mlock", bool, False, "--mlock"),
    _s("mmap", bool, True, "--mmap/--no-mmap"),
    _s("on_overflow", str, "error", "--on-overflow", choices=("error", "truncate")),
]}

# SamplingConfig field <- setting name, where they differ
_SAMPLING_NAMES = {"temperature": "temp"}


RESERVED_TABLES = ("profiles", "aliases")


def config_path() -> Path:
    return Path(os.environ.get("LLMCLI_CONFIG") or config.config_dir() / "config.toml")


@dataclass(frozen=True)
class Settings:
    """The effective value of every setting, and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    profile: str | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def sampling(self, **extra: Any) -> SamplingConfig:
        """The SamplingConfig these settings describe; `extra` adds logit_bias and grammar."""
        kwargs = {field: self.values[_SAMPLING_NAMES.get(field, field)] for field in RULES}
        return SamplingConfig(**kwargs, **extra)


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
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
    data["aliases"] = {name.lower(): ref for name, ref in aliases.items()}
    for where, table in [("", {k: v for k, v in data.items() if k not in RESERVED_TABLES})] + [
        (f"[profiles.{name}] ", table) for name, table in profiles.items()
    ]:
        for key, value in table.items():
            if key not in SETTINGS:
                raise UsageError(f"config file {path}: {where}unknown setting {key!r}", hint=f"Known: {', '.join(SETTINGS)}")
            table[key] = _coerce(SETTINGS[key], value, f"config file {path}: {where}{key}")
    return data


def resolve(
    flags: Mapping[str, Any],
    profile: str | None = None,
    model_defaults: Mapping[str, Any] | None = None,
    config_data: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge the layers. `flags` holds only what was given on the command line."""
    data = load_config_file() if config_data is None else config_data
    profiles = data.get("profiles", {})
    profile = profile or os.environ.get("LLMCLI_PROFILE") or None
    if profile is not None and profile not in profiles:
        known = ", ".join(profiles) or "none defined"
        raise UsageError(f"unknown profile {profile!r} (profiles: {known})", hint=f"Define [profiles.{profile}] in {config_path()}.")
    path = config_path().name
    layers: list[tuple[str, Mapping[str, Any]]] = [
        ("flag", {k: v for k, v in flags.items() if v is not None}),
        ("env", _from_env()),
        (f"profile {profile} ({path})", profiles.get(profile, {}) if profile else {}),
        (path, {k: v for k, v in data.items() if k not in RESERVED_TABLES}),
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
    return Settings(values, sources, profile)


def model_defaults(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a GGUF declares (`general.sampling.*`)."""
    found = {}
    for setting in SETTINGS.values():
        if setting.model_key and setting.model_key in metadata:
            try:
                found[setting.name] = _coerce(setting, metadata[setting.model_key], setting.model_key)
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
        if raw is None or raw == "":
            continue
        found[setting.name] = _parse_text(setting, raw, setting.env)
    return found


def _parse_text(setting: Setting, raw: str, where: str) -> Any:
    try:
        if setting.kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("1", "true", "yes", "on")
        if setting.kind is list:
            return json.loads(raw) if raw.lstrip().startswith("[") else [raw]
        return setting.kind(raw)
    except (ValueError, json.JSONDecodeError):
        raise UsageError(f"{where}={raw!r} is not a valid {setting.kind.__name__} for {setting.flag}") from None


def _coerce(setting: Setting, value: Any, where: str) -> Any:
    kind = setting.kind
    ok = (
        (kind is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (kind is int and isinstance(value, int) and not isinstance(value, bool))
        or (kind is list and isinstance(value, list) and all(isinstance(v, str) for v in value))
        or (kind in (str, bool) and isinstance(value, kind))
    )
    if not ok:
        raise UsageError(f"{where}: expected {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def check_value(setting: Setting, value: Any, source: str) -> None:
    """Values from any layer obey the same rules as the flag; the message names flag and source."""
    if value is None:
        return
    problem = None
    field = next((f for f, name in _SAMPLING_NAMES.items() if name == setting.name), setting.name)
    if field in RULES:
        check, rule, _ = RULES[field]
        problem = None if check(value) else rule
    elif setting.choices and value not in setting.choices:
        problem = f"must be one of {', '.join(setting.choices)}"
    elif setting.minimum is not None and value < setting.minimum:
        problem = f"must be >= {setting.minimum:g}"
    if problem:
        origin = "" if source.startswith(("flag", "/set")) else f", from {source}"
        raise UsageError(f"{setting.flag} {problem} (got {value}{origin})")
