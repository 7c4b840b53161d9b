"""What models are here and what is inside them: `list`, `show` and `rm` without loading any weights."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.config.install_hint import install_hint
from llmcli.errors import IntegrityError, ModelNotFoundError, UsageError
from llmcli.store import cache, models
from llmcli.store.cache import CachedModel, Fetch
from llmcli.store.file_hashes import sha256_of
from llmcli.store.gguf_header import GGUFHeader, read_header, string_items
from llmcli.store.packages import PACKAGE_EXTRAS, PackagedModel, packaged_models
from llmcli.store.projector import check_projector, projector_beside, read_projector
from llmcli.store.references import choices, looks_like_hub, parse


@dataclass(frozen=True)
class Entry:
    name: str
    path: Path
    source: str  # package:<dist> or hf:<repo>@<commit>
    size: int
    header: GGUFHeader | None  # None when the file failed its pre-flight check
    problem: str | None = None
    params: int | None = None  # all shards of a split model; else the header's count
    projector: Path | None = None  # its vision projector, found with it: the model sees images

    def to_dict(self) -> dict[str, Any]:
        h = self.header
        return {
            "name": self.name,
            "path": str(self.path),
            "source": self.source,
            "size": self.size,
            "quant": h.quant if h else None,
            "params": self.params or (h.n_params if h else None),
            "architecture": h.architecture if h else None,
            "context_length": h.context_length if h else None,
            "projector": str(self.projector) if self.projector else None,
            "problem": self.problem,
        }


NOT_ASSEMBLED = "not assembled yet: built from its packages on first use"


def _entry(name: str, path: Path, source: str, size: int | None = None, projector: Path | None = None) -> Entry:
    try:
        header = read_header(path)
        return Entry(name, path, source, size if size is not None else header.file_size, header,
                     projector=projector or projector_beside(path))
    except (IntegrityError, OSError) as exc:
        return Entry(name, path, source, size or 0, None, getattr(exc, "message", str(exc)))


def entries(everywhere: bool = False) -> list[Entry]:
    """Installed-package models, then models in the Hub cache; `everywhere`: then the GGUFs other tools keep
    (Ollama, LM Studio, the standard Hugging Face cache), usable in place."""
    found = []
    from llmcli.store import hub  # the cache scan is huggingface_hub's

    for model in packaged_models():
        if model.assemble_with is not None and not model.path.is_file():
            found.append(Entry(model.short_name, model.path, f"package:{model.distribution}", 0, None, NOT_ASSEMBLED))
            continue
        found.append(_entry(model.short_name, model.path, f"package:{model.distribution}"))
    for cached in hub.cached_models():
        entry = _entry(cached.name, cached.files[0], f"hf:{cached.repo_id}@{cached.revision[:12]}", cached.size)
        if len(cached.files) > 1 and entry.header is not None:
            try:
                total = sum(read_header(path).n_params for path in cached.files)
            except (IntegrityError, OSError):
                total = None
            entry = Entry(entry.name, entry.path, entry.source, entry.size, entry.header, entry.problem, total,
                          entry.projector)
        found.append(entry)
    from llmcli.store import quantized

    found += [_entry(reference, path, "quantize") for reference, path in quantized.made()]
    if everywhere:
        from llmcli.store import foreign_stores

        found += [_entry(model.name, model.path, model.source, projector=model.projector)
                  for model in foreign_stores.all_models()]
    return found


def local_model(reference: str, aliases: dict[str, str] | None = None) -> models.ResolvedModel:
    """Resolve without any network request: a path, a packaged model, or something in the cache."""
    try:
        return models.resolve(reference, aliases, Fetch(cached_only=True))
    except ModelNotFoundError as exc:
        from llmcli.store import quantized

        if quantized.parse(reference) is not None:  # (made here, never downloaded: its own hint says how)
            raise
        hint = f"`llmcli pull {reference}` downloads it; `llmcli list` shows what is here."
        raise ModelNotFoundError(exc.message, hint=hint) from None


def describe(model: models.ResolvedModel) -> dict[str, Any]:
    header = read_header(model.path)
    arch = header.architecture
    meta = header.metadata
    special = {}
    ids = {kind: meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("bos", "eos", "eot", "padding", "unknown")}
    texts = string_items(header, "tokenizer.ggml.tokens", {i for i in ids.values() if isinstance(i, int)})
    for kind, token_id in ids.items():
        if isinstance(token_id, int):
            special[kind] = {"id": token_id, "text": texts.get(token_id)}
    vocab = meta.get("tokenizer.ggml.tokens")
    return {
        "name": model.name,
        "path": str(model.path),
        "source": model.source,
        "file_size": header.file_size,
        "gguf_version": header.version,
        "architecture": arch,
        "model_name": header.name,
        "parameters": header.n_params,
        "quant": header.quant,
        "context_length": header.context_length,
        "embedding_length": meta.get(f"{arch}.embedding_length"),
        "layers": meta.get(f"{arch}.block_count"),
        "heads": meta.get(f"{arch}.attention.head_count"),
        "kv_heads": meta.get(f"{arch}.attention.head_count_kv"),
        "vocab_size": getattr(vocab, "length", len(vocab) if isinstance(vocab, list) else None),
        "tokenizer": meta.get("tokenizer.ggml.model"),
        "special_tokens": special,
        "license": meta.get("general.license"),
        "chat_template": header.chat_template,
        "tensors": len(header.tensors),
        "vision": _vision(model.projector, header),
    }


def _vision(path: Path | None, model: GGUFHeader) -> dict[str, Any] | None:
    """What `show` says of the projector found with a model (None: it reads text only)."""
    if path is None:
        return None
    try:
        projector = read_projector(path)
        check_projector(projector, model)
        problem = None
    except (IntegrityError, OSError) as exc:
        return {"projector": str(path), "problem": getattr(exc, "message", str(exc))}
    return {"projector": str(path), "type": projector.kind, "image_size": projector.image_size,
            "sees": projector.sees, "problem": problem}


def assembled_copy(reference: str) -> Path | None:
    """The copy a chunk-packaged model was assembled into, if `reference` names one (it can be removed:
    the packages stay and build it again on next use)."""
    for model in packaged_models():
        if model.matches(reference) and model.assemble_with is not None:
            return model.path
    return None


def removable(reference: str, aliases: dict[str, str] | None = None) -> list[CachedModel]:
    """The cached models `reference` names: OWNER/REPO (all of it), OWNER/REPO:QUANT or …/FILE.gguf."""
    from llmcli.store import foreign_stores

    if foreign_stores.is_foreign(reference):
        tool = reference.split(":", 1)[0]
        raise UsageError(f"{reference} belongs to {'Ollama' if tool.lower() == 'ollama' else 'LM Studio'}: llmcli reads "
                         "it in place and never removes another tool's files", hint=f"Remove it with {tool} itself.")
    expanded = {**models.ALIASES, **(aliases or {})}.get(reference.lower(), reference)
    shipped = next((m for m in packaged_models() if m.matches(reference) and m.assemble_with is None), None)
    if shipped is not None:
        raise UsageError(f"{reference} is a file inside the installed package {shipped.distribution}",
                         hint=f"{sys.executable} -m pip uninstall {shipped.distribution} removes it (the pip of "
                              "the Python llmcli runs in).")
    if not looks_like_hub(expanded):
        raise UsageError(f"{reference} is not a cached model reference", hint="See `llmcli list` for names.")
    wanted = parse(expanded)
    from llmcli.store import hub

    matches = [
        m for m in hub.cached_models()
        if m.repo_id.lower() == wanted.repo_id.lower()
        and (wanted.quant is None or m.quant == wanted.quant)
        and (wanted.filename is None or any(str(f).endswith("/" + wanted.filename) for f in m.files))
        and (wanted.revision is None or wanted.revision in (m.revision, *m.refs))
    ]
    if not matches:
        raise ModelNotFoundError(f"{reference} is not in the cache", hint="See `llmcli list`.")
    return matches


def available(aliases: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(name, what it resolves to, where the name comes from) for every model name that needs no path:
    the config file's aliases, the built-in ones, and the packaged models of llmcli's extras."""
    installed = {m.short_name for m in packaged_models()}
    rows = [(name, target, "alias (config file)") for name, target in sorted((aliases or {}).items())]
    rows += [(name, f"{target} (the installed {models.PACKAGED_AS[name]} answers to it)"
              if models.PACKAGED_AS.get(name) in installed else target, "alias (built-in)")
             for name, target in sorted(models.ALIASES.items())]
    rows += [(name, "installed" if name in installed else install_hint(extra), "package")
             for name, extra in PACKAGE_EXTRAS.items()]
    return rows


