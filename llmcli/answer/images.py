"""An image in a prompt, as plain data: its pixels (RGB, already decoded and bounded by llmcli/answer/image_bytes.py),
the key its content gives it, and the token ids that stand for it in a prompt's token list.

A prompt with images is still one list of token ids: each image is a run of negative ids (a vocabulary has none)
derived from its content key and each position in the run, so the KV prefix cache, the prompt store and a server's
slots reuse an image's cells exactly when the same picture sits at the same place — and never another picture's.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

MARKER = "<__media__>"  # where an image sits in a message's text (llama.cpp's own media marker)
MAX_IMAGES = 16  # images in one prompt: each is encoded and takes context; more is a request to refuse


@dataclass(frozen=True)
class ImageInput:
    """One picture, decoded: `width` × `height` RGB pixels, row by row (`rgb`); `source` names it for messages;
    `encoded` is the file as it came (`mime`), what a client sends on to a server."""

    width: int
    height: int
    rgb: bytes = field(repr=False)
    source: str = "image"
    encoded: bytes = field(default=b"", repr=False)
    mime: str = "image/png"
    key: str = field(init=False, repr=False)  # sha256 of the size and the pixels: the same picture, the same key

    def __post_init__(self) -> None:
        digest = hashlib.sha256(f"{self.width}x{self.height}:".encode())
        digest.update(self.rgb)
        object.__setattr__(self, "key", digest.hexdigest())

    def data_uri(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.encoded).decode()}"


def placeholder_ids(key: str, n_tokens: int) -> list[int]:
    """The token ids that stand for an image of `n_tokens` embeddings with content key `key`: negative, one per
    position (a different picture matches none of them but by a 2^-31 chance per position)."""
    seed = bytes.fromhex(key)
    return [-1 - int.from_bytes(hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=4).digest(), "little") % (1 << 31)
            for i in range(n_tokens)]


def has_images(tokens: Sequence[int]) -> bool:
    return any(token < 0 for token in tokens)


def text_before_image(tokens: Sequence[int], start: int, end: int) -> int:
    """Where the text of tokens[start:end] stops: `end`, or the first image token at or after `start`."""
    for position in range(start, end):
        if tokens[position] < 0:
            return position
    return end


def image_start(tokens: Sequence[int], position: int) -> int:
    """`position`, moved back to the first token of the image it falls inside (a cached prefix never ends inside an
    image: an image is evaluated whole)."""
    while 0 < position < len(tokens) and tokens[position] < 0 and tokens[position - 1] < 0:
        position -= 1
    return position


def with_markers(text: str, n_images: int) -> str:
    """A user message's text with its images first (as Ollama and llama.cpp place attached images); markers the
    user typed stay text."""
    return MARKER * n_images + ("\n" if n_images and text else "") + text.replace(MARKER, "<__media _>")


def described(text: str, images: Sequence[ImageInput]) -> str:
    """A message's text for records and screens: each image's marker as `[image: NAME]`."""
    for image in images:
        text = text.replace(MARKER, f"[image: {image.source}]", 1)
    return text
