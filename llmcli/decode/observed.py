"""What a slot's answer shows beyond its text, when it is asked for: the prompt's own log-probabilities (a
completion's `echo`: each evaluated prompt token's logits score the token after it) and a traced token's event
(`--trace`: how it was chosen, its candidates, and for the first one the prefill). The scheduler calls these after a
pass and after each traced sample; nothing here runs unless an answer asked."""

from __future__ import annotations

from llmcli.answer.events import PrefillTrace, TokenTrace
from llmcli.decode.step_plan import Chunk, Slot
from llmcli.llama.engine import Engine
from llmcli.llama.logprobs import token_logprob
from llmcli.llama.traced_token import Traced


def score_chunk(engine: Engine, chunk: Chunk, row: int) -> None:
    """The chunk's prompt tokens, evaluated from batch row `row` on, score each next prompt token into the slot's
    `scores`."""
    slot, vocab = chunk.slot, engine.vocab
    assert slot.scores is not None and slot.options.prompt_logprobs is not None
    n_top, ctx = slot.options.prompt_logprobs, engine.llama_context
    for pos in range(chunk.begin, min(chunk.end, len(slot.prompt) - 1)):
        slot.scores.append(token_logprob(ctx, vocab, row + pos - chunk.begin, slot.prompt[pos + 1], n_top))


def token_trace(engine: Engine, slot: Slot, token: int, traced: Traced, now: float) -> TokenTrace:
    """A traced token's event: its time (`now`) since the last one (the first: since the request, with the
    prefill)."""
    clock, vocab = slot.clock, engine.vocab
    since = clock.last_token or clock.prefill_done or clock.prefill_started or now
    prefill = None
    if not slot.sampled:
        started = clock.prefill_started or now
        prefill = PrefillTrace(slot.prefilled - slot.cached, slot.cached, (clock.prefill_done or now) - started,
                               engine.kv.seq_bytes(slot.seq), slot.prefill_passes)
        since = clock.submitted
    return TokenTrace(slot.sampled, token, vocab.piece(token, special=True), vocab.is_control(token), traced.how,
                      traced.p, traced.candidates, traced.stages, traced.changed, now - since, traced.note, prefill)
