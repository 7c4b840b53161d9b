"""A model's vision projector (`mmproj-*.gguf`): found beside the model, read with the bounded GGUF reader and checked
against the text model before llama.cpp's CLIP loader sees it.

The check that matters most is the projection width: a projector made for another model writes embeddings of another
width into the text model, which other tools crash on; here it is a one-line error naming both widths. The counts
that size CLIP's allocations are bounded as the text model's are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from llmcli.errors import IntegrityError
from llmcli.store.gguf_header import GGUFHeader, read_header

# clip.vision.* counts that size the encoder's graph: positive and bounded.
_BOUNDED = {"image_size": 8192, "patch_size": 1024, "embedding_length": 1 << 16, "feed_forward_length": 1 << 18,
            "block_count": 512, "attention.head_count": 1024, "projection_dim": 1 << 20}
# Where each projector type's output width is, as (tensor, dimension): the truth, whatever projection_dim says.
_OUTPUT_WIDTH = {"gemma3": ("mm.input_projection.weight", 0), "mlp": ("mm.2.weight", 1),
                 "mlp_norm": ("mm.2.weight", 1), "idefics3": ("mm.model.fc.weight", 1)}
MROPE = {"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "qwen2.5o"}  # positions llmcli's slots do not count


@dataclass(frozen=True)
class Projector:
    path: Path
    kind: str  # clip.projector_type (gemma3, mlp, idefics3, ...)
    vision: bool
    audio: bool
    image_size: int | None
    width: int | None  # the embeddings it writes into the text model

    @property
    def sees(self) -> str:
        return " and ".join(part for part, has in (("images", self.vision), ("audio", self.audio)) if has) or "nothing"


def read_projector(path: Path) -> Projector:
    """The projector at `path`, checked on its own (IntegrityError says what is wrong)."""
    header = read_header(path)
    if header.architecture != "clip":
        raise IntegrityError(f"{path} is not a vision projector (its architecture is {header.architecture!r}, not 'clip')",
                             hint="--mmproj takes the mmproj-*.gguf file published with the model.")
    for key, limit in _BOUNDED.items():
        value = header.get(f"clip.vision.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit):
            raise IntegrityError(f"{path}: clip.vision.{key} = {value!r} is out of range")
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        value = header.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != 3
                                  or not all(isinstance(v, float) and math.isfinite(v) for v in value)):
            raise IntegrityError(f"{path}: {key} is not three finite numbers")
    eps = header.get("clip.vision.attention.layer_norm_epsilon")
    if eps is not None and (not isinstance(eps, float) or not math.isfinite(eps) or eps <= 0):
        raise IntegrityError(f"{path}: clip.vision.attention.layer_norm_epsilon = {eps!r} is not a usable number")
    _check_shapes(path, header)
    kind = str(header.get("clip.projector_type") or header.get("clip.vision.projector_type") or "mlp")
    vision = bool(header.get("clip.has_vision_encoder", False))
    audio = bool(header.get("clip.has_audio_encoder", False))
    size = header.get("clip.vision.image_size")
    return Projector(path, kind, vision, audio, size if isinstance(size, int) else None, _output_width(header, kind))


def _check_shapes(path: Path, header: GGUFHeader) -> None:
    """Shapes llama.cpp's CLIP encoder cannot run, refused at load: it loads them, then aborts the process on the first
    image (GGML_ASSERT). Its attention splits the width among its heads; its patches tile the image."""
    width, heads = header.get("clip.vision.embedding_length"), header.get("clip.vision.attention.head_count")
    size, patch = header.get("clip.vision.image_size"), header.get("clip.vision.patch_size")
    for what, whole, part, of in (("width", width, heads, "attention heads"), ("image size", size, patch, "patch size")):
        if isinstance(whole, int) and isinstance(part, int) and whole % part:
            raise IntegrityError(f"{path}: its {what} ({whole}) is not a multiple of its {of} ({part}): llama.cpp "
                                 "cannot run this projector", hint="The file is damaged, or not a projector llama.cpp reads.")


def _output_width(header: GGUFHeader, kind: str) -> int | None:
    where = _OUTPUT_WIDTH.get(kind)
    if where is not None:
        for tensor in header.tensors:
            if tensor.name == where[0] and len(tensor.shape) > where[1]:
                return int(tensor.shape[where[1]])
    width = header.get("clip.vision.projection_dim")
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def check_projector(projector: Projector, model: GGUFHeader) -> None:
    """Refuse a projector that cannot feed this text model: its width, its kind, whether it sees images."""
    if not projector.vision:
        raise IntegrityError(f"{projector.path.name} has no image encoder (it reads {projector.sees})",
                             hint="llmcli reads images; give the model's vision projector with --mmproj.")
    n_embd = model.get(f"{model.architecture}.embedding_length")
    if projector.width is not None and isinstance(n_embd, int) and projector.width != n_embd:
        raise IntegrityError(
            f"{projector.path.name} writes embeddings of width {projector.width}, but {model.path.name} takes "
            f"{n_embd}: this projector belongs to another model",
            hint="Use the mmproj file published with this model (--mmproj PATH).")
    if projector.kind in MROPE:
        raise IntegrityError(f"{projector.path.name} is a {projector.kind} projector (M-RoPE positions), which llmcli "
                             "does not run yet", hint="Gemma 3, SmolVLM, LLaVA-style and other projectors work.")


def projector_beside(model: Path) -> Path | None:
    """A projector published next to the model: LM Studio's folders, a Hub snapshot, a folder of one's own. Of
    several, the one that names the model, else the first by name (f16 before quantized ones: llama.cpp's advice)."""
    try:
        found = sorted(p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p.is_file())
    except OSError:
        return None
    if not found:
        return None
    stem = model.name.split(".")[0].split("-Q")[0].lower()
    named = [p for p in found if stem and stem in p.name.lower()]
    ranked = sorted(named or found, key=lambda p: ("f16" not in p.name.lower() and "bf16" not in p.name.lower(), p.name))
    return ranked[0]
