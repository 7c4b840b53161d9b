"""Writing a profile into the config file (`bench --tune --save NAME`), keeping the rest of the file as the user
wrote it: tomlkit edits the document in place (comments, order and layout survive). Reading stays in settings.py."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmcli import paths, settings
from llmcli.errors import UsageError


def save_profile(name: str, values: Mapping[str, Any], comment: str) -> None:
    """Replace (or add) `[profiles.NAME]` with `values`; the file is written whole or not at all."""
    import tomlkit

    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise UsageError(f"invalid profile name {name!r}: letters, digits, - and _")
    for key, value in values.items():
        settings.check_value(settings.SETTINGS[key], value, "bench --tune")
    path = paths.config_file()
    settings.load_config_file()  # a broken file is reported as such, never overwritten
    try:
        document = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    profiles = document.setdefault("profiles", tomlkit.table(is_super_table=True))
    table = tomlkit.table()
    table.add(tomlkit.comment(comment))
    for key, value in values.items():
        table.add(key, value)
    profiles[name] = table
    _write(path, tomlkit.dumps(document))


def _write(path: Path, text: str) -> None:
    """The whole file, or nothing (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text if text.endswith("\n") else text + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        raise UsageError(f"cannot write config file {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def save_setting(key: str, value: Any) -> None:
    """Set one top-level setting in the config file (`llmcli logs off` writes `log = false`), keeping the rest."""
    import tomlkit

    settings.check_value(settings.SETTINGS[key], value, "llmcli")
    path = paths.config_file()
    settings.load_config_file()  # a broken file is reported as such, never overwritten
    document = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    document[key] = value
    _write(path, tomlkit.dumps(document))
