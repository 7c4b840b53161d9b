"""One answer's preparation, the same on every path: a rendered prompt fitted to the context and the options the engine
answers it with. `Session.ask` (run and chat in this process), `--batch`'s items and `serve`'s requests (every
protocol, the warm runs' and chats' too) all go through `prepare`: the input too long for the context refused, or its
start cut (--on-overflow truncate); -n capped to the room the prompt leaves, said in one notice; the options for this
turn (the call preference for the user's words) and this prompt (a think block it opened, a forced call that may
think first).

Each path brings what it alone knows: how it renders (a session's history, a request's messages or raw prompt), the
settings behind its options (the CLI's, a request's over the server's), and what it does with the result (a slot, a
queue). Pure: no llama.cpp (the rendering is the caller's callable).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from llmcli.answer.answerer import RenderedPrompt
from llmcli.answer.context_budget import (
    MAX_CHARS_PER_TOKEN,
    answer_room,
    capped,
    overflow,
    truncated,
    truncation_notice,
)
from llmcli.answer.generation import GenerationOptions
from llmcli.errors import ResourceError

# The prompt with this text as its new message's (None: no new message — the history ends with tool results, or the
# prompt is not text)
Render = Callable[[str | None], RenderedPrompt]


@dataclass(frozen=True)
class Context:
    n_ctx: int  # prompt + answer
    n_ctx_train: int = 0  # what the model was trained on (0: it does not say): a too-long prompt's hint


@dataclass(frozen=True)
class Prepared:
    text: str | None  # the new message's text as it is asked (its start cut by --on-overflow truncate)
    prompt: RenderedPrompt  # the whole prompt: its text and tokens
    generation: GenerationOptions  # for this turn and prompt; -n capped to the room the prompt leaves
    notices: tuple[str, ...] = ()  # what the asker should know (the input truncated, -n capped)
    truncated: bool = False


def prepare(render: Render, text: str | None, generation: GenerationOptions, context: Context, *,
            truncate: bool = False, template_source: str | None = None,
            count: Callable[[str], int] | None = None, begun: RenderedPrompt | None = None) -> Prepared:
    """The prompt `render(text)` fitted to `context`, and `generation` for it; ResourceError when it does not fit.
    `truncate`: the fewest leading characters of `text` dropped until the prompt and room for the answer fit (a
    text longer than any context could hold is cut to n_ctx * MAX_CHARS_PER_TOKEN characters before it is rendered);
    without it such a text is refused at once, counted by `count` (its tokens). `begun`: the start of the answer
    already given (a warm server began it and went away): it follows the prompt and counts against -n."""
    n_ctx = context.n_ctx
    too_long = text is not None and len(text) > n_ctx * MAX_CHARS_PER_TOKEN  # cannot fit: cut before it is rendered
    if text is not None and too_long and not truncate:
        raise overflow(count(text) if count is not None else len(text), generation.max_tokens, n_ctx,
                       context.n_ctx_train)
    kept = text[-n_ctx * MAX_CHARS_PER_TOKEN :] if text is not None and too_long else text
    prompt = render(kept)
    notices: list[str] = []
    cut = False
    if kept is not None and truncate and (too_long or len(prompt.tokens) + (generation.max_tokens or 1) > n_ctx):
        kept, prompt = _truncated(render, kept, generation.max_tokens, context)
        notices.append(truncation_notice(n_ctx, text or "", kept, len(prompt.tokens)))
        cut = True
    if len(prompt.tokens) >= n_ctx:  # (no room for one token of an answer)
        raise overflow(len(prompt.tokens), generation.max_tokens, n_ctx, context.n_ctx_train)
    generation = generation.for_turn(kept)  # (None: the history ends with tool results)
    max_tokens, notice = capped(generation.max_tokens, len(prompt.tokens), n_ctx)
    if notice is not None and not cut:  # -n past the context: capped
        notices.append(notice)
        generation = dataclasses.replace(generation, max_tokens=max_tokens)
    if begun is not None and begun.tokens:
        prompt = RenderedPrompt(prompt.text + begun.text, [*prompt.tokens, *begun.tokens])
        if generation.max_tokens:
            generation = dataclasses.replace(generation, max_tokens=max(1, generation.max_tokens - len(begun.tokens)))
    generation = generation.for_prompt(prompt.text, template_source)
    return Prepared(kept, prompt, generation, tuple(notices), cut)


def _truncated(render: Render, text: str, max_tokens: int | None, context: Context) -> tuple[str, RenderedPrompt]:
    """The end of `text` whose prompt leaves room for the answer; ResourceError when not even its last character
    does."""
    n_ctx = context.n_ctx
    best = truncated(text, render, lambda prompt: len(prompt.tokens), n_ctx - answer_room(max_tokens, n_ctx))
    if best is not None:
        return best
    empty = len(render("").tokens)
    if max_tokens and empty < n_ctx:  # -n leaves no room for the message
        raise overflow(empty, max_tokens, n_ctx, context.n_ctx_train, can_truncate=False)
    raise ResourceError(
        f"the system prompt and history take {empty} tokens: no room is left for the message in the context of "
        f"{n_ctx} tokens", hint="Use a shorter --system, /clear in a chat, or a larger --ctx-size.")
