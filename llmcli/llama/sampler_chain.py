"""A SamplingConfig as llama.cpp's sampler chain: the one mapping point to llama.cpp's sampler names.

Chain order, llama.cpp's own (common/sampling.cpp) for the same controls:

    logit-bias -> grammar -> penalties -> DRY -> top-k -> typical-p -> top-p -> min-p -> XTC -> temperature -> dist
    mirostat 1/2:   logit-bias -> grammar -> penalties -> DRY -> temperature -> mirostat
    greedy (temp 0): logit-bias -> grammar -> penalties -> DRY -> greedy

With a grammar, the token is sampled first without it and then checked against the grammar alone
(one candidate, not the whole vocabulary); only a rejected token is sampled again with the grammar
applied first, as llama.cpp's common sampler does. Greedy answers are identical either way; the check
costs a fraction of applying the grammar to every candidate (SmolLM2 with a JSON schema: see the
CHANGELOG). Chains with penalties or mirostat, whose state follows every accepted token, keep the
grammar first.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import llama_cpp

from llmcli.answer.sampling_config import SamplingConfig
from llmcli.errors import UsageError
from llmcli.llama.lazy_trigger import LazyTrigger
from llmcli.llama.llama_log import llama_backend, stderr_captured
from llmcli.llama.stage_observation import Observation
from llmcli.llama.vocab import Vocabulary

SELECTORS = ("greedy", "dist", "mirostat", "mirostat-v2")  # the last stage: picks the token, changes no probability
# Where a DRY repeat may not continue across (llama.cpp's defaults): a new line, a colon, a quote, an asterisk.
DRY_BREAKERS = ("\n", ":", '"', "*")


class Sampler:
    """A llama.cpp sampler chain for one answer, reading the logits of context `ctx`; close() frees it.

    `chain` alone samples when there is no grammar (`checks_grammar` False): the decode loops call it
    directly. With a grammar, `sample` tries `chain` and checks the token (see the module's note)."""

    def __init__(self, config: SamplingConfig, vocab: Any, seed: int, ctx: Any, n_ctx: int, observed: bool = False):
        self.seed = seed
        # A traced answer's chain (`observed`) has a sampler of ours after each stage: what each left is seen inside
        # llama.cpp's own sampling (stage_observation.py; the constrained chain, sampled only when a lazy grammar
        # refuses a token, is traced stage by stage instead)
        self.observation = Observation(llama_cpp.llama_vocab_n_tokens(vocab)) if observed else None
        observe = self.observation.after if self.observation is not None else None
        self.ctx = ctx
        self.first_bias = config.first_token_bias  # added to the first logits sampled from, then dropped
        self.temp = config.temp  # (a traced chain's temperature is applied by the reader: stage_observation.py)
        self.top_k = config.top_k  # (a traced top-k is given only the k + 1 most likely, and the tokens stages before
        # it may move: the biased ones, the penalties' recent tokens)
        self.biased = tuple(token for token, _ in config.logit_bias)
        self.recent: deque[int] | None = deque(maxlen=penalty_window(config, n_ctx)) if _penalised(config) else None
        self.free = config.grammar is None  # any token may be given (`accept`): no grammar to keep in step
        self.chain: Any = None
        self.constrained: Any = None  # the chain with the grammar first: for a token the grammar rejected
        self.grammar: Any = None  # the grammar alone, to check one token
        # A lazy grammar (tools `auto`) is given no token until the answer fires its trigger (lazy_trigger.py): then
        # it is made again and fed the few tokens that hold what fired it (`watch`). Until then `armed` is False.
        self._config, self._vocab_ptr, self._n_ctx = config, vocab, n_ctx
        self.trigger = LazyTrigger(config.grammar_triggers) if config.grammar is not None and config.grammar_triggers \
            else None
        self.armed = self.trigger is None
        self._pieces: Vocabulary | None = None
        self.lazy = False  # the grammar checks one sampled token, and samples again under it only when it refuses it
        if config.grammar is None:
            self.chain = _build_chain(config, vocab, seed, n_ctx, observe=observe)
            return
        _check_token_ids(config, vocab)
        self._pieces = Vocabulary(vocab) if self.trigger is not None else None
        self.lazy = config.repeat_penalty == 1.0 and not config.presence_penalty and not config.frequency_penalty \
            and not config.dry_multiplier and (config.greedy or config.mirostat == 0)
        with stderr_captured() as captured:  # the grammar parser writes its reason to fd 2, not the log
            try:
                if self.lazy:
                    self.grammar = _grammar_sampler(config, vocab)
                    self.constrained = _build_chain(config, vocab, seed, n_ctx)
                    self.chain = _build_chain(config, vocab, seed, n_ctx, with_grammar=False, observe=observe)
                    self._candidate = llama_cpp.llama_token_data(0, 1.0, 0.0)
                    self._one = llama_cpp.llama_token_data_array(ctypes.pointer(self._candidate), 1, -1, False)
                elif self.trigger is not None:  # (the grammar joins the chain when it fires: parsed now, to refuse it now)
                    llama_cpp.llama_sampler_free(_grammar_sampler(config, vocab))
                    self.chain = _build_chain(config, vocab, seed, n_ctx, with_grammar=False, observe=observe)
                else:
                    self.chain = _build_chain(config, vocab, seed, n_ctx, observe=observe)
            except UsageError as exc:
                self.close()
                reason = " ".join(captured().split()) or llama_backend().take_error() or "no reason given"
                raise UsageError(f"{exc.message}: {reason}") from None

    @property
    def checks_grammar(self) -> bool:
        return self.grammar is not None

    def sample(self, index: int = -1) -> int:
        """The next token from the logits at batch `index` (-1: the last)."""
        if self.first_bias:  # the answer's first token: a call's opening favoured (tool_choice auto)
            logits = llama_cpp.llama_get_logits_ith(self.ctx, index)
            for token_id, bias in self.first_bias:
                logits[token_id] += bias
            self.first_bias = ()
        token = int(llama_cpp.llama_sampler_sample(self.chain, self.ctx, index))
        if self.recent is not None:  # (the tokens the chain's penalties hold: only a chain with penalties)
            self.recent.append(token)
        if self.grammar is None or not self.armed:
            if not self.armed:  # (a lazy grammar waiting for the call's opening)
                self.watch(token)
            return token
        candidate = self._candidate
        candidate.id, candidate.logit = token, 1.0  # type: ignore[assignment]  # ctypes converts
        self._one.size, self._one.selected = 1, -1
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._one))
        if candidate.logit != -math.inf:
            llama_cpp.llama_sampler_accept(self.constrained, token)  # keep its grammar in step
        else:  # rejected: sample again with the grammar applied to every candidate (this accepts it there)
            token = int(llama_cpp.llama_sampler_sample(self.constrained, self.ctx, index))
        llama_cpp.llama_sampler_accept(self.grammar, token)
        return token

    def accept(self, token: int) -> None:
        """A token chosen by the decode loop itself (the closing of a think block over its budget, an answer resumed
        after a restart), not sampled: the chains' state (penalties, the random draws' sequence, a grammar) takes it as
        if sampled."""
        llama_cpp.llama_sampler_accept(self.chain, token)
        if self.recent is not None:
            self.recent.append(token)
        if self.grammar is not None and self.armed:
            llama_cpp.llama_sampler_accept(self.constrained, token)
            llama_cpp.llama_sampler_accept(self.grammar, token)
        self.watch(token)

    def watch(self, token: int) -> None:
        """The answer gained `token` (sampled and accepted by the chains in use): a lazy grammar that it fires is
        armed — made with its patterns, fed the tokens that hold what fired it, and put where it samples."""
        if self.armed or self.trigger is None or self._pieces is None:
            return
        fired = self.trigger.fires(token, self._pieces.piece(token, special=True))
        if fired is None:
            return
        tokens, patterns = fired
        config = dataclasses.replace(self._config, grammar_triggers=patterns)
        self.__dict__.pop("_traced_stages", None)  # (sampler_trace's names of the chains' stages)
        if self.observation is not None:
            self.observation.readable = None  # (the chain is another: its shape asked again)
        if self.lazy:
            for name in ("grammar", "constrained"):
                llama_cpp.llama_sampler_free(getattr(self, name))
                setattr(self, name, None)
            self.grammar = _grammar_sampler(config, self._vocab_ptr)
            self.constrained = _build_chain(config, self._vocab_ptr, self.seed, self._n_ctx)
            for fed in tokens:
                llama_cpp.llama_sampler_accept(self.grammar, fed)
                llama_cpp.llama_sampler_accept(self.constrained, fed)  # (its other stages keep no state: lazy)
        else:
            grammar = _grammar_sampler(config, self._vocab_ptr)
            for fed in tokens:
                llama_cpp.llama_sampler_accept(grammar, fed)
            _insert_after_bias(self.chain, grammar, bool(self._config.logit_bias))
        self.armed = True

    def close(self) -> None:
        if self.observation is not None:
            self.observation.close()
        for name in ("chain", "constrained", "grammar"):
            sampler = getattr(self, name, None)
            if sampler is not None:
                llama_cpp.llama_sampler_free(sampler)
                setattr(self, name, None)

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_grammar(config: SamplingConfig, vocab: Any) -> Any:
    """llama.cpp's grammar sampler: lazy (waiting for one of the trigger patterns) when the config has triggers."""
    assert config.grammar is not None
    if not config.grammar_triggers:
        return llama_cpp.llama_sampler_init_grammar(vocab, config.grammar.encode(), b"root")
    patterns = (ctypes.c_char_p * len(config.grammar_triggers))(*(p.encode() for p in config.grammar_triggers))
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(vocab, config.grammar.encode(), b"root", patterns,
                                                               len(config.grammar_triggers), None, 0)


