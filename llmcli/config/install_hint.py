"""How to add an extra to *this* llmcli: the command that installs into the environment it runs from.

`pip install "llmcli[serve]"` is wrong under pipx (it installs into another environment) and in a clone (it
fetches another llmcli); so the hint follows how this one was installed — pipx, a clone (editable or not), a
virtual environment or the system's Python."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path


def _requirements(extra: str) -> list[str]:
    """The packages the extra adds, as llmcli's metadata lists them (`starlette>=0.40`, …)."""
    from importlib import metadata

    try:
        requires = metadata.requires("llmcli") or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r""";\s*extra\s*==\s*["']""" + re.escape(extra) + r"""["']\s*$""")
    return [marker.sub("", r).strip() for r in requires if marker.search(r)]


def _source() -> tuple[str | None, bool]:
    """(the folder this llmcli was installed from, editable) for a clone; (None, False) from an index."""
    from importlib import metadata

    found = {}
    for distribution in metadata.distributions(name="llmcli"):  # (a clone's own llmcli.egg-info may come first)
        text = distribution.read_text("direct_url.json")
        if text:
            try:
                found = json.loads(text)
            except ValueError:
                continue
            break
    url = found.get("url", "")
    if not isinstance(url, str) or not url.startswith("file://"):
        return None, False
    return url[len("file://"):], bool((found.get("dir_info") or {}).get("editable"))


def under_pipx(prefix: Path | None = None) -> bool:
    """pipx keeps each application in a venv of its own, with pipx's metadata beside it."""
    return ((prefix or Path(sys.prefix)) / "pipx_metadata.json").exists()


def install_hint(extra: str) -> str:
    """The one command that adds `extra` to the llmcli running now."""
    if under_pipx():
        packages = " ".join(shlex.quote(p) for p in _requirements(extra)) or shlex.quote(f"llmcli[{extra}]")
        return f"pipx inject llmcli {packages}"
    source, editable = _source()
    target = shlex.quote(f"{source}[{extra}]" if source else f"llmcli[{extra}]")
    pip = shutil.which("pip")
    same = pip is not None and Path(pip).absolute().parent == Path(sys.executable).absolute().parent  # (no resolve:
    # a venv's python is a link to the system's)
    installer = "pip" if same else f"{shlex.quote(sys.executable)} -m pip"
    return f"{installer} install {'-e ' if editable else ''}{target}"
