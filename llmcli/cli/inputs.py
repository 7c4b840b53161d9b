"""Reading the user's message from the prompt argument and piped stdin, without ever hanging."""

from __future__ import annotations

import os
import re
import select
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING

from llmcli.errors import ResourceError, UsageError

if TYPE_CHECKING:
    from llmcli.answer.images import ImageInput


def stdin_grace_s() -> float:
    """With a prompt argument, piped stdin is added only if it shows data (or EOF) this soon
    ($LLMCLI_STDIN_WAIT, 1 s): agents and CI often pass an inherited stdin that never closes."""
    return float(os.environ.get("LLMCLI_STDIN_WAIT", "1.0"))


def max_stdin_bytes() -> int:
    """The most stdin llmcli reads ($LLMCLI_MAX_STDIN, 64 MiB): far beyond any context window."""
    return int(os.environ.get("LLMCLI_MAX_STDIN", str(64 * 2**20)))


def read_message(prompt: str | None, wait_for_stdin: bool = False) -> tuple[str | None, str | None, str | None]:
    """Return (prompt, stdin text, notice). `-` or no prompt means stdin alone."""
    stdin = sys.stdin
    piped = stdin is not None and not _is_tty(stdin)
    if prompt in (None, "-"):
        if not piped:
            raise UsageError(
                "no prompt given" if prompt is None else "`-` reads the prompt from stdin, but stdin is a terminal",
                hint='Pass a prompt: llmcli run "..." or pipe text: echo "..." | llmcli run',
            )
        return None, _read_all(), None
    if not piped:
        return prompt, None, None
    grace = stdin_grace_s()
    if not wait_for_stdin and not _ready(stdin, grace):
        return prompt, None, f"stdin sent nothing for {grace:g} s; ignoring it (--stdin waits for it)"
    return prompt, _read_all(), None


def _is_tty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (ValueError, AttributeError):  # closed or not a real stream
        return True


def _ready(stream: IO[str], timeout: float) -> bool:
    try:
        readable, _, _ = select.select([stream], [], [], timeout)
    except (ValueError, OSError, TypeError):
        return True  # not selectable (e.g. a test harness's in-memory stream): just read it
    return bool(readable)


def _read_all() -> str:
    """All of stdin as text: invalid UTF-8 becomes U+FFFD; more than max_stdin_bytes() is refused."""
    limit = max_stdin_bytes()
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:
        data = sys.stdin.read(limit + 1).encode("utf-8", "replace")
    else:
        data = buffer.read(limit + 1)
    if len(data) > limit:
        raise ResourceError(
            f"stdin holds more than {limit:,} bytes; no context window takes that much",
            hint="Send a smaller part, or split the input.",
        )
    return data.decode("utf-8", "replace").rstrip("\r\n")  # `echo`'s newline is not part of the message


def combine_input(prompt: str | None, stdin_text: str | None, prompt_first: bool = False) -> str:
    """The prompt argument and piped stdin as one message: stdin, a blank line, the prompt (or the reverse).

    Stdin first: the large, stable part (a document) is the prefix, the question the tail, so a
    second question about the same document reuses the document's KV from the prompt cache."""
    parts = (prompt, stdin_text) if prompt_first else (stdin_text, prompt)
    text = "\n\n".join(p for p in parts if p and p.strip())
    if not text.strip():
        raise UsageError("no prompt given", hint='Pass a prompt: llmcli run "..." or pipe text into llmcli run -')
    return text


def read_images(names: list[str] | None) -> tuple[ImageInput, ...]:
    """`--image PATH` (repeatable; `-`: the image is piped on stdin, once), each decoded and checked."""
    from llmcli.answer.image_bytes import MAX_IMAGE_BYTES, decode_image, read_image
    from llmcli.answer.images import MAX_IMAGES

    names = names or []
    if len(names) > MAX_IMAGES:
        raise UsageError(f"{len(names)} images: a prompt takes at most {MAX_IMAGES}")
    if names.count("-") > 1:
        raise UsageError("--image - reads stdin: give it once")
    images = []
    for name in names:
        if name == "-":
            stream = sys.stdin
            if stream is None or _is_tty(stream):
                raise UsageError("--image - reads the image from stdin, but stdin is a terminal",
                                 hint="Pipe it in: llmcli run --image - \"What is this?\" < photo.png")
            images.append(decode_image(stream.buffer.read(MAX_IMAGE_BYTES + 1), "stdin"))
        else:
            images.append(read_image(name))
    return tuple(images)


# A path a terminal pastes when an image file is dropped on it: quoted ('…', "…"), or with backslash-escaped spaces.
_DROPPED = re.compile(r"""(?:'([^'\n]+\.(?:png|jpe?g|gif|webp|bmp))'|"([^"\n]+\.(?:png|jpe?g|gif|webp|bmp))"|"""
                      r"""((?:[^\s'"\\]|\\.)+\.(?:png|jpe?g|gif|webp|bmp)))(?=\s|$)""", re.IGNORECASE)


def dropped_images(text: str) -> tuple[str, list[str]]:
    """Image files named in a chat message (dropped on the terminal, as Ollama reads them): the message without
    them, and their paths. Only names of files that exist count: other text stays as typed."""
    paths: list[str] = []

    def take(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or re.sub(r"\\(.)", r"\1", match.group(3))
        if not Path(name).expanduser().is_file():
            return match.group(0)
        paths.append(name)
        return ""

    left = _DROPPED.sub(take, text)
    return (" ".join(left.split()) if paths else text), paths
