"""Bench rows for speculative decoding: what a pass of n tokens costs against a 1-token pass (the cost
model's input), and decode rates with and without drafting on a grounded task (the text is copied back:
prompt lookup drafts from it) and an ungrounded one (a story: little to copy, `auto` must not lose).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from llmcli.answer.answerer import PromptOptions
from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.sampling_config import SamplingConfig
from llmcli.bench.rows import Row
from llmcli.chat.session import Session
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig

PASS_SIZES = tuple(range(1, 17))  # the cost of a k-token pass for k = 1 ... 16
GROUNDED = (  # about 450 tokens: a 256-token answer that copies it stays inside it
    "The history of the lighthouse at the northern cape begins in the winter of the great storm, when three fishing "
    "boats were lost on the rocks below the cliff. The villagers gathered in the church hall and agreed that a light "
    "must be built before the next winter. The mayor wrote to the harbour board, the harbour board wrote to the "
    "ministry, and the ministry sent an engineer named Clara Holm, who arrived in the spring with a trunk of drawings "
    "and a very old dog.\nClara walked the cliff for a week before she chose the place. She wanted the tower to stand "
    "on the hard grey stone, not on the softer red rock that the sea had been eating for centuries. The builders "
    "complained that the grey stone was further from the road, but she showed them the cracks in the red rock and "
    "they stopped complaining. The foundations were laid in June, the walls rose through the summer, and by the "
    "first autumn gales the lamp room was glazed and the great lens had been carried up the stairs piece by piece.\n"
    "The first keeper was a retired sailor called Tomas, who kept a careful log of every ship he saw. His log records "
    "the weather each morning and evening, the oil burned each night, and the names of the ships that passed close "
    "enough to read. In the first year he counted four hundred and twelve ships, and not one of them was lost on the "
    "rocks below the cliff. The villagers said that the light had paid for itself in the first month, and the "
    "harbour board agreed.\nWhen electricity reached the cape, the oil lamp was replaced by a bulb and the keeper's "
    "cottage was turned into a small museum. Visitors can still climb the stairs to the lamp room, read the pages of "
    "the log, and look out over the water where the three boats were lost. On clear nights the light can be seen "
    "from the far side of the bay, turning slowly, as it has every night for more than a century."
)
GROUNDED_PROMPT = GROUNDED + "\n\nThe same text, copied again word for word:\n\n"
UNGROUNDED_PROMPT = "Once upon a time, in a small village by the sea, there lived a girl who"


def pass_cost_rows(path: Path, threads: int, n_batch: int, depth: int, repetitions: int,
                   row: Callable[..., Row]) -> Iterator[str]:
    """The time of a pass of n tokens (logits for each, as a draft's verification) over a 1-token pass."""
    with Engine(path, EngineConfig(n_ctx=depth + 64, n_threads=threads, n_batch=n_batch)) as engine:
        tokens = engine.vocab.tokenize(GROUNDED * (depth // 150 + 2), add_special=True)[: depth + max(PASS_SIZES)]
        engine.prefill(tokens[:depth])
        times: dict[int, list[float]] = {n: [] for n in PASS_SIZES}
        for _ in range(repetitions):
            for n in PASS_SIZES:
                started = time.perf_counter()
                engine.evaluate(tokens[depth : depth + n], all_logits=n > 1)
                times[n].append(time.perf_counter() - started)
                engine.kv.remove(0, depth, -1)
            yield "pass costs"
        one = statistics.median(times[1])
        for n in PASS_SIZES[1:]:
            row(f"pass of {n} @ d{depth}", "speculative", "x").samples.extend(t / one for t in times[n])


def speculation_rows(path: Path, threads: int, n_batch: int, gen_tokens: int, repetitions: int,
                     row: Callable[..., Row]) -> Iterator[str]:
    """Decode rates, drafting vs not, on the grounded and the ungrounded task (raw prompts: no template)."""
    with Engine(path, EngineConfig(n_ctx=1024 + gen_tokens, n_threads=threads, n_batch=n_batch)) as engine:
        session = Session(engine, PromptOptions(raw=True))
        plain = GenerationOptions(SamplingConfig(temp=0), gen_tokens, repetition_guard=False)
        for task, prompt, modes in (("grounded", GROUNDED_PROMPT, ("off", "lookup", "auto")),
                                    ("ungrounded", UNGROUNDED_PROMPT, ("off", "auto"))):
            rows = {mode: row(f"tg{gen_tokens} {task}", f"speculate {mode}", "t/s") for mode in modes}
            acceptance = {mode: row(f"acceptance {task}", f"speculate {mode}", "%") for mode in modes if mode != "off"}
            for _ in range(repetitions):
                for mode in modes:
                    options = replace(plain, speculate=mode)
                    session.history.clear()  # the prompt's cached KV is kept: only the answers are timed
                    done = next(e for e in session.ask(prompt, options) if isinstance(e, Done))
                    rows[mode].samples.append(done.stats.decode_tps)
                    if mode in acceptance:
                        acceptance[mode].samples.append(100 * done.stats.acceptance)
                    yield f"{task} {mode}"
            for mode in modes[1:]:
                ratio = rows[mode].mean / rows["off"].mean if rows["off"].mean else 0.0
                row(f"speed-up {task}", f"speculate {mode} / off", "x").samples.append(ratio)
