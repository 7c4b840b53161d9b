"""`run --trace`: each step of one answer, shown as it happens — the prompt as tokens (and which part of it came from
where), the prefill, every sampled token with the candidates as the model scored them and as the sampler chain left
them, the stop, the summary — on stderr (a line a step: compact), and `--trace-json FILE` the same as JSON lines, one
event a step. The events come from the answer itself (TokenTrace, Done); this module only shows them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from llmcli.answer.events import Done, TokenTrace
from llmcli.answer.finish import described
from llmcli.errors import UsageError
from llmcli.units import counted

if TYPE_CHECKING:
    from llmcli.answer.answerer import Answerer
    from llmcli.answer.images import ImageInput
    from llmcli.pipeline import Pipeline, Request

PIECE_STYLES = ("black on grey82", "black on light_sky_blue1")  # alternating: where one token ends and the next begins
SPECIAL_STYLE = "bold magenta"
MAX_SHOWN_PROMPT = 4000  # characters of the prompt drawn (its token count and parts are always whole)


@dataclass(frozen=True)
class PromptPart:
    """A span of the rendered prompt and where it came from: the template, the system message, the history, the
    message."""

    source: str
    start: int
    end: int


@dataclass
class TraceView:
    console: Console
    top: int  # candidates shown a token
    json_out: IO[str] | None = None
    n_ctx: int = 0
    shown: list[TokenTrace] = field(default_factory=list)

    def prompt(self, tokens: list[tuple[int, str, bool]], text: str, parts: list[PromptPart], ids: bool = False) -> None:
        """The prompt stage: its tokens as pieces (id, text, control), and the parts of the text; `ids`: each piece
        followed by its id."""
        counts = {source: 0 for source in ("template", "system", "history", "message")}
        at = 0
        for _, piece, _ in tokens:
            owner = next((p.source for p in parts if p.start <= at < p.end), "template")
            counts[owner] += 1
            at += len(piece)
        self._json({"stage": "prompt", "count": len(tokens), "parts": counts,
                    "tokens": [{"id": t, "piece": piece, "special": special} for t, piece, special in tokens]})
        said = " · ".join(f"{source} {n}" for source, n in counts.items())
        self.console.rule(f"prompt · {len(tokens)} tokens ({said})", style="dim")
        drawn = Text()
        for i, (token, piece, special) in enumerate(tokens):
            if len(drawn) > MAX_SHOWN_PROMPT:
                drawn.append(f" … {len(tokens) - i} tokens more", style="dim")
                break
            shown = piece.replace("\n", "⏎\n") if not special else piece
            if ids:
                shown = shown.replace("\n", "") + f"[{token}]" + ("\n" if shown.endswith("\n") else "")
            drawn.append(shown, style=SPECIAL_STYLE if special else PIECE_STYLES[i % 2])
        self.console.print(drawn, highlight=False, markup=False)

    def token(self, trace: TokenTrace) -> None:
        """One sampled token: a line (the first also the prefill's)."""
        if trace.prefill is not None:
            prefill = trace.prefill
            self._json({"stage": "prefill", "evaluated": prefill.evaluated, "cached": prefill.cached,
                        "batches": prefill.batches, "seconds": round(prefill.seconds, 6), "kv_bytes": prefill.kv_bytes})
            self.console.rule(f"prefill · {prefill.evaluated} evaluated in {counted(prefill.batches, 'batch', 'batches')} · "
                              f"{prefill.cached} reused · {prefill.seconds:.3f} s · KV {prefill.kv_bytes / 2**20:.2f} MiB",
                              style="dim")
        self.shown.append(trace)
        piece = _text(trace.piece)
        self._json({"stage": "token", "index": trace.index, "first": trace.index == 0,
                    "chosen": {"id": trace.token, "piece": piece, "p": trace.p, "special": trace.special},
                    "how": trace.how, "seconds": round(trace.seconds, 6), "stages": [list(s) for s in trace.stages],
                    "changed": list(trace.changed), **({"note": trace.note} if trace.note else {}),
                    "candidates": [{"id": c.token, "piece": _text(c.piece), "logprob": c.logprob,
                                    "p_model": c.p_model, "p_sampler": c.p_sampler} for c in trace.candidates]})
        when = f"TTFT {trace.seconds:.3f} s" if trace.index == 0 else f"{1000 * trace.seconds:5.1f} ms"
        if not self.console.is_terminal:  # (piped: the same line as plain text, without rich's rendering a token)
            self.console.file.write(self._plain(trace, piece, when) + "\n")
            return
        line = Text(f"#{trace.index:<3} {when}  ")
        line.append(repr(piece), style=SPECIAL_STYLE if trace.special else "bold")
        line.append(f" {trace.how}" + (f" p={trace.p:.3f}" if trace.how != "argmax" else ""))
        if trace.changed:  # (before the candidates: a narrow terminal cuts the line's end)
            line.append(f"  │ {' › '.join(trace.changed)}", style="cyan")
        if trace.note:
            line.append(f"  │ {trace.note}", style="yellow")
        shown = "  ".join(f"{_text(c.piece)!r} {c.p_model:.2f}→{c.p_sampler:.2f}" for c in trace.candidates[:self.top])
        line.append(f"  │ {shown}", style="dim")
        self.console.print(line, highlight=False, markup=False, overflow="ellipsis", no_wrap=True)

    def _plain(self, trace: TokenTrace, piece: str, when: str) -> str:
        parts = [f"#{trace.index:<3} {when}  {piece!r} {trace.how}" + (f" p={trace.p:.3f}" if trace.how != "argmax" else "")]
        if trace.changed:
            parts.append(" › ".join(trace.changed))
        if trace.note:
            parts.append(trace.note)
        parts.append("  ".join(f"{_text(c.piece)!r} {c.p_model:.2f}→{c.p_sampler:.2f}" for c in trace.candidates[:self.top]))
        return "  │ ".join(parts)

    def done(self, done: Done) -> None:
        """The stop and the summary."""
        stats = done.stats
        last = self.shown[-1] if self.shown else None
        stop: dict[str, Any] = {"stage": "stop", "reason": done.finish_reason, "shown": done.text}
        said = described(done.finish_reason)
        if done.finish_reason == "stop" and last is not None and last.special:
            stop["token"] = {"id": last.token, "piece": _text(last.piece)}
            said = f"the end token {_text(last.piece)!r} (id {last.token})"
        if done.stop_sequence is not None:
            stop["stop_sequence"] = done.stop_sequence
            said = f"the stop sequence {done.stop_sequence!r} (held back, never shown)"
        self._json(stop)
        self.console.rule(f"stop · {said} · shown {len(done.text)} characters", style="dim")
        tpot = 1000 * stats.decode_s / stats.decode_steps if stats.decode_steps and stats.decode_s else None
        rate = stats.decode_steps / stats.decode_s if stats.decode_steps and stats.decode_s else None  # (decoding)
        used = stats.prompt_tokens + stats.completion_tokens
        self._json({"stage": "summary", "ttft_s": round(stats.ttft_s, 6), "tpot_ms": None if tpot is None else
                    round(tpot, 3), "tokens_per_s": None if rate is None else round(rate, 2), "kv_used": used,
                    "n_ctx": self.n_ctx})
        self.console.rule(f"summary · TTFT {stats.ttft_s:.3f} s · "
                          + (f"{tpot:.1f} ms/token · " if tpot is not None else "")
                          + (f"{rate:.1f} tok/s · " if rate is not None else "")
                          + f"KV {used}" + (f" of {self.n_ctx} cells" if self.n_ctx else " cells"), style="dim")

    def _json(self, event: dict[str, Any]) -> None:
        if self.json_out is not None:
            self.json_out.write(json.dumps(event, ensure_ascii=False) + "\n")
            self.json_out.flush()


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def prompt_parts(text: str, system: str | None, history: list[str], message: str | None) -> list[PromptPart]:
    """Where each part of a rendered prompt came from: the system message's text, each earlier message's, the
    message's (its last occurrence); the rest is the template's."""
    parts: list[PromptPart] = []
    at = 0
    for source, content in (("system", system), *(("history", h) for h in history)):
        if content:
            found = text.find(content, at)
            if found >= 0:
                parts.append(PromptPart(source, found, found + len(content)))
                at = found + len(content)
    if message:
        found = text.rfind(message)
        if found >= at:
            parts.append(PromptPart("message", found, found + len(message)))
    return parts


def open_trace(pipeline: Pipeline[Answerer], request: Request, text: str | None, images: tuple[ImageInput, ...],
               top: int, console: Console, json_path: Path | None = None, ids: bool = False) -> TraceView:
    """A trace's view with its prompt stage shown: the prompt of `text` after the conversation, as the model will
    read it, token by token (run --trace, chat's /trace on). The JSON file is opened once the prompt is known (a
    prompt refused leaves no file)."""
    from llmcli.pipeline import shown_prompt
    from llmcli.pipeline.local import open_tokenizer
    from llmcli.prompt.chat_template import default_system

    shown = shown_prompt(pipeline, request, text, None, images)
    out = None
    if json_path is not None:
        try:
            out = json_path.open("w", encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--trace-json {json_path}: {exc.strerror or exc}") from None
    view = TraceView(console, top, out, shown.n_ctx)
    with open_tokenizer(request) as tokenizer:
        vocab = tokenizer.vocabulary.vocab
        tokens = [(t, vocab.piece(t, special=True).decode("utf-8", "replace") if t >= 0 else "<image>",
                   t >= 0 and vocab.is_control(t)) for t in shown.rendered.tokens]
        system = pipeline.settings["system"] or (default_system(tokenizer.template, vocab.bos_text, vocab.eos_text)
                                                 if tokenizer.template is not None else None)
    whole = "".join(piece for _, piece, _ in tokens)
    history = [m.content for m in pipeline.session.history if isinstance(m.content, str)]
    view.prompt(tokens, whole, prompt_parts(whole, system, history, text), ids)
    return view
