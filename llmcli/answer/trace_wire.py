"""A traced token on the wire, both ways (`run --trace` through llmcli's servers): what `serve` writes in an SSE
comment `trace {…}` (other clients skip comments) and what the warm client reads back into the same event. Plain data,
no HTTP."""

from __future__ import annotations

from typing import Any

from llmcli.answer.events import Candidate, PrefillTrace, TokenTrace

MAX_TRACE_TOP = 50  # candidates a traced token may carry (run --trace-top's limit)


def trace_wire(trace: TokenTrace) -> dict[str, Any]:
    """A traced token as llmcli serve sends it (an SSE comment `trace {…}`: other clients skip it); pieces in hex
    (a piece may be part of a character)."""
    found: dict[str, Any] = {
        "index": trace.index, "token": trace.token, "piece": trace.piece.hex(), "special": trace.special,
        "how": trace.how, "p": trace.p, "stages": [list(stage) for stage in trace.stages], "changed": list(trace.changed),
        "seconds": trace.seconds, "note": trace.note,
        "candidates": [[c.token, c.piece.hex(), c.logprob, c.p_model, c.p_sampler] for c in trace.candidates]}
    if trace.prefill is not None:
        found["prefill"] = [trace.prefill.evaluated, trace.prefill.cached, trace.prefill.seconds, trace.prefill.kv_bytes,
                            trace.prefill.batches]
    return found


def trace_of(wire: Any) -> TokenTrace | None:
    """A traced token read back (None: not the shape `trace_wire` writes)."""
    try:
        prefill = wire.get("prefill")
        candidates = wire["candidates"]
        if not isinstance(candidates, list) or len(candidates) > 2 * MAX_TRACE_TOP + 1:
            return None
        return TokenTrace(
            int(wire["index"]), int(wire["token"]), bytes.fromhex(wire["piece"]), bool(wire["special"]), str(wire["how"]),
            float(wire["p"]), tuple(Candidate(int(t), bytes.fromhex(piece), float(lp), float(pm), float(ps))
                                    for t, piece, lp, pm, ps in candidates),
            tuple((str(name), int(kept)) for name, kept in wire["stages"]), tuple(str(n) for n in wire["changed"]),
            float(wire["seconds"]), str(wire.get("note") or ""),
            PrefillTrace(int(prefill[0]), int(prefill[1]), float(prefill[2]), int(prefill[3]), int(prefill[4]))
            if prefill else None)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return None
