"""One token sampled with every stage seen (`run --trace`): llama.cpp's `llama_sampler_sample` done by hand — the
logits into a candidate array, each sampler of the chain applied in turn (a snapshot after each), the selected token
accepted by the chain — so the token is the one the plain call would give, and each stage's effect is visible: which
candidates it left and whether it changed the distribution. Only a traced answer comes here (it costs a copy of the
vocabulary's logits and a softmax a stage); the plain path is Sampler.sample."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np

from llmcli.answer.events import Candidate
from llmcli.llama.sampler_chain import Sampler
from llmcli.llama.vocab import Vocabulary

SELECTORS = ("greedy", "dist", "mirostat", "mirostat-v2")  # the last stage: picks the token, changes no probability


@dataclass(frozen=True)
class Traced:
    token: int
    how: str  # argmax, or drawn
    p: float  # the chosen token's probability under the sampler's final distribution
    candidates: tuple[Candidate, ...]
    stages: tuple[tuple[str, int], ...]  # each stage's name and the candidates it left
    changed: tuple[str, ...]
    note: str = ""


def sample_traced(sampler: Sampler, vocab: Vocabulary, index: int, n_top: int) -> Traced:
    """The next token from the logits at batch `index`, as `sampler.sample` would choose it, with its trace."""
    n_vocab = vocab.n_tokens
    pointer = llama_cpp.llama_get_logits_ith(sampler.ctx, index)
    if sampler.first_bias:  # (as Sampler.sample applies it: into llama.cpp's logits, then dropped)
        for token_id, bias in sampler.first_bias:
            pointer[token_id] += bias
        sampler.first_bias = ()
    logits = np.ctypeslib.as_array(pointer, shape=(n_vocab,)).copy()  # (float32, as llama.cpp's: the chain reads it)
    model = logits - logits.max()
    exp = np.exp(model)
    total = float(exp.sum(dtype=np.float64))
    model -= np.float32(math.log(total))  # the model's log-probabilities (the first token's lead included)
    p_model = exp / np.float32(total)  # (the distribution before any stage: no softmax of the whole vocabulary again)
    buffer = _candidates(sampler, n_vocab)
    stages, changed, final, token, note = _through(sampler.chain, logits, p_model, buffer)
    if sampler.grammar is not None:  # (the lazy check: the grammar alone on the chosen token; rejected, sampled again)
        one = llama_cpp.llama_token_data(token, 1.0, 0.0)
        array = llama_cpp.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
        if one.logit != -math.inf:
            llama_cpp.llama_sampler_accept(sampler.constrained, token)
        else:
            refused = vocab.piece(token, special=True).decode("utf-8", "replace")
            stages, changed, final, token, _ = _through(sampler.constrained, logits, p_model, buffer)
            note = f"the grammar refused {refused!r}: sampled again under it"
        llama_cpp.llama_sampler_accept(sampler.grammar, token)
    greedy = any(name == "greedy" for name, _ in stages)
    chosen = {token}
    if n_top:
        k = min(n_top, n_vocab) - 1
        chosen.update(np.argpartition(model, n_vocab - 1 - k)[n_vocab - 1 - k:].tolist())
        if final is not p_model:  # (no stage changed anything: the sampler's most likely are the model's)
            # those the chain left: the most likely of them, never a masked one (0 is below any that is left)
            kept = np.argpartition(final, n_vocab - 1 - k)[n_vocab - 1 - k:] if np.count_nonzero(final) > n_top \
                else np.flatnonzero(final)
            chosen.update(kept.tolist())
    candidates = sorted((Candidate(t, vocab.piece(t, special=True), float(model[t]), math.exp(float(model[t])),
                                   float(final[t])) for t in chosen), key=lambda c: (-c.p_sampler, -c.p_model))
    return Traced(token, "argmax" if greedy else "drawn", float(final[token]), tuple(candidates), stages, changed,
                  note)


def _candidates(sampler: Sampler, n_vocab: int) -> tuple[Any, np.ndarray]:
    """The candidate array a traced sampler fills each token, and its numpy view (made once for it: 12 bytes a
    vocabulary entry)."""
    found = getattr(sampler, "_traced_candidates", None)
    if found is None or len(found[0]) != n_vocab:
        data = (llama_cpp.llama_token_data * n_vocab)()
        found = (data, np.ctypeslib.as_array(data))
        sampler._traced_candidates = found  # type: ignore[attr-defined]
    return found


def _through(chain: object, logits: np.ndarray, p_model: np.ndarray, buffer: tuple[Any, np.ndarray]) -> tuple[
        tuple[tuple[str, int], ...], tuple[str, ...], np.ndarray, int, str]:
    """Apply each sampler of `chain` in turn to the candidates (all of the vocabulary): each stage and the candidates
    it left, the stages that changed the distribution, the final distribution (before the selecting stage: a
    probability per token id, 0 for those removed or masked), the token selected (accepted by the chain, as
    llama_sampler_sample does)."""
    n_vocab = len(logits)
    data, view = buffer
    view["id"] = _ids(n_vocab)
    view["logit"] = logits
    view["p"] = 0.0
    array = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
    home = ctypes.addressof(data)

    def candidates(size: int) -> np.ndarray:  # (the stages work in place: the view made once, not a new one a stage —
        # numpy reads a ctypes array's type anew each time, ~90 µs)
        if ctypes.cast(array.data, ctypes.c_void_p).value == home:
            return view[:size]
        return np.ctypeslib.as_array(array.data, shape=(size,))

    stages: list[tuple[str, int]] = []
    changed: list[str] = []
    before = final = p_model
    for i in range(llama_cpp.llama_sampler_chain_n(chain)):
        stage = llama_cpp.llama_sampler_chain_get(chain, i)
        name = (llama_cpp.llama_sampler_name(stage) or b"?").decode()
        llama_cpp.llama_sampler_apply(stage, ctypes.byref(array))
        size = int(array.size)
        stages.append((name, size))
        if name in SELECTORS:
            break
        after = _distribution(candidates(size), size, n_vocab)
        if float(np.abs(after - before).max()) > 1e-9:
            changed.append(name)
        before = final = after
    selected = int(array.selected)
    token = int(candidates(int(array.size))["id"][selected])
    llama_cpp.llama_sampler_accept(chain, token)
    return tuple(stages), tuple(changed), final, token, ""


@functools.lru_cache(maxsize=2)
def _ids(n_vocab: int) -> np.ndarray:
    """Every token id, in order (the candidate array's ids before the first stage)."""
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


def _distribution(view: np.ndarray, size: int, n_vocab: int) -> np.ndarray:
    """The probabilities the candidates' logits make, one per token id (0: removed, or masked with -inf)."""
    ids, values = view["id"][:size], view["logit"][:size]
    top = values.max() if size else -math.inf
    if not math.isfinite(top):
        return np.zeros(n_vocab)
    p: np.ndarray = np.exp((values - top).astype(np.float64))  # (a masked candidate's -inf: 0)
    p /= p.sum()
    if size == n_vocab and ids[0] == 0 and ids[-1] == n_vocab - 1 and bool((ids[1:] > ids[:-1]).all()):
        return p  # (every token still there, in id order: no scatter)
    found = np.zeros(n_vocab)
    found[ids] = p
    return found