def _insert_after_bias(chain: Any, sampler: Any, biased: bool) -> None:
    """`sampler` into `chain` where _build_chain puts a grammar (first, or after the logit bias): the stages after that
    place taken out and added back after it, their state (penalties' history, the draws' sequence) kept."""
    at = 1 if biased else 0
    moved = [llama_cpp.llama_sampler_chain_remove(chain, at) for _ in range(llama_cpp.llama_sampler_chain_n(chain) - at)]
    llama_cpp.llama_sampler_chain_add(chain, sampler)
    for stage in moved:
        llama_cpp.llama_sampler_chain_add(chain, stage)


_TOKEN_ID = re.compile(r"<\[(\d+)\]>")  # a grammar's token by id: <[1234]>


def _check_token_ids(config: SamplingConfig, vocab: Any) -> None:
    """A token id beyond the vocabulary is refused here: llama.cpp takes it, then aborts the process on it."""
    assert config.grammar is not None
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    beyond = next((m.group(1) for m in _TOKEN_ID.finditer(config.grammar)  # (any number of digits: no int() of
                   if len(m.group(1)) > 9 or int(m.group(1)) >= n_vocab), None)  # 5,000 of them)
    if beyond is not None:
        shown = beyond if len(beyond) <= 12 else beyond[:12] + "…"
        raise UsageError(f"{config.grammar_origin}: no answer can follow the grammar: token <[{shown}]> is beyond "
                         f"the vocabulary ({n_vocab} tokens)")


