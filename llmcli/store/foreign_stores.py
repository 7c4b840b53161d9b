"""GGUF files other tools already keep: Ollama's store, LM Studio's models folder and the standard Hugging Face
cache. Used in place, without a copy, and read-only: nothing is ever written into another tool's store (what
llmcli remembers about their files, e.g. a verified sha256, lives in llmcli's own data dir).

    ollama:NAME[:TAG]      manifests/registry.ollama.ai/library/NAME/TAG (TAG `latest` by default; NAME may be
                           NAMESPACE/NAME or HOST/NAMESPACE/NAME) -> its model layer, blobs/sha256-HEX
    lmstudio:PATH          a file or folder under LM Studio's models folder (PUBLISHER/REPO[/FILE.gguf])
    OWNER/REPO[:QUANT]     also found in the standard Hugging Face cache, when llmcli's own cache lacks it

A blob named by its sha256 is checked against it before llama.cpp reads it (once per file version; the
result is remembered in llmcli's hash memo). Ollama's params and system layers become the model's defaults
where they translate to llmcli settings; its Go chat template does not (the GGUF's own template is used).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.errors import IntegrityError, ModelNotFoundError, UsageError
from llmcli.store.file_hashes import remembered_sha256
from llmcli.store.references import HubReference, choices, select

OLLAMA_PREFIX, LMSTUDIO_PREFIX = "ollama:", "lmstudio:"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
_MODEL_LAYER = "application/vnd.ollama.image.model"
_LAYER = "application/vnd.ollama.image."
_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
MAX_MANIFEST_BYTES = 1 << 20

# Ollama's parameter names -> llmcli settings (the rest are reported as ignored).
OLLAMA_PARAMS = {
    "temperature": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta", "seed": "seed", "num_predict": "max_tokens", "stop": "stop", "num_ctx": "ctx_size",
    "num_thread": "threads", "num_batch": "batch_size", "use_mmap": "mmap", "use_mlock": "mlock",
}


@dataclass(frozen=True)
class FoundModel:
    """A GGUF in another tool's store."""

    name: str  # the reference that names it (`ollama:qwen3:8b`)
    path: Path
    source: str  # `ollama:<manifest>`, `lmstudio:<folder>`, `hf-cache:<repo>@<commit>`
    sha256: str | None = None  # what the file must hash to (its blob name), if the store says
    size: int | None = None  # what the store says its size is
    defaults: dict[str, Any] = field(default_factory=dict)  # settings the store keeps for it (Ollama's params)
    ignored: tuple[str, ...] = ()  # what the store keeps that llmcli does not use
    projector: Path | None = None  # its vision projector (Ollama's projector layer; an mmproj file beside it)

    def checked(self) -> FoundModel:
        """The file exists, has the recorded size and (once per file version) the sha256 its name promises."""
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.name}: its model file {self.path} is missing",
                                     hint="The other tool's store is incomplete: pull the model again with that tool.")
        if self.size is not None and self.path.stat().st_size != self.size:
            raise IntegrityError(f"{self.name}: {self.path} has {self.path.stat().st_size} bytes; its manifest says "
                                 f"{self.size}", hint="The file is damaged or was replaced: pull it again with that tool.")
        if self.sha256 is not None and remembered_sha256(self.path) != self.sha256:
            raise IntegrityError(f"{self.name}: {self.path} does not match its sha256 name",
                                 hint="The file is damaged: pull it again with the tool that owns it (llmcli never "
                                 "changes another tool's files).")
        projector = self.projector
        if projector is not None and projector.parent.name == "blobs" and (
                remembered_sha256(projector) != projector.name.removeprefix("sha256-")):
            raise IntegrityError(f"{self.name}: its projector {projector} does not match its sha256 name",
                                 hint="The file is damaged: pull it again with the tool that owns it.")
        return self


def is_foreign(reference: str) -> bool:
    return reference.lower().startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX))


def resolve(reference: str) -> FoundModel:
    """`ollama:…` or `lmstudio:…` -> the checked file."""
    if reference.lower().startswith(OLLAMA_PREFIX):
        return ollama_model(reference[len(OLLAMA_PREFIX):]).checked()
    return lmstudio_model(reference[len(LMSTUDIO_PREFIX):]).checked()


# -- Ollama -------------------------------------------------------------------------------------------------


