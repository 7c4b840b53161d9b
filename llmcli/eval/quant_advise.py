"""`llmcli quant advise`: which file of a model to run on this machine — speed, memory and quality measured here.

The candidates are the files of one model found here (the one named, the quants `llmcli quantize` made of it, the
same model in the Hub cache and in Ollama's and LM Studio's stores: the same architecture, parameter count and
vocabulary) plus the types `--make` asks for, made from the highest-precision file. The reference is that
highest-precision file (or `--reference`). Each candidate gets its size, its memory at the user's context (weights +
KV cache), whether it fits, prefill and decode tok/s (`bench`'s raw loop, short) and `eval quality`'s KL divergence
and top-1 agreement against the reference. The candidates no other beats on both decode speed and KL divergence form
the front; the pick is the fastest decoder within the limits (memory, `--min-decode`, `--max-kld`; of rates within 5 %
of the fastest, the closest to the reference), and why is said.
Each candidate's figures are kept (keyed by its file's sha256, the reference's pass, the machine and the measure), so an
interrupted advise resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmcli import paths
from llmcli.bench.environment import machine
from llmcli.bench.measure import quick_speed
from llmcli.errors import UsageError
from llmcli.eval import quality
from llmcli.interrupt import Cancellation
from llmcli.llama import quantize as quantizer
from llmcli.store import catalog, quantized
from llmcli.store.file_hashes import remembered_sha256
from llmcli.store.gguf_header import GGUFHeader, read_header
from llmcli.store.memory import RUNTIME_OVERHEAD, available_memory, kv_cache_bytes
from llmcli.store.models import ResolvedModel

SAME_SPEED = 0.05  # decode rates this close are one speed (a short measure's noise): the closer to the reference wins
DEFAULT_MAX_KLD = 0.05  # mean KL divergence a pick may have by default (≈ a good 4-bit quant of a small model)
PRECISION = ("F32", "BF16", "F16", *sorted(quantizer.BITS_PER_WEIGHT, key=lambda t: -quantizer.BITS_PER_WEIGHT[t]))
Progress = Callable[[str, int, int], None]  # (what, done, total) of the current step


@dataclass
class Candidate:
    reference: str  # what -m takes to run it
    path: Path
    type: str
    size_bytes: int
    origin: str
    header: GGUFHeader = field(repr=False)
    measured: dict[str, Any] = field(default_factory=dict)

    here: bool = True  # False: a file the model's Hub repository lists (its size from the listing), not downloaded
    kv_type: str = "f16"  # the KV cache's type it runs (and is measured) with

    def row(self) -> dict[str, Any]:
        name = self.reference if self.kv_type == "f16" else f"{self.reference} · kv {self.kv_type}"
        return {"name": name, "model": self.reference, "type": self.type, "kv_type": self.kv_type,
                "size_bytes": self.size_bytes, "origin": self.origin,
                "path": str(self.path) if self.here else None, "here": self.here, **self.measured}


def signature(header: GGUFHeader) -> tuple[object, ...]:
    """What makes two files the same model in other quants."""
    vocab = header.metadata.get("tokenizer.ggml.tokens")
    return header.architecture, header.n_params, getattr(vocab, "length", None)


def precision_rank(type_name: str) -> int:
    upper = type_name.upper()
    return PRECISION.index(upper) if upper in PRECISION else len(PRECISION)


def candidate_of(model: ResolvedModel) -> Candidate:
    header = read_header(model.path)
    return Candidate(model.name, model.path, header.quant, header.file_size, model.source, header)


def find_candidates(model: ResolvedModel, everywhere: bool = True) -> list[Candidate]:
    """The files of this model here: it, the store's quants of it, and the same model elsewhere (deduplicated)."""
    found = [candidate_of(model)]
    wanted = signature(found[0].header)
    seen = {model.path.resolve()}
    for entry in catalog.entries(everywhere=everywhere):
        if entry.header is None or entry.path.resolve() in seen or signature(entry.header) != wanted:
            continue
        seen.add(entry.path.resolve())
        found.append(Candidate(entry.name, entry.path, entry.header.quant, entry.size, entry.source, entry.header))
    return sorted(found, key=lambda c: (precision_rank(c.type), c.size_bytes))


