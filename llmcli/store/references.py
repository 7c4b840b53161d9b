"""Hugging Face model references, parsed and validated before anything touches the network or a path.

    [hf.co/]OWNER/REPO[:QUANT][@REVISION]        pick a quant (Q4_K_M if present, see QUANT_PREFERENCE)
    [hf.co/]OWNER/REPO/PATH/FILE.gguf[@REVISION] one file

Every part that later becomes part of a path (owner, repo, file, revision) is checked here:
no `..`, no absolute paths, no backslashes or NUL, bounded lengths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmcli.errors import UsageError

HOST_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/", "hf://")

# When a repository holds several quants and none was asked for: the first present wins.
QUANT_PREFERENCE = (
    "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q4_0", "IQ4_XS", "IQ4_NL", "Q6_K", "Q8_0", "Q4_1",
    "Q5_0", "Q5_1", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "BF16", "F16", "F32",
)

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_REVISION = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")
_QUANT_IN_NAME = re.compile(r"(?:^|[-_.])(I?Q[1-8](?:_[0-9A-Z]+)*|BF16|F16|F32)(?=[-_.]|$)", re.IGNORECASE)
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubReference:
    repo_id: str  # owner/repo
    filename: str | None = None  # a path inside the repo, or None to choose by quant
    quant: str | None = None  # upper case, e.g. Q4_K_M
    revision: str | None = None  # branch, tag or commit; None = main

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "") + (f":{self.quant}" if self.quant else "")
        return text + (f"@{self.revision}" if self.revision else "")


def looks_like_hub(reference: str) -> bool:
    body = _strip_host(reference)
    return body.count("/") >= 1 and not reference.startswith(("/", ".", "~"))


def _strip_host(reference: str) -> str:
    for prefix in HOST_PREFIXES:
        if reference.lower().startswith(prefix):
            return reference[len(prefix):]
    return reference


def parse(reference: str) -> HubReference:
    """Parse and validate a Hub reference; UsageError on anything malformed or unsafe."""
    if "\0" in reference or "\\" in reference or len(reference) > 1024:
        raise UsageError(f"invalid model reference {reference[:80]!r}: control characters, backslashes or too long")
    body = _strip_host(reference.strip())
    revision = None
    if "@" in body:
        body, revision = body.rsplit("@", 1)
        if not _REVISION.match(revision) or ".." in revision.split("/") or revision.startswith("/"):
            raise UsageError(f"invalid revision {revision!r} in {reference!r}")
    quant = None
    if ":" in body:
        body, quant = body.rsplit(":", 1)
        if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", quant):
            raise UsageError(f"invalid quant {quant!r} in {reference!r}", hint="e.g. owner/repo:Q4_K_M")
        quant = quant.upper()
    parts = body.split("/")
    if len(parts) < 2:
        raise UsageError(f"invalid model reference {reference!r}",
                         hint="Use OWNER/REPO, OWNER/REPO:QUANT or OWNER/REPO/FILE.gguf.")
    owner, repo, path = parts[0], parts[1], parts[2:]
    for name, what in ((owner, "owner"), (repo, "repository name")):
        if not _NAME.match(name) or ".." in name or "--" in name:
            raise UsageError(f"invalid {what} {name!r} in {reference!r}")
    filename = None
    if path:
        filename = "/".join(path)
        check_filename(filename)
        if quant:
            raise UsageError(f"{reference!r} names a file and a quant; give one of them")
    return HubReference(f"{owner}/{repo}", filename, quant, revision)


def check_filename(filename: str) -> None:
    """A file path inside a repo that is safe to join under the cache: relative, no `..`, bounded."""
    segments = filename.split("/")
    if (
        not filename
        or filename.startswith("/")
        or any(s in ("", ".", "..") or len(s) > 255 for s in segments)
        or "\0" in filename
        or "\\" in filename
        or ":" in segments[0]
        or len(filename) > 1024
    ):
        raise UsageError(f"unsafe file name {filename[:120]!r} in a model reference or repository listing")
    if not filename.lower().endswith(".gguf"):
        raise UsageError(f"{filename!r} is not a .gguf file")


def quant_of(filename: str) -> str | None:
    """The quant label in a GGUF file name (`…-Q4_K_M.gguf` -> Q4_K_M), if any."""
    stem = filename.rsplit("/", 1)[-1]
    stem = _SHARD.sub(".gguf", stem)[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    found = _QUANT_IN_NAME.findall(stem)
    return found[-1].upper() if found else None


def shard_info(filename: str) -> tuple[int, int] | None:
    """(index, count) for `name-00001-of-00003.gguf`, else None."""
    match = _SHARD.search(filename)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Choice:
    """One loadable model in a repository: a single file, or all shards of a split file (first one first)."""

    files: tuple[str, ...]
    quant: str | None

    @property
    def first(self) -> str:
        return self.files[0]


def choices(filenames: list[str]) -> list[Choice]:
    """Group a repository's .gguf files into loadable models; projector files (mmproj) are left out."""
    groups: dict[str, list[str]] = {}
    for name in filenames:
        base = name.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or base.startswith("mmproj") or "mmproj" in base:
            continue
        shard = shard_info(name)
        key = _SHARD.sub("", name) if shard else name
        groups.setdefault(key, []).append(name)
    result = []
    for files in groups.values():
        files.sort()
        shards = [info for info in map(shard_info, files) if info]
        if shards and len(shards) != shards[0][1]:
            continue  # an incomplete set of shards cannot be loaded
        result.append(Choice(tuple(files), quant_of(files[0])))
    return sorted(result, key=lambda c: c.first)


PROJECTOR_PREFERENCE = ("F16", "BF16", "Q8_0", "F32")  # llama.cpp publishes f16 projectors: quantized ones see worse


def projector_file(filenames: list[str], model: Choice) -> str | None:
    """The vision projector (mmproj) published with `model` in its repository, fetched beside it: of several, the
    one in the model's folder, then by PROJECTOR_PREFERENCE."""
    folder = model.first.rsplit("/", 1)[0] if "/" in model.first else ""
    found = [name for name in filenames if "mmproj" in name.rsplit("/", 1)[-1].lower() and name.lower().endswith(".gguf")
             and (name.rsplit("/", 1)[0] if "/" in name else "") == folder]
    ranked = sorted(found, key=lambda name: (PROJECTOR_PREFERENCE.index(quant_of(name) or "")
                                            if quant_of(name) in PROJECTOR_PREFERENCE else len(PROJECTOR_PREFERENCE), name))
    return ranked[0] if ranked else None


def select(available: list[Choice], quant: str | None, repo_id: str) -> Choice:
    """The file(s) to fetch: the quant asked for, else by QUANT_PREFERENCE; ambiguity lists the choices."""
    if not available:
        raise LookupError(f"{repo_id} has no .gguf model files")
    listing = ", ".join(sorted({c.quant or c.first for c in available}))
    if quant is not None:
        matching = [c for c in available if c.quant == quant]
        if not matching:
            raise LookupError(f"{repo_id} has no {quant} file; available: {listing}")
        if len(matching) > 1:
            names = ", ".join(c.first for c in matching)
            raise LookupError(f"{repo_id} has several {quant} files: {names}; name one with OWNER/REPO/FILE.gguf")
        return matching[0]
    if len(available) == 1:
        return available[0]
    for preferred in QUANT_PREFERENCE:
        matching = [c for c in available if c.quant == preferred]
        if len(matching) == 1:
            return matching[0]
    raise LookupError(f"{repo_id} holds several models; choose one with OWNER/REPO:QUANT ({listing})")
