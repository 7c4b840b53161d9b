"""Options shared by several commands, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m",
        help="A .gguf path or an installed model name. Default: $LLMCLI_MODEL, else the first GGUF shipped by an installed package.",
    ),
]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as-is, without the chat template (base models).")]
TemplateFileOpt = Annotated[
    Optional[Path],
    typer.Option("--chat-template-file", help="A Jinja chat template to use instead of the model's.", dir_okay=False),
]
TempOpt = Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature; 0 picks the most likely token (greedy).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, max=2**32 - 1, help="Random seed; the same seed repeats a sampled answer. Default: random.")]
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", "-n", min=1, help="Stop after this many tokens. Default: until the model stops or the context is full.")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when the answer contains this text (never printed). Repeatable.")]
CtxSizeOpt = Annotated[Optional[int], typer.Option("--ctx-size", "-c", min=16, help="Context window in tokens. Default: the model's, capped at 4096.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="CPU threads. Default: one per physical core.")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Prompt tokens evaluated per step.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log on stderr.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Do not print the stats line on stderr.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (text, finish reason, token counts, timings) on stdout.")]