def hub_candidates(repo_id: str, candidates: list[Candidate], download: bool, timeout: float,
                   progress: Progress) -> list[Candidate]:
    """The quants the model's Hub repository lists that are not here: with `download`, fetched into the cache and
    measured like the rest; without, rows of their listed size (memory estimated with this model's shape)."""
    from llmcli.store import hub, references
    from llmcli.store.cache import Fetch
    from llmcli.store.models import resolve

    have = {c.type.upper() for c in candidates}
    found = []
    for quant, files, size in hub.listed_quants(references.parse(repo_id), timeout):
        if quant is None or quant.upper() in have:
            continue
        name = f"{repo_id}:{quant}"
        if download:
            fetched = resolve(name, fetch=Fetch(timeout=timeout, on_progress=lambda file, done, total: progress(
                f"downloading {file}", done, total or 0)))
            found.append(candidate_of(fetched))
        else:
            found.append(Candidate(name, Path(files[0]), quant.upper(), size, f"hf:{repo_id} (listed)",
                                   candidates[0].header, here=False))
    return sorted(candidates + found, key=lambda c: (precision_rank(c.type), c.size_bytes))


def make_types(candidates: list[Candidate], types: list[str], allow_requantize: bool, cancel: Cancellation,
               progress: Progress) -> list[Candidate]:
    """The `--make` types not here yet, made into the store from the highest-precision candidate."""
    source = next(c for c in candidates if c.here)
    have = {c.type.upper() for c in candidates if c.here}
    missing = [quantizer.check_type(t) for t in types if t.upper() not in have]
    if missing and quantizer.requantizes(source.header) and not allow_requantize:
        raise UsageError(f"the highest-precision file here is {source.reference} ({source.type}): making "
                         f"{', '.join(missing)} from it requantizes", hint="Get the model's F16/BF16 file, or pass "
                         "--allow-requantize (each result then carries the source's error too).")
    made = []
    name = quantized.base_name(source.reference)
    for type_name in missing:
        target = quantized.target(name, type_name)
        target.parent.mkdir(parents=True, exist_ok=True)
        quantizer.check_space(source.header, target, type_name)
        job = quantizer.QuantizeJob(str(source.path), str(target), type_name, allow_requantize)
        header = quantizer.quantize(job, cancel, _reporting(progress, f"making {type_name}"))
        made.append(Candidate(quantized.reference_of(name, type_name), target, header.quant, header.file_size,
                              "quantize", header))
    return sorted(candidates + made, key=lambda c: (precision_rank(c.type), c.size_bytes))


def _reporting(progress: Progress, label: str) -> Callable[[int, int, str], None]:
    return lambda done, total, _tensor: progress(label, done, total)


@dataclass(frozen=True)
class Measure:
    """How each candidate is measured (part of the key its figures are kept under)."""

    text: str
    eval_ctx: int = quality.DEFAULT_CTX
    top_k: int = quality.DEFAULT_TOP_K
    prompt_tokens: int = 256
    gen_tokens: int = 32
    repetitions: int = 3
    threads: int | None = None


def with_kv_types(candidates: list[Candidate], kv_types: list[str]) -> list[Candidate]:
    """Each candidate at each KV cache type (f16 first): a quantized cache's speed, memory and loss, measured alike."""
    from dataclasses import replace

    return [replace(c, kv_type=kv, measured={}) for c in candidates for kv in kv_types if c.here or kv == kv_types[0]]


def _kept_path(candidate: Candidate, reference: Path, measure: Measure) -> Path:
    here = machine()
    what = {**asdict(measure), "kv_type": candidate.kv_type, "text": hashlib.sha256(measure.text.encode()).hexdigest(),
            "candidate": remembered_sha256(candidate.path), "reference": remembered_sha256(reference),
            "cpu": here["cpu"], "cores": here["physical_cores"]}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    return paths.quality_cache_dir() / "advise" / f"{key}.json"


