"""Writing the config file — a profile (`bench --tune --save NAME`), a model's settings (`eval tools --calibrate
--save`), a template (`run --save NAME`), one setting (`logs off`) — keeping the rest of the file as the user wrote it:
tomlkit edits the document in place (comments, order and layout survive). Reading stays in settings.py, beside it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from llmcli import paths
from llmcli.config import settings
from llmcli.errors import UsageError


def edit_document(change: Callable[[Any], None]) -> None:
    """Apply `change` to the parsed config file and write it back, whole or not at all (a broken file is reported
    as such, never overwritten)."""
    import tomlkit

    path = paths.config_file()
    settings.load_config_file()
    try:
        document = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    change(document)
    text = tomlkit.dumps(document)
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


def check_name(name: str, what: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise UsageError(f"invalid {what} name {name!r}: letters, digits, - and _")


def save_profile(name: str, values: Mapping[str, Any], comment: str) -> None:
    """Replace (or add) `[profiles.NAME]` with `values`."""
    check_name(name, "profile")
    _save_table("profiles", name, values, comment, "bench --tune")


def save_model_settings(model: str, values: Mapping[str, Any], comment: str) -> None:
    """Replace (or add) `[models.MODEL]` with `values`: settings that apply whenever MODEL is the model (`eval tools
    --calibrate --save`)."""
    _save_table("models", model, values, comment, f"[models.{model}]")


def _save_table(kind: str, name: str, values: Mapping[str, Any], comment: str, origin: str) -> None:
    """`[KIND.NAME]` replaced (or added) with `values` (checked as settings, named by `origin`), `comment` first."""
    import tomlkit

    for key, value in values.items():
        settings.check_value(settings.SETTINGS[key], value, origin)
    table = tomlkit.table()
    table.add(tomlkit.comment(comment))
    for key, value in values.items():
        table.add(key, value)

    def change(document: Any) -> None:
        document.setdefault(kind, tomlkit.table(is_super_table=True))[name] = table

    edit_document(change)


def save_setting(key: str, value: Any) -> None:
    """Set one top-level setting (`llmcli logs off` writes `log = false`)."""
    settings.check_value(settings.SETTINGS[key], value, "llmcli")

    def change(document: Any) -> None:
        document[key] = value

    edit_document(change)


def save_alias(name: str, target: str | None) -> None:
    """Set (or, `target` None, remove) `[aliases] NAME = "TARGET"` (`quant advise --save`)."""
    import tomlkit

    def change(document: Any) -> None:
        aliases = document.setdefault("aliases", tomlkit.table())
        if target is None:
            aliases.pop(name, None)
        else:
            aliases[name] = target

    edit_document(change)
