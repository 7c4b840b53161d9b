"""Step 4, how the next token is chosen: one frozen config, validated, mapped once to llama.cpp's sampler chain.

Chain order, llama.cpp's own (common/sampling.cpp) for the same controls:

    logit-bias -> grammar -> penalties -> top-k -> typical-p -> top-p -> min-p -> temperature -> dist
    mirostat 1/2:   logit-bias -> grammar -> penalties -> temperature -> mirostat
    greedy (temp 0): logit-bias -> grammar -> penalties -> greedy

llama.cpp applies the grammar after sampling and resamples on a rejected token; applying it
first, as here, gives the same distribution at a higher cost per token (only when a grammar is set).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from llmcli.errors import UsageError

# field -> (check, rule, flag): the one validation table, also used for values from env and config.
RULES: dict[str, tuple[Any, str, str]] = {
    "temperature": (lambda v: v >= 0, "must be >= 0", "--temp"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 disables it)", "--top-k"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]", "--top-p"),
    "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]", "--min-p"),
    "typical_p": (lambda v: 0 < v <= 1, "must be in (0, 1]", "--typical-p"),
    "repeat_penalty": (lambda v: v > 0, "must be > 0 (1 disables it)", "--repeat-penalty"),
    "repeat_last_n": (lambda v: v >= -1, "must be >= -1 (-1: the whole context)", "--repeat-last-n"),
    "presence_penalty": (math.isfinite, "must be a finite number", "--presence-penalty"),
    "frequency_penalty": (math.isfinite, "must be a finite number", "--frequency-penalty"),
    "mirostat": (lambda v: v in (0, 1, 2), "must be 0, 1 or 2", "--mirostat"),
    "mirostat_tau": (lambda v: v > 0, "must be > 0", "--mirostat-tau"),
    "mirostat_eta": (lambda v: v > 0, "must be > 0", "--mirostat-eta"),
    "seed": (lambda v: v is None or 0 <= v < 2**32 - 1, "must be in [0, 2^32 - 1)", "--seed"),
}


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None  # None: a fresh random seed for every answer (reported in the stats)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    grammar: str | None = field(default=None, repr=False)  # GBNF, root rule "root"
    grammar_origin: str = "--grammar"  # the flag the grammar came from, for error messages

    def __post_init__(self) -> None:
        for name, (check, rule, flag) in RULES.items():
            value = getattr(self, name)
            if not check(value):
                raise UsageError(f"{flag} {rule} (got {value})")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def effective_seed(self) -> int:
        """The configured seed, else a fresh random one."""
        return self.seed if self.seed is not None else random.randrange(2**32 - 1)

    def to_llama(self, llama_cpp: Any, vocab: Any, seed: int) -> Any:
        """Build the llama.cpp sampler chain; the caller frees it with `llama_sampler_free`."""
        params = llama_cpp.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = llama_cpp.llama_sampler_chain_init(params)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

        def add(sampler: Any, what: str = "") -> None:
            if not sampler:
                llama_cpp.llama_sampler_free(chain)
                raise UsageError(f"llama.cpp rejected the {what or 'sampler settings'}")
            llama_cpp.llama_sampler_chain_add(chain, sampler)

        if self.logit_bias:
            biases = (llama_cpp.llama_logit_bias * len(self.logit_bias))(*self.logit_bias)
            add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(self.logit_bias), biases))
        if self.grammar is not None:
            add(llama_cpp.llama_sampler_init_grammar(vocab, self.grammar.encode(), b"root"), f"grammar from {self.grammar_origin}")
        if self.repeat_penalty != 1.0 or self.presence_penalty or self.frequency_penalty:
            last_n = self.repeat_last_n
            add(llama_cpp.llama_sampler_init_penalties(
                n_vocab, last_n, self.repeat_penalty, self.frequency_penalty, self.presence_penalty
            ))
        if self.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
        elif self.mirostat == 1:
            add(llama_cpp.llama_sampler_init_temp(self.temperature))
            add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, self.mirostat_tau, self.mirostat_eta, 100))
        elif self.mirostat == 2:
            add(llama_cpp.llama_sampler_init_temp(self.temperature))
            add(llama_cpp.llama_sampler_init_mirostat_v2(seed, self.mirostat_tau, self.mirostat_eta))
        else:
            if self.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(self.top_k))
            if self.typical_p < 1:
                add(llama_cpp.llama_sampler_init_typical(self.typical_p, 1))
            if self.top_p < 1:
                add(llama_cpp.llama_sampler_init_top_p(self.top_p, 1))
            if self.min_p > 0:
                add(llama_cpp.llama_sampler_init_min_p(self.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(self.temperature))
            add(llama_cpp.llama_sampler_init_dist(seed))
        return chain


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))


def build_grammar(
    gbnf: str | None = None,
    gbnf_file: Path | None = None,
    json_schema: str | None = None,
    json_format: bool = False,
) -> tuple[str | None, str]:
    """GBNF text from whichever of --grammar, --grammar-file, --json-schema, --format json is set.

    Returns (grammar or None, the flag it came from). A schema is a JSON document or a path to one.
    """
    chosen = [flag for flag, value in (
        ("--grammar", gbnf), ("--grammar-file", gbnf_file), ("--json-schema", json_schema), ("--format json", json_format)
    ) if value]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)} cannot be combined: choose one way to constrain the answer")
    if not chosen:
        return None, ""
    flag = chosen[0]
    if gbnf_file is not None:
        try:
            return gbnf_file.read_text(encoding="utf-8"), flag
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --grammar-file {gbnf_file}: {exc}") from None
    if gbnf is not None:
        return gbnf, flag
    from llama_cpp import llama_grammar  # pure Python: the GBNF converter that ships with llama-cpp-python

    if json_format:
        return llama_grammar.JSON_GBNF, flag
    assert json_schema is not None
    text = json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--json-schema is neither a JSON object nor a readable file: {exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema must be a JSON object (a schema)")
    try:
        gbnf_text = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise UsageError(f"--json-schema cannot be turned into a grammar: {exc}") from None
    # llama-cpp-python's converter lets raw control characters (a newline) into strings, which
    # is not JSON; llama.cpp's own converter excludes them. Exclude them here too.
    return gbnf_text.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR), flag


_LOOSE_JSON_CHAR = r'char ::= [^"\\] |'
_STRICT_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def parse_logit_bias(specs: list[str], tokenize: Any, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """`TOKEN=BIAS` pairs: TOKEN is a token id or a text that is exactly one token; BIAS a number or -inf."""
    biases = []
    for spec in specs:
        token_text, sep, bias_text = spec.rpartition("=")
        if not sep or not token_text:
            raise UsageError(f"--logit-bias {spec!r}: expected TOKEN=BIAS, e.g. 15043=-inf or 'Hello=2.5'")
        try:
            bias = float(bias_text)
        except ValueError:
            raise UsageError(f"--logit-bias {spec!r}: {bias_text!r} is not a number (or -inf)") from None
        if token_text.lstrip("-").isdigit():
            token = int(token_text)
            if not 0 <= token < n_vocab:
                raise UsageError(f"--logit-bias {spec!r}: token id {token} is outside the vocabulary (0..{n_vocab - 1})")
        else:
            tokens = tokenize(token_text)
            if len(tokens) != 1:
                raise UsageError(
                    f"--logit-bias {spec!r}: {token_text!r} is {len(tokens)} tokens {tokens}; give one token or its id"
                )
            token = tokens[0]
        biases.append((token, bias))
    return tuple(biases)
