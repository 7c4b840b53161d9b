"""`llmcli eval quality`: how far a (quantized) model's predictions are from a reference's, on one text.

The method is llama-perplexity's (`llmcli/llama/token_scores.py`: chunks of CTX tokens, the second half of each
scored). Perplexity is the candidate's own; against the reference, per scored position: the KL divergence of the
candidate's next-token distribution from the reference's, whether both put the same token first, and the difference
of the probabilities they give the text's actual next token (RMS Δp).

The reference's distributions are computed once and kept compactly (`paths.quality_cache_dir()`), keyed by the
reference file's sha256, the text's and CTX: per scored position its K most likely tokens with their
log-probabilities, K tokens drawn from the rest of its distribution (systematic sampling, each in proportion to its
probability, from a fixed seed) with theirs, the rest's mass, and the log-probability of the actual next token:
~2 KB a position at K = 128, ~4 MB for the default text. The KL divergence of a position is then the top K's exact
terms plus the rest's mass times the mean log-ratio over the drawn tokens — an unbiased estimate of the rest's terms.
On SmolLM2 the mean over a text is within 0.2 % of the full-vocabulary KLD, where the top K alone with the rest as one
outcome under-estimates it by 15 % at K = 128 and 4 % at K = 1024 (the tail of a small model's distribution holds
much of the divergence); `tests/test_quality.py` checks it against numpy over llama.cpp's full logits.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmcli import paths
from llmcli.errors import UsageError
from llmcli.interrupt import Cancellation
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig
from llmcli.llama.token_scores import TextTokens, chunk_log_probs, text_tokens
from llmcli.llama.vocab import VocabularyFile
from llmcli.store.file_hashes import remembered_sha256
from llmcli.store.gguf_header import read_header
from llmcli.store.memory import check_memory, kv_cache_bytes

DEFAULT_CTX = 512  # llama-perplexity's usual context for quant comparisons
DEFAULT_TOP_K = 128  # top tokens kept a position, and as many drawn from the rest
MIN_CHUNKS = 1
FORMAT = 2  # the reference file's layout
SEED = 20261205  # the tail draws' (the same reference file for the same inputs)
Progress = Callable[[str, int, int], None]  # (phase, chunks done, chunks in all)


MAX_TEXT_BYTES = 16 * 2**20  # a --text file's size at most (wikitext-2's test set is 1.3 MB): llama.cpp tokenizes it


def default_text() -> str:
    """The text shipped with llmcli for this (prose, code, numbers and dialogue, written for it)."""
    return (Path(__file__).parent / "quality_text.txt").read_text(encoding="utf-8")


def read_text(path: Path | None) -> str:
    """`--text FILE` (UTF-8, at most MAX_TEXT_BYTES), or the default text; UsageError saying what is wrong."""
    if path is None:
        return default_text()
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_TEXT_BYTES + 1)
        if len(data) > MAX_TEXT_BYTES:
            raise UsageError(f"--text {path}: larger than {MAX_TEXT_BYTES // 2**20} MiB",
                             hint="A few thousand tokens measure a quant well; cut the file.")
        return data.decode("utf-8")
    except OSError as exc:
        raise UsageError(f"--text {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--text {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


@dataclass
class Reference:
    """What is kept of the reference's pass over a text."""

    tokens: np.ndarray  # int32: the text's tokens
    ctx: int
    top_ids: np.ndarray  # int32 [positions, K]: the reference's K most likely next tokens, most likely first
    top_logprobs: np.ndarray  # float32 [positions, K]
    target_logprobs: np.ndarray  # float32 [positions]: the log-probability it gives the text's actual next token
    tail_ids: np.ndarray  # int32 [positions, K]: tokens drawn from the rest, each in proportion to its probability
    tail_logprobs: np.ndarray  # float32 [positions, K]
    rest: np.ndarray  # float32 [positions]: the probability outside the top K

    @property
    def positions(self) -> int:
        return len(self.target_logprobs)

    def perplexity(self) -> float:
        return math.exp(-float(self.target_logprobs.astype(np.float64).mean()))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        with open(partial, "wb") as handle:
            np.savez(handle, format=FORMAT, tokens=self.tokens, ctx=self.ctx, top_ids=self.top_ids,
                     top_logprobs=self.top_logprobs, target_logprobs=self.target_logprobs, tail_ids=self.tail_ids,
                     tail_logprobs=self.tail_logprobs, rest=self.rest)
        os.replace(partial, path)

    @staticmethod
    def load(path: Path) -> Reference | None:
        """A kept reference, or None where there is none (or an unreadable one, which is then removed)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                if int(data["format"]) != FORMAT:
                    raise ValueError("another layout")
                reference = Reference(data["tokens"], int(data["ctx"]), data["top_ids"], data["top_logprobs"],
                                      data["target_logprobs"], data["tail_ids"], data["tail_logprobs"], data["rest"])
            n, shape = reference.positions, reference.top_ids.shape
            if shape[0] != n or any(a.shape != shape for a in (reference.top_logprobs, reference.tail_ids,
                                                                reference.tail_logprobs)) or len(reference.rest) != n:
                raise ValueError("inconsistent arrays")
            return reference
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, EOFError):
            path.unlink(missing_ok=True)
            return None


def chunk_starts(n_tokens: int, ctx: int) -> list[int]:
    """Where each chunk of CTX tokens begins (llama-perplexity: whole chunks only)."""
    return [i * ctx for i in range(n_tokens // ctx)]


def scored_per_chunk(ctx: int) -> int:
    return ctx - 1 - ctx // 2


def reference_key(reference_path: Path, text: str, ctx: int, top_k: int) -> str:
    text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return hashlib.sha256(f"{remembered_sha256(reference_path)}:{text_hash}:{ctx}:{top_k}".encode()).hexdigest()[:32]


def load_engine(path: Path, ctx: int, threads: int | None, cancel: Cancellation, kv_type: str = "f16") -> Engine:
    header = read_header(path)
    check_memory(f"scoring with {path.name}", header.file_size, kv_cache_bytes(header, ctx, 1, kv_type))
    return Engine(path, EngineConfig(n_ctx=ctx, n_batch=ctx, n_threads=threads, kv_type=kv_type), cancel)


def check_length(tokens: TextTokens, ctx: int) -> None:
    if len(tokens.tokens) < MIN_CHUNKS * ctx:
        raise UsageError(f"the text has {len(tokens.tokens)} tokens: fewer than one chunk of -c {ctx}",
                         hint="Give a longer --text, or a smaller -c.")


def reference_pass(engine: Engine, text: str, ctx: int, top_k: int, cancel: Cancellation,
                   progress: Progress) -> Reference | None:
    """The reference's pass over the text (None when Ctrl-C stopped it: nothing is kept of a part)."""
    tokens = text_tokens(engine.vocab, text)
    check_length(tokens, ctx)
    first = ctx // 2
    starts = chunk_starts(len(tokens.tokens), ctx)
    parts: list[list[np.ndarray]] = [[], [], [], [], [], []]
    rng = np.random.default_rng(SEED)
    progress("reference", 0, len(starts))
    for done, start in enumerate(starts, 1):
        chunk = tokens.tokens[start : start + ctx]
        rows = chunk_log_probs(engine, chunk, first, tokens.bos)
        if rows is None or cancel:
            return None
        top = np.argpartition(-rows, top_k, axis=1)[:, :top_k]
        top_values = np.take_along_axis(rows, top, axis=1)
        order = np.argsort(-top_values, axis=1)
        top = np.take_along_axis(top, order, axis=1)
        tail, rest = tail_draws(rows, top, top_k, rng)
        for kept, value in zip(parts, (top.astype(np.int32), np.take_along_axis(top_values, order, axis=1),
                                       rows[np.arange(len(rows)), chunk[first + 1 :]], tail,
                                       np.take_along_axis(rows, tail, axis=1), rest), strict=True):
            kept.append(value)
        progress("reference", done, len(starts))
    top_ids, top_logprobs, targets, tail_ids, tail_logprobs, rests = (np.concatenate(p) for p in parts)
    return Reference(np.asarray(tokens.tokens, dtype=np.int32), ctx, top_ids, top_logprobs,
                     targets.astype(np.float32), tail_ids.astype(np.int32), tail_logprobs.astype(np.float32),
                     rests.astype(np.float32))


