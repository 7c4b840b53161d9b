"""Images as a prompt takes them: bytes (a file's, a data URI's, base64) decoded by Pillow — the only importer, and
only when an image is given — into bounded RGB pixels, and every bad image refused with one line before anything is
decoded without bounds.

What is refused: not an image (or a format other than PNG, JPEG, GIF, WebP, BMP), a truncated or damaged file, more
than MAX_PIXELS pixels (the header is read before any pixel: a decompression bomb is never decoded), an animated image
(which frame would be meant?), more than MAX_IMAGE_BYTES. Modes are converted (CMYK, greyscale, palette, alpha on white)
and a large picture is scaled down to at most `max_side` on its longer side: the projector resizes to its own size
anyway, and a smaller bitmap is faster to hash, send and preprocess.

Memory: decoding takes width × height × 3 bytes and more for a moment (a 7000 × 7000 PNG of 1 MB: ~150 MB), so the
pixels being decoded at once in one process — every request's, a server's threads together — are bounded by
MAX_DECODING_PIXELS (the others wait for room), and what a large decode took is handed back to the system after it.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.answer.images import ImageInput
from llmcli.errors import UsageError
from llmcli.units import human_size

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image file or a request's image: larger is refused before it is read whole
MAX_PIXELS = 50_000_000  # width × height read from the header: more is refused before any pixel is decoded
DEFAULT_MAX_SIDE = 1536  # pixels on the longer side after scaling down (the projectors here see 224–896)
MAX_DECODING_PIXELS = MAX_PIXELS  # decoded at once in one process: one picture of the largest size, or several
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS  # a server's request, its pictures together (`REQUEST_PIXELS`, set by serve)
# smaller ones (four concurrent 7000 x 7000 PNGs peaked a server at +1.3 GB, at +0.9 GB with two at once, under 0.75
# GB with this); the others wait for room
DECODE_WAIT_S = 120.0  # how long an image waits for room to be decoded before it is refused (busy)
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp", "BMP": "image/bmp"}


class ImageError(UsageError):
    """An image that cannot be used: the one-line reason (the servers answer it as their protocol's 400)."""


def decode_image(data: bytes, source: str, max_side: int = DEFAULT_MAX_SIDE) -> ImageInput:
    """`data` (an image file's bytes) as RGB pixels, checked and bounded; ImageError says why not."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{source}: {human_size(len(data))} is more than an image may be ({human_size(MAX_IMAGE_BYTES)})")
    if not data:
        raise ImageError(f"{source}: empty, not an image")
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # Pillow's own guard, at this bound (an error past it, not a warning)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            picture = Image.open(io.BytesIO(data), formats=list(FORMATS))
            width, height = picture.size
            if width * height > MAX_PIXELS or width < 1 or height < 1:
                raise ImageError(f"{source}: {width} × {height} pixels is more than an image may have "
                                 f"({MAX_PIXELS:,} pixels)")
            if (allowance := REQUEST_PIXELS.get()) is not None:  # (from the header: before any pixel is decoded)
                allowance.take(width * height, source)
            frames = int(getattr(picture, "n_frames", 1))
            if frames > 1:
                raise ImageError(f"{source}: an animated image ({frames} frames): give one frame as a still image")
            if allowance is not None and allowance.headers_only:  # (the request's first reading: no pixel decoded)
                picture.close()
                return ImageInput(width, height, b"", source, b"", FORMATS[str(picture.format)])
            with DECODING.room(width * height, source):
                picture.load()
                rgb = _as_rgb(picture)
                if max(rgb.size) > max_side:
                    rgb.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
                size, pixels, kind = rgb.size, rgb.tobytes(), FORMATS[str(picture.format)]
                rgb.close()
                picture.close()
                del rgb, picture  # (the full-size pixels: gone before the memory is trimmed)
            if width * height > LARGE_PIXELS:
                _give_back_memory()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # (Pillow's check, from the header alone)
        raise ImageError(f"{source}: more than {MAX_PIXELS:,} pixels, more than an image may have") from None
    except UnidentifiedImageError:
        raise ImageError(f"{source}: not an image llmcli reads (PNG, JPEG, GIF, WebP or BMP)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # Pillow's truncated and damaged files
        raise ImageError(f"{source}: a damaged or truncated image ({str(exc) or type(exc).__name__})") from None
    return ImageInput(size[0], size[1], pixels, source, data, kind)


LARGE_PIXELS = 4_000_000  # a decode this large hands its memory back to the system after it


class PixelBudget:
    """The pixels being decoded at once in this process, at most `capacity`: a decode waits for room."""

    def __init__(self, capacity: int):
        self.capacity, self.free = capacity, capacity
        self._changed = threading.Condition()

    @contextmanager
    def room(self, pixels: int, source: str) -> Iterator[None]:
        with self._changed:
            if not self._changed.wait_for(lambda: self.free >= pixels, DECODE_WAIT_S):
                raise ImageError(f"{source}: other images take the room to decode it ({self.capacity:,} pixels at "
                                 "once); try again")
            self.free -= pixels
        try:
            yield
        finally:
            with self._changed:
                self.free += pixels
                self._changed.notify_all()


DECODING = PixelBudget(MAX_DECODING_PIXELS)


class PixelAllowance:
    """The pixels one request's pictures may hold together, read from each header before it is decoded. A server reads
    a request twice when it holds pictures: `headers_only` first (each picture's header checked, its allowance taken,
    nothing decoded: `seen` counts them), then, when they all fit, for real — so a request past its allowance is refused
    before any of its pictures is decoded, not after the ones that came first."""

    def __init__(self, limit: int = MAX_REQUEST_PIXELS, headers_only: bool = False):
        self.limit, self.left, self.headers_only, self.seen = limit, limit, headers_only, 0

    def take(self, pixels: int, source: str) -> None:
        if pixels > self.left:
            raise ImageError(f"{source}: the request's pictures would hold more than {self.limit:,} pixels in all; "
                             "send fewer or smaller ones")
        self.left -= pixels
        self.seen += 1


# The allowance of the request being read in this context (a server sets one per request; run and chat set none).
REQUEST_PIXELS: ContextVar[PixelAllowance | None] = ContextVar("llmcli_request_pixels", default=None)


def _give_back_memory() -> None:
    """glibc keeps a large decode's freed pages in its arenas (a server's RSS stayed at 3.7 GB): trim them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass


def _as_rgb(picture: PILImage) -> PILImage:
    """RGB pixels: transparency over white, CMYK and palettes converted."""
    from PIL import Image

    if picture.mode in ("RGBA", "LA", "PA") or (picture.mode == "P" and "transparency" in picture.info):
        rgba = picture.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return picture.convert("RGB")


def decode_data(text: str, source: str) -> ImageInput:
    """An image sent in a request: a `data:image/...;base64,` URI or bare base64 (Ollama's `images`, Anthropic's
    `source.data`)."""
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64"):
            raise ImageError(f"{source}: a data URI must be base64 (data:image/png;base64,...)")
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{source}: more than an image may be ({human_size(MAX_IMAGE_BYTES)})")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{source}: not valid base64") from None
    return decode_image(data, source)


def read_image(reference: str) -> ImageInput:
    """An image named by a file path or given as a data URI (a --batch record's `images`), read within
    MAX_IMAGE_BYTES and decoded."""
    if reference.startswith("data:"):
        return decode_data(reference, "a data URI")
    path = Path(reference).expanduser()
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"cannot read the image {reference}: {exc.strerror or exc}") from None
    return decode_image(data, path.name)
