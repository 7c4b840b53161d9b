"""Options shared by several commands, declared once.

Settings options default to None ("not given") so that the precedence rule
(flag > env > profile > config file > model > built-in, see llmcli/settings.py)
can tell a flag from a default; their built-in defaults are in the help text.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

SAMPLING = "Sampling"
ENGINE = "Engine"
OUTPUT = "Output"

def complete_model(incomplete: str) -> list[str]:
    """Shell completion for model names: installed models, aliases, the cache."""
    from llmcli import catalog
    from llmcli.settings import load_config_file

    try:
        aliases = load_config_file().get("aliases", {})
    except Exception:  # a broken config file must not break the shell's completion
        aliases = {}
    return [name for name in catalog.known_names(aliases) if name.lower().startswith(incomplete.lower())]


ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m",
        help="A .gguf path, OWNER/REPO[:QUANT] from Hugging Face, an alias or an installed model. "
        "Default: $LLMCLI_MODEL, the config file, else the first GGUF shipped by an installed package.",
        show_default=False,
        autocompletion=complete_model,
    ),
]
ProfileOpt = Annotated[Optional[str], typer.Option("--profile", "-p", help="Use a [profiles.NAME] table of the config file ($LLMCLI_PROFILE).", show_default=False)]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Use only the local cache; never contact the Hub ($HF_HUB_OFFLINE=1).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Skip the check that the model and its KV cache fit in memory.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.", show_default=False)]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as-is, without the chat template (base models).")]
TemplateFileOpt = Annotated[
    Optional[Path],
    typer.Option("--chat-template-file", help="A Jinja chat template to use instead of the model's.", dir_okay=False, show_default=False),
]


def _opt(*names: str, help: str, kind: Any = Optional[float], panel: str = SAMPLING) -> Any:
    return Annotated[kind, typer.Option(*names, help=help, show_default=False, rich_help_panel=panel)]


TempOpt = _opt("--temp", help="Temperature; 0 picks the most likely token (greedy). [0.8]")
TopKOpt = _opt("--top-k", help="Keep the K most likely tokens; 0 disables. [40]", kind=Optional[int])
TopPOpt = _opt("--top-p", help="Keep the smallest set of tokens whose probability sums to P, in (0, 1]. [0.95]")
MinPOpt = _opt("--min-p", help="Drop tokens less likely than P times the most likely one. [0.05]")
TypicalPOpt = _opt("--typical-p", help="Locally typical sampling, in (0, 1]; 1 disables. [1.0]")
RepeatPenaltyOpt = _opt("--repeat-penalty", help="Penalise repeated tokens; 1 disables. [1.0]")
RepeatLastNOpt = _opt("--repeat-last-n", help="How many recent tokens the penalties look at; -1 the whole context. [64]", kind=Optional[int])
PresencePenaltyOpt = _opt("--presence-penalty", help="Penalise tokens that already appeared. [0]")
FrequencyPenaltyOpt = _opt("--frequency-penalty", help="Penalise tokens by how often they appeared. [0]")
MirostatOpt = _opt("--mirostat", help="Mirostat sampling: 0 off, 1 or 2 (replaces top-k/p, min-p). [0]", kind=Optional[int])
MirostatTauOpt = _opt("--mirostat-tau", help="Mirostat target entropy. [5.0]")
MirostatEtaOpt = _opt("--mirostat-eta", help="Mirostat learning rate. [0.1]")
SeedOpt = _opt("--seed", help="Random seed; the same seed repeats a sampled answer. [random]", kind=Optional[int])
LogitBiasOpt = _opt("--logit-bias", help="TOKEN=BIAS: add BIAS to a token's logit (id or one-token text; -inf bans it). Repeatable.", kind=Optional[list[str]])
MaxTokensOpt = _opt("--max-tokens", "-n", help="Stop after this many tokens. [until the model stops or the context is full]", kind=Optional[int])
StopOpt = _opt("--stop", help="Stop when the answer contains this text (never printed). Repeatable.", kind=Optional[list[str]])
GrammarOpt = _opt("--grammar", help="Constrain the answer with a GBNF grammar (root rule: root).", kind=Optional[str])
GrammarFileOpt = _opt("--grammar-file", help="Constrain the answer with the GBNF grammar in FILE.", kind=Optional[Path])
JsonSchemaOpt = _opt("--json-schema", help="Constrain the answer to JSON matching this schema (JSON text or a file).", kind=Optional[str])
FormatOpt = _opt("--format", help="`json`: the answer is always valid JSON.", kind=Optional[str])
OnOverflowOpt = _opt("--on-overflow", help="When the prompt does not fit the context: error, or truncate (keep the system prompt and the end of the input). [error]", kind=Optional[str])

CtxSizeOpt = _opt("--ctx-size", "-c", help="Context window in tokens. [the model's, capped at 4096]", kind=Optional[int], panel=ENGINE)
ThreadsOpt = _opt("--threads", "-t", help="CPU threads. [one per physical core]", kind=Optional[int], panel=ENGINE)
BatchSizeOpt = _opt("--batch-size", "-b", help="Prompt tokens evaluated per step. [512]", kind=Optional[int], panel=ENGINE)
MlockOpt = Annotated[Optional[bool], typer.Option("--mlock/--no-mlock", help="Keep the weights in RAM. [off]", show_default=False, rich_help_panel=ENGINE)]
MmapOpt = Annotated[Optional[bool], typer.Option("--mmap/--no-mmap", help="Map the model file instead of reading it. [on]", show_default=False, rich_help_panel=ENGINE)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log on stderr.", rich_help_panel=ENGINE)]

QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Do not print the stats line on stderr.", rich_help_panel=OUTPUT)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (text, finish reason, token counts, timings) on stdout.", rich_help_panel=OUTPUT)]


def borrow_options(target: Callable[..., Any], source: Callable[..., Any], names: Iterable[str],
                   extra: Iterable[inspect.Parameter] = ()) -> Callable[..., Any]:
    """Give `target(**given)` the options `names` of `source`, plus `extra`: declared once, in `source`.

    Typer reads a command's options from its signature, so `chat` and `config show` take
    exactly the settings flags of `run` without repeating two dozen declarations.
    """
    wanted = set(names)
    params = [p for name, p in inspect.signature(source, eval_str=True).parameters.items() if name in wanted]
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in [*params, *extra]]
    target.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    target.__annotations__ = {p.name: p.annotation for p in params}
    return target


def option(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
