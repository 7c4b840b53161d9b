"""One setting as the table declares it (`Setting`: its name, kind, default, flags, help, check) and how a person
reads a value of one (`show_value`). The table itself is llmcli/config/settings.py's."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str  # key in the config file, LLMCLI_<NAME> in the environment, `/set NAME` in chat
    kind: type  # float, int, str, bool or list (of str)
    default: Any
    help: str
    flags: tuple[str, ...]  # long flag first; a bool's is "--on/--off"
    panel: str
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # what `check` demands, for the error message
    choices: tuple[str, ...] = ()
    model_key: str | None = None  # GGUF metadata key holding the model's own default
    default_text: str | None = None  # the default as help shows it, where the value alone says too little
    chat: bool = False  # can be changed in a chat with /set
    escapes: bool = False  # backslash escapes in text typed as a flag, env value or /set are interpreted
    unset_by: Any = None  # a value that means "not set" (-n -1, as llama.cpp's tools read it), held as None

    @property
    def env(self) -> str:
        return f"LLMCLI_{self.name.upper()}"

    @property
    def flag(self) -> str:
        """The flag as messages name it (`--temp`, `--mmap`)."""
        return self.flags[0].split("/")[0]

    def shown_default(self) -> str:
        return self.default_text if self.default_text is not None else show_value(self.default)

    def normalised(self, value: Any) -> Any:
        """The value as held: None for the one that means "not set"."""
        return None if self.unset_by is not None and value == self.unset_by else value

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed, or None."""
        if value is None or (self.unset_by is not None and value == self.unset_by):
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.check is not None and not self.check(value):
            return self.rule
        return None


def show_value(value: Any) -> str:
    """A setting's value as a person reads it: `on`/`off`, `none`, `0.8`, `["a", "b"]`, never a Python repr."""
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)
