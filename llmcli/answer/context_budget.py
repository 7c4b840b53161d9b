"""When a prompt and its answer do not fit the context: the one message that names the real cause (the prompt, or
-n) and a fix that works within what the model was trained on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from llmcli.errors import ResourceError
from llmcli.units import counted

MAX_CHARS_PER_TOKEN = 64  # no vocabulary's token is longer: a message of more than n_ctx times this cannot fit
Rendered = TypeVar("Rendered")


def answer_room(max_tokens: int | None, n_ctx: int) -> int:
    """Tokens kept free for the answer: -n, else a quarter of the context (at most 256)."""
    return max_tokens or min(256, n_ctx // 4)


def capped(max_tokens: int | None, n_prompt: int, n_ctx: int) -> tuple[int | None, str | None]:
    """-n past what the context leaves after a prompt that fits: the answer stops where the context is full, said
    in one notice (None: -n as asked). The one rule for run, chat, --batch, a warm run and serve."""
    room = n_ctx - n_prompt
    if max_tokens and max_tokens > room > 0:
        return room, (f"-n {max_tokens} is more than the context has left after the prompt: the answer stops at {room} "
                      "tokens")
    return max_tokens, None


def truncated(text: str, render: Callable[[str], Rendered], size: Callable[[Rendered], int],
              budget: int) -> tuple[str, Rendered] | None:
    """--on-overflow truncate: the end of `text` whose prompt (`render`, of `size` tokens) fits `budget` tokens —
    the fewest leading characters dropped (a binary search: log2(len) renderings; callers cut a text longer than
    n_ctx * MAX_CHARS_PER_TOKEN first) — with its prompt; None when not even its last character fits. The one rule
    for run, chat, a warm run and serve."""
    low, high = 0, len(text)
    best = None
    while low <= high:
        drop = (low + high) // 2
        candidate = render(text[drop:])
        if size(candidate) <= budget:
            best, high = (text[drop:], candidate), drop - 1
        else:
            low = drop + 1
    return best


def truncation_notice(n_ctx: int, whole: str, left: str, prompt_tokens: int) -> str:
    return (f"input truncated to fit the context of {n_ctx} tokens: dropped the first {len(whole) - len(left):,} of "
            f"the message's {len(whole):,} characters; the prompt is now {prompt_tokens} tokens")


def _ctx_for(needed: int, n_ctx_train: int) -> int:
    """The --ctx-size to suggest: a power of two that holds `needed`, never past the trained context."""
    size = 1 << max(8, (needed - 1).bit_length())
    return min(size, n_ctx_train) if n_ctx_train else size


def overflow(n_prompt: int, max_tokens: int | None, n_ctx: int, n_ctx_train: int, *, reserve: int = 1,
             can_truncate: bool = True) -> ResourceError:
    """`n_prompt` tokens plus `max_tokens` (else `reserve`, the room a chat keeps for an answer) do not fit `n_ctx`:
    why, and what to do. `can_truncate`: --on-overflow truncate would help (it drops the start of the input)."""
    limit = n_ctx_train or None  # 0: the model does not say
    if max_tokens and n_prompt < n_ctx:  # the prompt fits: -n is what does not
        room = n_ctx - n_prompt
        fixes = [f"-n {room} or less", "no -n (the answer stops when the context is full)"]
        if limit is None or n_prompt + max_tokens <= limit:
            fixes.insert(1, f"--ctx-size {_ctx_for(n_prompt + max_tokens, n_ctx_train)}")
        return ResourceError(f"-n {max_tokens} does not fit: the prompt takes {n_prompt} of the context's {n_ctx} tokens, "
                             f"leaving {room} for the answer", hint="Use " + ", ".join(fixes[:-1]) + f", or {fixes[-1]}.")
    needed = n_prompt + (max_tokens or reserve)
    truncate = ", or --on-overflow truncate (keeps the end of the input)" if can_truncate else ""
    message = f"the prompt is {n_prompt} tokens; the context holds {n_ctx}" + (
        f", {reserve} of them kept for the answer" if not max_tokens and reserve > 1 else "")
    if limit is None or needed <= limit:
        trained = f" (the model was trained on {limit})" if limit else ""
        return ResourceError(message, hint=f"Use --ctx-size {_ctx_for(needed, n_ctx_train)}{trained}, a shorter input"
                             f"{truncate}.")
    widest = f" --ctx-size {limit} keeps the most of it." if can_truncate and n_ctx < limit else ""
    return ResourceError(f"{message}, and the model reads at most {limit} (its trained context)",
                         hint=f"Use a shorter input{truncate}.{widest}")


def dropped_notice(dropped: int, how: str = "") -> str:
    """What a chat says when it dropped its oldest exchanges to fit the context (`how`: what became of their KV)."""
    return f"context nearly full: dropped the {counted(dropped, 'oldest exchange')} (the system prompt is kept){how}"