def _grammar_sampler(config: SamplingConfig, vocab: Any) -> Any:
    grammar = _new_grammar(config, vocab)
    if not grammar:
        raise UsageError(f"llama.cpp rejected the grammar from {config.grammar_origin}")
    return grammar


def _build_chain(config: SamplingConfig, vocab: Any, seed: int, n_ctx: int, with_grammar: bool = True,
                 observe: Callable[[str], Any] | None = None) -> Any:
    """The chain; `observe`: a sampler to add after each stage but the last (given the stage's name; None: none)."""
    params = llama_cpp.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def add(sampler: Any, what: str = "") -> None:
        if not sampler:
            llama_cpp.llama_sampler_free(chain)
            raise UsageError(f"llama.cpp rejected the {what or 'sampler settings'}")
        llama_cpp.llama_sampler_chain_add(chain, sampler)
        if observe is None:  # (an untraced answer's chain: nothing more)
            return
        name = (llama_cpp.llama_sampler_name(sampler) or b"").decode()
        observer = observe(name) if name not in SELECTORS else None
        if observer is not None:
            llama_cpp.llama_sampler_chain_add(chain, observer)

    if config.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(config.logit_bias))(
            *(llama_cpp.llama_logit_bias(token, bias) for token, bias in config.logit_bias))
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(config.logit_bias), biases))
    if config.grammar is not None and with_grammar:
        add(_new_grammar(config, vocab), f"grammar from {config.grammar_origin}")
    if _penalised(config):
        add(llama_cpp.llama_sampler_init_penalties(
            n_vocab, penalty_window(config, n_ctx), config.repeat_penalty, config.frequency_penalty,
            config.presence_penalty))
    if config.dry_multiplier > 0:
        breakers = (ctypes.c_char_p * len(DRY_BREAKERS))(*(b.encode() for b in DRY_BREAKERS))
        last_n = n_ctx if config.dry_penalty_last_n == -1 else config.dry_penalty_last_n  # this C API takes no -1
        add(llama_cpp.llama_sampler_init_dry(vocab, config.dry_multiplier, config.dry_base, config.dry_allowed_length,
                                             last_n, breakers, len(DRY_BREAKERS)), "DRY settings")
    if config.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
    elif config.mirostat == 1:
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, config.mirostat_tau, config.mirostat_eta, 100))
    elif config.mirostat == 2:
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_mirostat_v2(seed, config.mirostat_tau, config.mirostat_eta))
    else:
        if config.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(config.top_k))
        if config.typical_p < 1:
            add(llama_cpp.llama_sampler_init_typical(config.typical_p, 1))
        if config.top_p < 1:
            add(llama_cpp.llama_sampler_init_top_p(config.top_p, 1))
        if config.min_p > 0:
            add(llama_cpp.llama_sampler_init_min_p(config.min_p, 1))
        if config.xtc_probability > 0:
            add(llama_cpp.llama_sampler_init_xtc(config.xtc_probability, config.xtc_threshold, 1, seed))
        add(llama_cpp.llama_sampler_init_temp(config.temp))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def _penalised(config: SamplingConfig) -> bool:
    return config.repeat_penalty != 1.0 or bool(config.presence_penalty) or bool(config.frequency_penalty)


def penalty_window(config: SamplingConfig, n_ctx: int) -> int:
    """How many of the answer's last tokens the penalties look at: `repeat_last_n`, -1 the whole context (this C API
    takes no -1: it would look at none)."""
    return n_ctx if config.repeat_last_n == -1 else max(config.repeat_last_n, 0)


def parse_grammar(vocab: Any, gbnf: str, origin: str, n_ctx: int) -> None:
    """llama.cpp's grammar parser on `gbnf` over `vocab` (a Vocabulary) alone, no context (LlmcliError: what it
    refused, as a sampler chain would say it)."""
    Sampler(SamplingConfig(temp=0, grammar=gbnf, grammar_origin=origin), vocab.handle, 0, None, n_ctx).close()
