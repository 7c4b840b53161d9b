"""Step 2, build the prompt: the GGUF's chat template rendered in a bounded Jinja sandbox."""

from __future__ import annotations

from pathlib import Path

from llmcli.errors import UsageError


def read_template_file(path: Path) -> str:
    """--chat-template-file's text (UsageError, exit 2, when it cannot be read as UTF-8): read where it is rendered,
    and by a warm server's client, whose server is another one when the text is (llmcli/pipeline/warm.py)."""
    from llmcli.prompt.chat_template import MAX_TEMPLATE_CHARS, too_long

    most = 4 * MAX_TEMPLATE_CHARS  # (UTF-8: at most 4 bytes a character; more bytes than this hold more characters)
    try:
        with path.open("rb") as handle:  # (read no more than the limit allows: a huge file, a device, a pipe)
            data = handle.read(most + 1)
        if len(data) > most:
            raise too_long(str(path), f"more than {MAX_TEMPLATE_CHARS}")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --chat-template-file {path}: {exc}") from None