def parse_ollama(name: str) -> tuple[str, str, str, str]:
    """`NAME[:TAG]` -> (host, namespace, model, tag), each part checked before it becomes a path."""
    body, _, tag = name.partition(":")
    tag = tag or "latest"
    parts = body.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) and ".." not in p for p in [*parts, tag]):
        raise UsageError(f"invalid Ollama model name {name!r}", hint="ollama:NAME[:TAG], e.g. ollama:qwen3:8b")
    host, namespace = OLLAMA_REGISTRY, OLLAMA_NAMESPACE
    if len(parts) == 3:
        host, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return host, namespace, parts[-1], tag


def ollama_model(name: str) -> FoundModel:
    host, namespace, model, tag = parse_ollama(name)
    root = paths.ollama_models_dir()
    manifest_path = root / "manifests" / host / namespace / model / tag
    label = f"ollama:{name if ':' in name else name + ':latest'}"
    if not manifest_path.is_file():
        raise ModelNotFoundError(f"{label} is not in Ollama's store ({root})",
                                 hint="`llmcli list --all` shows the models found there; `ollama pull` fetches one.")
    layers = _manifest_layers(manifest_path, label)
    model_layers = [layer for layer in layers if layer.get("mediaType") == _MODEL_LAYER]
    if len(model_layers) != 1:
        raise ModelNotFoundError(f"{label}: its manifest has {len(model_layers)} model layers; llmcli loads one GGUF")
    digest, size = _digest(model_layers[0], label), model_layers[0].get("size")
    defaults, ignored = _ollama_extras(root, layers, label)
    projectors = [layer for layer in layers if layer.get("mediaType") == _PROJECTOR_LAYER]
    projector = root / "blobs" / f"sha256-{_digest(projectors[0], label)}" if projectors else None
    return FoundModel(label, root / "blobs" / f"sha256-{digest}", f"ollama:{manifest_path.relative_to(root)}", digest,
                      size if isinstance(size, int) else None, defaults, ignored, projector)


def _manifest_layers(path: Path, label: str) -> list[dict[str, Any]]:
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ValueError("too large")
        data = json.loads(path.read_text(encoding="utf-8"))
        layers = data["layers"]
        if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
            raise ValueError("layers is not a list of objects")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{label}: its manifest {path} is not readable: {exc}") from None
    return layers


def _digest(layer: dict[str, Any], label: str) -> str:
    match = _DIGEST.match(str(layer.get("digest", "")))
    if match is None:
        raise IntegrityError(f"{label}: a layer digest {layer.get('digest')!r} is not sha256:HEX")
    return match.group(1)