def tail_draws(rows: np.ndarray, top: np.ndarray, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per row, `k` tokens outside `top` drawn in proportion to their probability (systematic sampling: one uniform
    offset, then evenly spaced points of the rest's cumulative distribution), and the rest's mass."""
    draws = np.empty((len(rows), k), dtype=np.int64)
    rests = np.empty(len(rows))
    for i, row in enumerate(rows):
        p = np.exp(row.astype(np.float64))
        p[top[i]] = 0.0
        cumulative = np.cumsum(p)
        rests[i] = rest = cumulative[-1]
        points = (np.arange(k) + rng.random()) / k * rest
        draws[i] = np.minimum(np.searchsorted(cumulative, points, side="right"), len(p) - 1)
    return draws, rests


@dataclass
class Comparison:
    """Per scored position, the candidate against the reference (as many positions as were measured)."""

    reference: Reference
    nll: list[np.ndarray] = field(default_factory=list)  # -log p_candidate(actual next token)
    kld: list[np.ndarray] = field(default_factory=list)
    top1: list[np.ndarray] = field(default_factory=list)  # bool: the same most likely token
    delta_p: list[np.ndarray] = field(default_factory=list)  # p_candidate(actual) - p_reference(actual)
    interrupted: bool = False
    seconds: float = 0.0

    @property
    def positions(self) -> int:
        return sum(len(a) for a in self.nll)

    def add(self, rows: np.ndarray, start: int) -> None:
        """One chunk's rows (the candidate's log-probabilities), its positions from `start` in the reference's."""
        ref = self.reference
        end = start + len(rows)
        tokens = ref.tokens[_token_index(ref.ctx, start) : _token_index(ref.ctx, start) + len(rows)]
        actual = rows[np.arange(len(rows)), tokens]
        self.nll.append(-actual.astype(np.float64))
        self.kld.append(estimated_kld(ref, start, rows))
        self.top1.append(rows.argmax(axis=1) == ref.top_ids[start:end, 0])
        self.delta_p.append(np.exp(actual.astype(np.float64)) - np.exp(ref.target_logprobs[start:end].astype(np.float64)))

    def summary(self) -> dict[str, Any]:
        ref, n = self.reference, self.positions
        if n == 0:
            return {"tokens_scored": 0, "interrupted": self.interrupted}
        nll, kld = np.concatenate(self.nll), np.concatenate(self.kld)
        top1, dp = np.concatenate(self.top1).astype(np.float64), np.concatenate(self.delta_p)
        ppl = math.exp(float(nll.mean()))
        ref_nll = -ref.target_logprobs[:n].astype(np.float64)
        agreement = float(top1.mean())
        rms = math.sqrt(float((dp**2).mean()))
        return {
            "perplexity": ppl,
            "perplexity_error": ppl * _stderr(nll),
            "reference_perplexity": math.exp(float(ref_nll.mean())),
            "reference_perplexity_error": math.exp(float(ref_nll.mean())) * _stderr(ref_nll),
            "kld": {"mean": float(kld.mean()), "mean_error": _stderr(kld),  # (the per-position estimates, >= 0:)
                    "median": float(np.median(np.maximum(kld, 0))), "p99": float(np.percentile(np.maximum(kld, 0), 99)),
                    "max": float(kld.max())},
            "top1_agreement": agreement,
            "top1_agreement_error": math.sqrt(agreement * (1 - agreement) / max(n - 1, 1)),
            "rms_delta_p": rms,
            "rms_delta_p_error": _stderr(dp**2) / (2 * rms) if rms > 0 else 0.0,
            "tokens_scored": n,
            "tokens_in_reference": ref.positions,
            "ctx": ref.ctx,
            "top_k": int(ref.top_ids.shape[1]),
            "seconds": round(self.seconds, 3),
            "interrupted": self.interrupted,
        }


def _token_index(ctx: int, position: int) -> int:
    """The text's token that scored position `position` predicts."""
    per = scored_per_chunk(ctx)
    chunk, row = divmod(position, per)
    return chunk * ctx + ctx // 2 + 1 + row


def _stderr(values: np.ndarray) -> float:
    n = len(values)
    return float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0


def estimated_kld(reference: Reference, start: int, candidate: np.ndarray) -> np.ndarray:
    """KL(reference || candidate) per row, rows `start`… of the reference: the top K's terms exactly, the rest's from
    its drawn tokens (unbiased: the rest's mass times the mean log-ratio)."""
    end = start + len(candidate)
    p_log = reference.top_logprobs[start:end].astype(np.float64)
    q_log = np.take_along_axis(candidate, reference.top_ids[start:end], axis=1).astype(np.float64)
    inside = (np.exp(p_log) * (p_log - q_log)).sum(axis=1)
    tail_p = reference.tail_logprobs[start:end].astype(np.float64)
    tail_q = np.take_along_axis(candidate, reference.tail_ids[start:end], axis=1).astype(np.float64)
    result: np.ndarray = inside + reference.rest[start:end].astype(np.float64) * (tail_p - tail_q).mean(axis=1)
    return result


def full_kld(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(reference || candidate) per row over the whole vocabulary (both log-probabilities)."""
    ref = reference.astype(np.float64)
    result: np.ndarray = (np.exp(ref) * (ref - candidate.astype(np.float64))).sum(axis=1)
    return result


def candidate_pass(engine: Engine, reference: Reference, cancel: Cancellation, progress: Progress) -> Comparison:
    """The candidate's pass over the reference's text: as much as was measured when Ctrl-C came."""
    tokens = text_tokens(engine.vocab, "")
    comparison = Comparison(reference)
    started = time.perf_counter()
    ctx, first = reference.ctx, reference.ctx // 2
    starts = chunk_starts(len(reference.tokens), ctx)
    progress("candidate", 0, len(starts))
    for done, start in enumerate(starts, 1):
        chunk = [int(t) for t in reference.tokens[start : start + ctx]]
        rows = chunk_log_probs(engine, chunk, first, tokens.bos)
        if rows is None or cancel:
            comparison.interrupted = True
            break
        comparison.add(rows, (done - 1) * scored_per_chunk(ctx))
        progress("candidate", done, len(starts))
    comparison.seconds = time.perf_counter() - started
    return comparison


def check_same_tokens(path: Path, reference: Reference, text: str, name: str) -> None:
    """The candidate must read the text as the reference did (the same tokenizer: quants of one model), checked with
    its vocabulary alone, before its weights are loaded."""
    largest = max(int(reference.top_ids.max(initial=0)), int(reference.tail_ids.max(initial=0)))
    with VocabularyFile(path) as vocabulary:
        same = vocabulary.vocab.n_tokens > largest and np.array_equal(
            np.asarray(text_tokens(vocabulary.vocab, text).tokens, dtype=np.int32), reference.tokens)
    if not same:
        raise UsageError(f"{name} tokenizes the text differently from the reference: they are not quants of one model",
                         hint="Compare files of the same model (`llmcli quantize` makes them from one source).")


def reference_for(path: Path, text: str, ctx: int, top_k: int, threads: int | None, cancel: Cancellation,
                  progress: Progress) -> tuple[Reference | None, bool]:
    """The kept reference for (file, text, ctx, K), or a new pass (kept when whole). (reference, was kept)."""
    key = paths.quality_cache_dir() / f"{reference_key(path, text, ctx, top_k)}.npz"
    kept = Reference.load(key)
    if kept is not None:
        return kept, True
    with load_engine(path, ctx, threads, cancel) as engine:
        made = reference_pass(engine, text, ctx, top_k, cancel, progress)
    if made is not None:
        made.save(key)
    return made, False


def evaluate(candidate: Path, reference_path: Path, text: str, ctx: int = DEFAULT_CTX, top_k: int = DEFAULT_TOP_K,
             threads: int | None = None, cancel: Cancellation | None = None,
             progress: Progress = lambda phase, done, total: None, name: str = "the candidate",
             kv_type: str = "f16") -> dict[str, Any]:
    """The whole measurement: the reference (kept or made, its KV cache f16), then the candidate's pass (its KV cache
    `kv_type`: a quantized cache's loss is measured the same way); its summary."""
    cancel = cancel if cancel is not None else Cancellation()
    reference, kept = reference_for(reference_path, text, ctx, top_k, threads, cancel, progress)
    if reference is None:
        return {"tokens_scored": 0, "interrupted": True, "reference_kept": False}
    check_same_tokens(candidate, reference, text, name)
    with load_engine(candidate, ctx, threads, cancel, kv_type) as engine:
        comparison = candidate_pass(engine, reference, cancel, progress)
    return {**comparison.summary(), "reference_kept": kept}