def known_names(aliases: dict[str, str] | None = None) -> list[str]:
    """Every model name a user can type without a path, for shell completion: installed models,
    aliases, and what the cache holds (read from its folders, without huggingface_hub)."""
    names = [m.short_name for m in packaged_models()]
    names += sorted({**models.ALIASES, **(aliases or {})})
    for repo_id, repo_dir in cache.repo_dirs():
        files = {name for snapshot in (repo_dir / "snapshots").glob("*") for name in cache.gguf_names(snapshot)}
        names.append(repo_id)
        names += [f"{repo_id}:{c.quant}" for c in choices(sorted(files)) if c.quant]
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Verified:
    path: Path
    ok: bool
    expected: str | None
    actual: str


def verify_packaged(reference: str) -> list[Verified] | None:
    """A packaged model against what its wheel recorded (nothing is removed: pip owns the file), or
    None when `reference` names no packaged model. An assembled copy was checked when it was built."""
    model = next((m for m in packaged_models() if m.matches(reference)), None)
    return None if model is None else _verify_packaged(model)


def verify_every_packaged() -> list[Verified]:
    """`llmcli verify` with no model: every packaged one too (checked, never removed)."""
    return [result for model in packaged_models() for result in _verify_packaged(model)]


def _verify_packaged(model: PackagedModel) -> list[Verified]:
    if model.assemble_with is not None:
        if not model.path.is_file():
            return []
        return [Verified(model.path, True, None, sha256_of(model.path))]
    actual = sha256_of(model.path)
    return [Verified(model.path, model.sha256 is None or actual == model.sha256, model.sha256, actual)]


def verify(models: list[CachedModel]) -> list[Verified]:
    """Hash every file of these models against its blob's name (the LFS sha256); remove what fails."""
    results = []
    for model in models:
        for path in model.files:
            blob = path.resolve()
            expected = blob.name if re.fullmatch(r"[0-9a-f]{64}", blob.name) else None
            actual = sha256_of(path)
            ok = expected is None or actual == expected
            if not ok:
                cache.remove_file(path)
            results.append(Verified(path, ok, expected, actual))
    return results