def _ollama_extras(root: Path, layers: list[dict[str, Any]], label: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The settings Ollama keeps for the model (params and system layers), and what does not translate."""
    from llmcli.config.setting_values import coerce
    from llmcli.config.settings import SETTINGS

    defaults: dict[str, Any] = {}
    ignored: list[str] = []
    for layer in layers:
        kind = str(layer.get("mediaType", "")).removeprefix(_LAYER)
        if kind in ("model", "license", "projector"):
            continue
        blob = root / "blobs" / f"sha256-{_digest(layer, label)}"
        if kind not in ("params", "system"):
            ignored.append("its Go chat template (the GGUF's own template is used)" if kind == "template" else kind)
            continue
        try:
            text = blob.read_text(encoding="utf-8")[:MAX_MANIFEST_BYTES]
        except (OSError, UnicodeDecodeError):
            ignored.append(f"{kind} (its blob is unreadable)")
            continue
        if kind == "system":
            defaults["system"] = text
            continue
        try:
            params = json.loads(text)
        except ValueError:
            ignored.append("params (not JSON)")
            continue
        for key, value in params.items() if isinstance(params, dict) else ():
            setting = OLLAMA_PARAMS.get(key)
            try:
                if setting is None:
                    raise UsageError(key)
                defaults[setting] = coerce(SETTINGS[setting], value, key)
            except UsageError:
                ignored.append(f"parameter {key}")
    return defaults, tuple(ignored)


def ollama_models() -> Iterator[FoundModel]:
    """Every model in Ollama's store (unchecked: listing hashes nothing)."""
    root = paths.ollama_models_dir() / "manifests"
    for manifest in sorted(root.glob("*/*/*/*")) if root.is_dir() else []:
        host, namespace, model, tag = manifest.relative_to(root).parts
        name = model if (host, namespace) == (OLLAMA_REGISTRY, OLLAMA_NAMESPACE) else (
            f"{namespace}/{model}" if host == OLLAMA_REGISTRY else f"{host}/{namespace}/{model}")
        try:
            yield ollama_model(f"{name}:{tag}")
        except (ModelNotFoundError, IntegrityError, UsageError):
            continue


# -- LM Studio -----------------------------------------------------------------------------------------------


def lmstudio_models_dir() -> Path:
    """LM Studio's models folder: the one its settings name (`downloadsFolder`), else ~/.lmstudio/models, else the
    older ~/.cache/lm-studio/models."""
    home = paths.lmstudio_home()
    try:
        settings = json.loads((home / "settings.json").read_text(encoding="utf-8"))
        moved = settings.get("downloadsFolder") if isinstance(settings, dict) else None
        if isinstance(moved, str) and moved:
            return Path(moved).expanduser()
    except (OSError, ValueError):
        pass
    default = home / "models"
    older = Path.home() / ".cache" / "lm-studio" / "models"
    return default if default.is_dir() or not older.is_dir() else older


def lmstudio_model(path: str) -> FoundModel:
    """`PUBLISHER/REPO/FILE.gguf`, or `PUBLISHER/REPO[:QUANT]` (one model file in that folder, by quant)."""
    body, _, quant = path.partition(":") if not path.lower().endswith(".gguf") else (path, "", "")
    parts = body.strip("/").split("/")
    if not body or not all(part and part not in (".", "..") and "\\" not in part and "\0" not in part for part in parts):
        raise UsageError(f"invalid LM Studio model path {path!r}", hint="lmstudio:PUBLISHER/REPO[/FILE.gguf]")
    root = lmstudio_models_dir()
    target = root.joinpath(*parts)  # no part is `..` or absolute: it names something inside the folder (a link
    # there may point elsewhere: LM Studio's "import" links models in)
    if target.is_dir():
        names = sorted(str(p.relative_to(target)) for p in target.rglob("*.gguf") if p.is_file())
        try:
            choice = select(choices(names), quant.upper() or None, f"lmstudio:{body}")
        except LookupError as exc:
            raise ModelNotFoundError(str(exc), hint="Name a file (lmstudio:PUBLISHER/REPO/FILE.gguf) or a quant.") from None
        target = target / choice.first
    elif not target.is_file():
        raise ModelNotFoundError(f"lmstudio:{path} is not in LM Studio's models folder ({root})",
                                 hint="`llmcli list --all` shows the models found there.")
    return FoundModel(f"lmstudio:{target.relative_to(root)}", target, f"lmstudio:{target.parent.relative_to(root)}")


def lmstudio_models() -> Iterator[FoundModel]:
    root = lmstudio_models_dir()
    for found in sorted(root.rglob("*.gguf")) if root.is_dir() else []:
        if found.is_file() and "mmproj" not in found.name.lower():
            yield FoundModel(f"lmstudio:{found.relative_to(root)}", found, f"lmstudio:{found.parent.relative_to(root)}")


# -- the standard Hugging Face cache -------------------------------------------------------------------------


def hf_cache_model(reference: HubReference) -> FoundModel | None:
    """`reference` in the standard Hugging Face cache (when it is not llmcli's own), checked; else None."""
    from llmcli.store.cache import from_cache

    root = paths.standard_hf_cache()
    if not root.is_dir() or root.resolve() == paths.hub_cache().resolve():
        return None
    fetched = from_cache(reference, root)
    if fetched is None or len(fetched.paths) != 1:
        return None  # split models are left to llmcli's own cache
    path = fetched.paths[0]
    blob = path.resolve().name
    name = f"{reference.repo_id}:{fetched.quant}" if fetched.quant else f"{reference.repo_id}/{path.name}"
    return FoundModel(name, path, f"hf-cache:{reference.repo_id}@{(fetched.commit or '')[:12]}",
                      blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None).checked()


def hf_cache_models() -> Iterator[FoundModel]:
    from llmcli.store.cache import gguf_names, repo_dirs

    root = paths.standard_hf_cache()
    if not root.is_dir() or root.resolve() == paths.hub_cache().resolve():
        return
    for repo_id, folder in repo_dirs(root):
        for snapshot in sorted((folder / "snapshots").glob("*")):
            for choice in choices(gguf_names(snapshot)):
                if len(choice.files) == 1:
                    name = f"{repo_id}:{choice.quant}" if choice.quant else f"{repo_id}/{choice.first}"
                    yield FoundModel(name, snapshot / choice.first, f"hf-cache:{repo_id}@{snapshot.name[:12]}")


def all_models() -> list[FoundModel]:
    """What the other tools' stores hold, for `llmcli list --all`."""
    return [*ollama_models(), *lmstudio_models(), *hf_cache_models()]
