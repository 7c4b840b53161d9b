"""Prompt templates: a saved system prompt, a prompt with placeholders, and default settings, by name.

They live in the config file, one table each:

    [templates.summarize]
    system = "You summarize documents in three bullet points."
    prompt = "Summarize this for $audience:\\n\\n$input"
    temp = 0.2

`$input` is what `run` was given (piped stdin and the prompt argument); other placeholders take `--var
NAME=VALUE`; one without a value is a usage error naming it. The settings rank as flags given on the command
line, below the flags actually given.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmcli import paths
from llmcli.config import settings
from llmcli.config.setting_values import coerce
from llmcli.errors import UsageError

TEXT_KEYS = ("system", "prompt")


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    system: str | None = None
    prompt: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def placeholders(self) -> list[str]:
        if self.prompt is None:
            return []
        found = []
        for match in string.Template.pattern.finditer(self.prompt):
            name = match.group("named") or match.group("braced")
            if name and name not in found:
                found.append(name)
        return found

    @property
    def needs_input(self) -> bool:
        return self.prompt is None or "input" in self.placeholders

    def render(self, input_text: str | None, variables: Mapping[str, str]) -> str:
        """The prompt with its placeholders filled; without a prompt, the input as it is."""
        if self.prompt is None:
            return input_text or ""
        values = {**variables, **({"input": input_text} if input_text is not None else {})}
        missing = [name for name in self.placeholders if name not in values]
        if missing:
            names = ", ".join(f"${name}" for name in missing)
            raise UsageError(f"template {self.name!r} has no value for {names}",
                             hint="$input is piped stdin or the prompt argument; give the others with --var NAME=VALUE.")
        return string.Template(self.prompt).safe_substitute(values)


def load(name: str, config: settings.ConfigFile | None = None) -> PromptTemplate:
    config = config or settings.load_config_file()
    table = config.templates.get(name)
    if not isinstance(table, dict):
        known = ", ".join(sorted(config.templates)) or "none saved"
        raise UsageError(f"no template {name!r} (templates: {known})",
                         hint='Save one: llmcli run --save NAME -s "…" "… $input …"')
    return parse(name, table)


def parse(name: str, table: Mapping[str, Any], where: str | None = None) -> PromptTemplate:
    where = where or f"config file {paths.config_file()}: [templates.{name}]"
    texts: dict[str, str | None] = {}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in TEXT_KEYS:
            if not isinstance(value, str):
                raise UsageError(f"{where} {key} must be a string")
            texts[key] = value
        elif key in settings.SETTINGS and key not in ("system",):
            values[key] = coerce(settings.SETTINGS[key], value, f"{where} {key}")
            settings.check_value(settings.SETTINGS[key], values[key], where)
        else:
            raise UsageError(f"{where}: unknown key {key!r}", hint="system, prompt, or a setting (temp, model, …)")
    return PromptTemplate(name, texts.get("system"), texts.get("prompt"), values)


def all_templates() -> list[PromptTemplate]:
    config = settings.load_config_file()
    return [load(name, config) for name in sorted(config.templates)]


def save(template: PromptTemplate) -> None:
    """Write (or replace) `[templates.NAME]` in the config file, keeping the rest of it."""
    import tomlkit

    from llmcli.config.config_file import check_name, edit_document

    check_name(template.name, "template")
    table = tomlkit.table()
    for key in TEXT_KEYS:
        value = getattr(template, key)
        if value is not None:
            table.add(key, value)
    for key, value in template.settings.items():
        table.add(key, value)

    def change(document: Any) -> None:
        document.setdefault("templates", tomlkit.table(is_super_table=True))[template.name] = table

    edit_document(change)


def remove(name: str) -> None:
    from llmcli.config.config_file import edit_document

    load(name)

    def change(document: Any) -> None:
        del document["templates"][name]

    edit_document(change)


def as_text(name: str) -> str:
    """`[templates.NAME]` alone, as TOML to edit (comments and layout as saved); a new template starts as `$input`."""
    import tomlkit

    config = settings.load_config_file()
    table = config.templates.get(name)
    document = tomlkit.document()
    templates = tomlkit.table(is_super_table=True)
    if table is None:
        table = {"prompt": "$input"}
    else:
        path = paths.config_file()
        table = tomlkit.parse(path.read_text(encoding="utf-8"))["templates"][name]  # its comments too
    templates[name] = table
    document["templates"] = templates
    return tomlkit.dumps(document)


def replace_from_text(name: str, text: str) -> PromptTemplate:
    """The edited `[templates.NAME]` back into the config file, checked first: a broken edit changes nothing."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    from llmcli.config.config_file import check_name, edit_document

    check_name(name, "template")
    try:
        edited = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise UsageError(f"the edited template {name!r} is not valid TOML ({exc}); the config file is unchanged") from None
    tables = edited.get("templates")
    if set(edited) != {"templates"} or not isinstance(tables, dict) or set(tables) != {name}:
        raise UsageError(f"the edit must hold only [templates.{name}]; the config file is unchanged")
    template = parse(name, tables[name].unwrap(), f"the edited [templates.{name}] (the config file is unchanged)")

    def change(document: Any) -> None:
        document.setdefault("templates", tomlkit.table(is_super_table=True))[name] = tables[name]

    edit_document(change)
    return template
