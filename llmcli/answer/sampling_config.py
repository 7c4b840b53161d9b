"""Step 4, how the next token is chosen: one frozen, validated config (pure data; llmcli/llama/sampler_chain.py
maps it to llama.cpp's sampler chain).

Its fields are the settings of the same names (llmcli/config/settings.py), with the same defaults and checks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from llmcli.answer.grammar_limits import dead_end, grammar_problem
from llmcli.config.settings import SETTINGS, default
from llmcli.errors import UsageError


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = default("temp")
    top_k: int = default("top_k")
    top_p: float = default("top_p")
    min_p: float = default("min_p")
    typical_p: float = default("typical_p")
    repeat_penalty: float = default("repeat_penalty")
    repeat_last_n: int = default("repeat_last_n")
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")
    mirostat: int = default("mirostat")
    mirostat_tau: float = default("mirostat_tau")
    mirostat_eta: float = default("mirostat_eta")
    dry_multiplier: float = default("dry_multiplier")
    dry_base: float = default("dry_base")
    dry_allowed_length: int = default("dry_allowed_length")
    dry_penalty_last_n: int = default("dry_penalty_last_n")
    xtc_probability: float = default("xtc_probability")
    xtc_threshold: float = default("xtc_threshold")
    seed: int | None = default("seed")  # None: a fresh random seed for every answer (reported in the stats)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    grammar: str | None = field(default=None, repr=False)  # GBNF, root rule "root"
    grammar_origin: str = "--grammar"  # the flag the grammar came from, for error messages
    grammar_triggers: tuple[str, ...] = ()  # regexes: the grammar applies once one matches the answer (lazy; tools)
    first_token_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) for the answer's first token alone

    def __post_init__(self) -> None:
        for name in SETTING_FIELDS:
            setting, value = SETTINGS[name], getattr(self, name)
            problem = setting.problem(value)
            if problem:
                raise UsageError(f"{setting.flag} {problem} (got {value})")
        if self.grammar is not None:  # the last gate before llama.cpp's parser, whatever made the grammar
            check_grammar(self.grammar, self.grammar_origin)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], **extra: Any) -> SamplingConfig:
        """The config the effective settings describe; `extra` adds logit_bias and grammar."""
        return cls(**{name: values[name] for name in SETTING_FIELDS}, **extra)

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def effective_seed(self) -> int:
        """The configured seed, else a fresh random one."""
        return self.seed if self.seed is not None else random.randrange(2**32 - 1)

    def record(self) -> dict[str, Any]:
        """The settings as a conversation record and chat's /show list them (no grammar text)."""
        return {name: getattr(self, name) for name in SETTING_FIELDS} | {"logit_bias": [list(b) for b in self.logit_bias]}


SETTING_FIELDS = tuple(f.name for f in fields(SamplingConfig) if f.name in SETTINGS)

# The request fields that carry the sampling settings (and the repetition guard) to a server: OpenAI's names
# where it has one, llama-server's for the rest (its names are llmcli's). `llmcli serve` reads every one of them;
# llama-server and vLLM read most; OpenAI itself refuses what it does not know, which says so rather than dropping it.
ANSWER_FIELDS = ("repetition_guard", "think_budget", "call_preference", "call_gain")  # the answer's options
# (GenerationOptions), not sampling's: llmcli's own fields, sent only when not the default
WIRE_FIELDS: dict[str, str] = {name: "temperature" if name == "temp" else name for name in (*SETTING_FIELDS, *ANSWER_FIELDS)}


def check_grammar(gbnf: str, origin: str) -> None:
    """UsageError (exit 2; serve's 400) naming `origin` when a grammar passes a limit of llmcli/answer/grammar_limits.py,
    or no answer can follow it (what llama.cpp would abort on)."""
    problem = grammar_problem(gbnf)
    if problem:
        raise UsageError(f"{origin}: the grammar is too large for llama.cpp: {problem}",
                         hint="See the README's Grammar limits.")
    impossible = dead_end(gbnf)
    if impossible:  # (llama.cpp would abort the process at the first token)
        raise UsageError(f"{origin}: no answer can follow the grammar: {impossible}",
                         hint="See the README's Grammar limits.")


def greedy_without_end(end_of_generation: tuple[int, ...]) -> SamplingConfig:
    """Greedy with end-of-generation banned: every run yields exactly the tokens asked for (benchmarks)."""
    return SamplingConfig(temp=0, logit_bias=tuple((t, -math.inf) for t in end_of_generation))


def split_logit_bias(spec: str) -> tuple[str, float]:
    """One `--logit-bias TOKEN=BIAS`: the token as given (an id or a text) and the bias (a number, or -inf)."""
    token_text, sep, bias_text = spec.rpartition("=")
    if not sep or not token_text:
        raise UsageError(f"--logit-bias {spec!r}: expected TOKEN=BIAS, e.g. 15043=-inf or 'Hello=2.5'")
    try:
        return token_text, float(bias_text)
    except ValueError:
        raise UsageError(f"--logit-bias {spec!r}: {bias_text!r} is not a number (or -inf)") from None


def parse_logit_bias(specs: list[str], tokenize: Callable[[str], list[int]], n_vocab: int) -> tuple[tuple[int, float], ...]:
    """`TOKEN=BIAS` pairs: TOKEN is a token id or a text that is exactly one token; BIAS a number or -inf."""
    return resolve_logit_bias([logit_bias_pair(spec) for spec in specs], tokenize, n_vocab)


def logit_bias_pair(spec: str) -> tuple[int | str, float]:
    """One `--logit-bias TOKEN=BIAS` as (a token id, or a token's text; the bias)."""
    token_text, bias = split_logit_bias(spec)
    return (int(token_text) if token_text.lstrip("-").isdigit() else token_text), bias


def resolve_logit_bias(pairs: list[tuple[int | str, float]], tokenize: Callable[[str], list[int]],
                       n_vocab: int) -> tuple[tuple[int, float], ...]:
    """(token id or text, bias) pairs -> (token id, bias): a text must be exactly one token (UsageError naming the
    --logit-bias it came from otherwise), an id within the vocabulary. The one reading of a logit bias, for run and
    for a server's requests alike."""
    biases = []
    for token_or_text, bias in pairs:
        spec = f"{token_or_text}={bias:g}"
        if isinstance(token_or_text, int):
            token = token_or_text
            if not 0 <= token < n_vocab:
                raise UsageError(f"--logit-bias {spec!r}: token id {token} is outside the vocabulary (0..{n_vocab - 1})")
        else:
            tokens = tokenize(token_or_text)
            if len(tokens) != 1:
                raise UsageError(
                    f"--logit-bias {spec!r}: {token_or_text!r} is {len(tokens)} tokens {tokens}; give one token or its id"
                )
            token = tokens[0]
        biases.append((token, bias))
    return tuple(biases)