def measure_candidate(candidate: Candidate, reference: Candidate, measure: Measure, cancel: Cancellation,
                      progress: Progress) -> bool:
    """Fill `candidate.measured` (kept figures, else measured and kept); False when Ctrl-C stopped it."""
    kept = _kept_path(candidate, reference.path, measure)
    try:
        candidate.measured = {**json.loads(kept.read_text(encoding="utf-8")), "kept": True}
        return True
    except (OSError, ValueError):
        pass
    label = candidate.row()["name"]
    progress(f"{label}: speed", 0, 1)
    try:  # (Ctrl-C: the next token, or the next node of a prefill pass — the flag, never an exception raised inside
        # llama.cpp's callback, and never a pass longer than the stuck watch waits for)
        prefill, decode = quick_speed(candidate.path, measure.threads, measure.prompt_tokens, measure.gen_tokens,
                                      measure.repetitions, candidate.kv_type, cancel)
    except KeyboardInterrupt:
        return False
    if cancel:
        return False

    def scored(phase: str, done: int, total: int) -> None:
        progress(f"{label}: {'reference pass' if phase == 'reference' else 'quality'}", done, total)

    if candidate.path.resolve() == reference.path.resolve() and candidate.kv_type == "f16":
        reference_pass, _ = quality.reference_for(reference.path, measure.text, measure.eval_ctx, measure.top_k,
                                                  measure.threads, cancel, scored)
        if reference_pass is None:
            return False
        result: dict[str, Any] = {"kld_mean": 0.0, "kld_p99": 0.0, "top1_agreement": 1.0,
                                  "perplexity": reference_pass.perplexity()}
    else:
        summary = quality.evaluate(candidate.path, reference.path, measure.text, measure.eval_ctx, measure.top_k,
                                   measure.threads, cancel, scored, candidate.reference, candidate.kv_type)
        if summary.get("interrupted"):
            return False
        result = {"kld_mean": summary["kld"]["mean"], "kld_p99": summary["kld"]["p99"],
                  "top1_agreement": summary["top1_agreement"], "perplexity": summary["perplexity"]}
    result.update(prefill_tokens_per_s=prefill, decode_tokens_per_s=decode)
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f".{kept.name}.{os.getpid()}")
    partial.write_text(json.dumps(result), encoding="utf-8")
    os.replace(partial, kept)
    candidate.measured = {**result, "kept": False}
    return True


def memory_rows(candidates: list[Candidate], ctx: int, max_memory: int | None) -> None:
    """Each candidate's memory at the user's context, and whether it fits (available memory, --max-memory)."""
    available = available_memory()
    limit = min(x for x in (available, max_memory) if x is not None) if (available or max_memory) else None
    for candidate in candidates:
        memory = candidate.size_bytes + kv_cache_bytes(candidate.header, ctx, 1, candidate.kv_type) + RUNTIME_OVERHEAD
        candidate.measured.update(memory_bytes=memory, fits=limit is None or memory <= limit)


def front(rows: list[dict[str, Any]]) -> None:
    """Mark `pareto`: no other measured row is at least as fast and as close, and better in one."""
    measured = [r for r in rows if "decode_tokens_per_s" in r]
    for row in rows:
        row["pareto"] = row in measured and not any(
            other is not row and other["decode_tokens_per_s"] >= row["decode_tokens_per_s"]
            and other["kld_mean"] <= row["kld_mean"]
            and (other["decode_tokens_per_s"] > row["decode_tokens_per_s"] or other["kld_mean"] < row["kld_mean"])
            for other in measured)


def pick(rows: list[dict[str, Any]], min_decode: float | None, max_kld: float) -> tuple[dict[str, Any] | None, str]:
    """The fastest decoder among the measured rows within every limit; else the closest that fits; and why."""
    measured = [r for r in rows if "decode_tokens_per_s" in r]
    fitting = [r for r in measured if r["fits"]]
    if not fitting:
        return None, "no candidate fits in the memory available" + (" (--max-memory)" if measured else "")
    within = [r for r in fitting if r["kld_mean"] <= max_kld
              and (min_decode is None or r["decode_tokens_per_s"] >= min_decode)]
    if within:
        fastest = max(r["decode_tokens_per_s"] for r in within)
        near = [r for r in within if r["decode_tokens_per_s"] >= fastest * (1 - SAME_SPEED)]
        best = min(near, key=lambda r: (r["kld_mean"], -r["decode_tokens_per_s"]))
        limits = f"KL divergence ≤ {max_kld:g}" + (f", decode ≥ {min_decode:g} tok/s" if min_decode else "")
        closest = f"; the closest to the reference of the {len(near)} within {SAME_SPEED:.0%} of it" if len(near) > 1 else ""
        return best, (f"the fastest decode ({fastest:.1f} tok/s) of the {len(within)} candidate(s) that fit and meet "
                      f"{limits}{closest}: {best['decode_tokens_per_s']:.1f} tok/s, mean KL divergence "
                      f"{best['kld_mean']:.4f}")
    best = min(fitting, key=lambda r: r["kld_mean"])
    return best, (f"no candidate that fits meets every limit (KL divergence ≤ {max_kld:g}"
                  + (f", decode ≥ {min_decode:g} tok/s" if min_decode else "") + "): the closest to the reference "
                  f"that fits ({best['kld_mean']:.4f})")
