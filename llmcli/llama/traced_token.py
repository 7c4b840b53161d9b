"""What a traced token is (`Traced`), and what both ways of tracing one share (sampler_trace.py stage by stage,
observed_trace.py from inside llama.cpp's own sampling): the model's largest logits, the candidates built from a
distribution, a candidate array made once for a sampler, the chain's stages with their names, a token accepted."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.logprobs import largest
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.trace_distribution import Distribution
from llmcli.llama.vocab import Vocabulary


class ModelTop:
    """The k largest of the model's logits, the largest first, found once for the largest k asked — at least FOUND:
    finding 5 costs what finding 64 does — (a top-k stage's pool, the shown candidates)."""

    def __init__(self, logits: np.ndarray):
        self.logits = logits
        self.found: np.ndarray | None = None

    def of(self, k: int) -> np.ndarray:
        if self.found is None or len(self.found) < k:
            found = largest(self.logits, min(max(k, FOUND), len(self.logits)))
            self.found = found[np.argsort(-self.logits[found], kind="stable")]
        return self.found[:k]


FOUND = 64
BY_P_SAMPLER_THEN_MODEL = itemgetter(4, 3)  # (a Candidate's p_sampler, p_model)


@dataclass(frozen=True)
class Traced:
    token: int
    how: str  # argmax, or drawn
    p: float  # the chosen token's probability under the sampler's final distribution
    candidates: tuple[Candidate, ...]
    stages: tuple[tuple[str, int], ...]  # each stage's name and the candidates it left
    changed: tuple[str, ...]
    note: str = ""


def traced_from(token: int, stages: tuple[tuple[str, int], ...], changed: tuple[str, ...], final: Distribution,
            start: Distribution, top: ModelTop, log_total: float, vocab: Vocabulary, n_top: int, note: str) -> Traced:
    """The trace of a token chosen stage by stage: its candidates, the model's most likely and the chain's."""
    n_vocab, logits = vocab.n_tokens, start.logits
    greedy = bool(stages) and stages[-1][0] == "greedy"  # (the selecting stage: the last)
    chosen = {token: None}  # (the chosen token first; a dict keeps the order)
    if n_top:
        k = min(n_top, n_vocab)
        moved = final.moved_from(start)  # (a few logits moved: the sampler's most likely are among the model's
        pool = top.of(min(k + (0 if moved is None else len(moved)), n_vocab))  # k more, or those)
        chosen.update(dict.fromkeys(pool[:k].tolist()))  # (the model's most likely, the largest first)
        if final is not start:  # (no stage changed anything: the sampler's most likely are the model's)
            among = None if moved is None else np.array(list({*pool.tolist(), *moved.tolist()}))
            chosen.update(dict.fromkeys(final.most_likely(k, among)))  # (those the chain left, never a masked one)
    tokens = list(chosen)
    p_sampler = final.probs(tokens)
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), logit - log_total, math.exp(logit - log_total), p)
                         for t, logit, p in zip(tokens, logits[tokens].tolist(), p_sampler, strict=True)),
                        key=BY_P_SAMPLER_THEN_MODEL, reverse=True)  # (stable: ties keep their order)
    return Traced(token, "argmax" if greedy else "drawn", p_sampler[0], tuple(candidates), stages, changed, note)


class CandidateArray:
    """The candidate array a traced sampler fills each token (`data`, one llama_token_data a vocabulary entry: 12
    bytes), made once for the sampler: its numpy `view`, the same as rows of three 32-bit `words` (id, logit, p), those
    rows as each token starts them (`fresh`: every id in order, p 0), every id in order; and one
    llama_token_data_array over it (`array`, `reference` to it), whose data pointer, size and selected row are read
    and set through `header` — numpy's access to them takes ~0.1 µs, ctypes' ~0.7 for a pointer."""

    def __init__(self, n_vocab: int):
        self.data = (llama_cpp.llama_token_data * n_vocab)()
        self.view = np.ctypeslib.as_array(self.data)
        self.words = self.view.view(np.int32).reshape(n_vocab, 3)
        self.fresh = np.zeros((n_vocab, 3), dtype=np.int32)
        self.fresh[:, 0] = self.in_order = np.arange(n_vocab, dtype=np.int32)
        self.weights = np.empty(n_vocab, dtype=np.float32)  # the model's softmax's weights (whole's)
        self.home = ctypes.addressof(self.data)
        self.array = llama_cpp.llama_token_data_array(self.data, n_vocab, -1, False)
        self.reference = ctypes.byref(self.array)
        raw = memoryview(self.array).cast("B")
        self.header = np.frombuffer(raw, dtype=np.int64, count=3)  # data pointer, size, selected
        self.flags = np.frombuffer(raw, dtype=np.uint8)  # byte 24: sorted
        layout = [getattr(llama_cpp.llama_token_data_array, name).offset for name in ("data", "size", "selected", "sorted")]
        if layout != [0, 8, 16, 24]:
            raise RuntimeError("llama_token_data_array is not laid out as llama.cpp's (data, size, selected, sorted)")

    def start(self, size: int) -> None:
        """The array over the first `size` rows, nothing selected, not sorted (llama_sampler_sample's start)."""
        self.header[0], self.header[1], self.header[2] = self.home, size, -1
        self.flags[24] = 0

    def rows(self) -> tuple[np.ndarray, bool]:
        """The candidates the array holds now, and whether they are the home rows, in place: a stage that kept every
        row where it was given (a whole vocabulary)."""
        size = int(self.header[1])
        if int(self.header[0]) == self.home:
            return self.view[:size], size == len(self.view)
        return np.ctypeslib.as_array(self.array.data, shape=(size,)), False

    def selected(self) -> int:
        """The token the selecting stage chose."""
        return int(self.rows()[0]["id"][int(self.header[2])])


def candidate_array(sampler: Sampler, n_vocab: int) -> CandidateArray:
    """The sampler's candidate array for a vocabulary of `n_vocab` (made at its first traced token)."""
    found: CandidateArray | None = getattr(sampler, "_traced_candidates", None)
    if found is None or len(found.view) != n_vocab:
        found = sampler._traced_candidates = CandidateArray(n_vocab)  # type: ignore[attr-defined]
    return found


def accepted(sampler: Sampler, which: str, token: int) -> int:
    """`token`, accepted by the chain `which` as llama_sampler_sample accepts it (and kept in the sampler's record of
    the recent tokens its penalties hold)."""
    llama_cpp.llama_sampler_accept(getattr(sampler, which), token)
    if which == "chain" and sampler.recent is not None:
        sampler.recent.append(token)
    return token


def chain_stages(sampler: Sampler, which: str) -> tuple[tuple[Any, str], ...]:
    """The samplers of the sampler's chain `which` ("chain", or "constrained": under its grammar), each with its name:
    read from llama.cpp once for the sampler (its chains change only when a lazy grammar is armed: Sampler.watch drops
    this then)."""
    kept: dict[str, tuple[tuple[Any, str], ...]] = sampler.__dict__.setdefault("_traced_stages", {})
    found = kept.get(which)
    if found is None:
        chain = getattr(sampler, which)
        stages = [llama_cpp.llama_sampler_chain_get(chain, i) for i in range(llama_cpp.llama_sampler_chain_n(chain))]
        observation = getattr(sampler, "observation", None)
        observing = observation.addresses if observation is not None else set()
        stages = [stage for stage in stages if ctypes.cast(stage, ctypes.c_void_p).value not in observing]
        found = kept[which] = tuple((stage, (llama_cpp.llama_sampler_name(stage) or b"?").decode()) for stage in stages)
    return found
