"""Step 2, build the prompt: the GGUF's chat template rendered in a bounded Jinja sandbox."""

from __future__ import annotations

from pathlib import Path

from llmcli.errors import UsageError


def read_template_file(path: Path) -> str:
    """--chat-template-file's text (UsageError, exit 2, when it cannot be read as UTF-8): read where it is rendered,
    and by a warm server's client, whose server is another one when the text is (llmcli/pipeline/warm.py)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --chat-template-file {path}: {exc}") from None
