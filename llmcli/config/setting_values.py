"""A setting's value read from text (the environment, chat's /set) or from TOML and GGUF metadata, typed and
type-checked as its flag's would be. llmcli/config/settings.py holds the table and the rules; this, the reading."""

from __future__ import annotations

import json
from typing import Any, Protocol

from llmcli.errors import UsageError
from llmcli.text_escapes import unescape


class Setting(Protocol):
    """What reading a value needs of a setting (llmcli/config/settings.py's `Setting`)."""

    @property
    def default(self) -> Any: ...

    @property
    def kind(self) -> type: ...

    @property
    def escapes(self) -> bool: ...

    @property
    def flag(self) -> str: ...

    def normalised(self, value: Any) -> Any: ...

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_text(setting: Setting, raw: str, where: str) -> Any:
    """A setting's value from text (the environment, chat's /set): `none` clears an optional setting (no value)
    or a list (no items), as /help says."""
    text = raw.strip()
    if text.lower() in ("none", "null") and (setting.default is None or setting.kind is list):
        return [] if setting.kind is list else None
    try:
        if setting.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if setting.kind is list:  # a JSON list (its own escapes), or one item
            value = json.loads(text) if text.startswith("[") else [unescape(raw) if setting.escapes else raw]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return value
        return setting.normalised(setting.kind(text))
    except (ValueError, json.JSONDecodeError):
        raise UsageError(f"{where}={raw!r} is not a valid {setting.kind.__name__} for {setting.flag}") from None


def coerce(setting: Setting, value: Any, where: str) -> Any:
    """A value from TOML or GGUF metadata, type-checked (an int is a valid float)."""
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
