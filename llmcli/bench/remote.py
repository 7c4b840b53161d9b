"""`llmcli bench --endpoint URL`: a remote engine measured from here — time to first token, the decode rate of one
answer (client-side: text chunks over time, the server's token count when it sends one), and the aggregate rate
of N answers at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.bench.measure import TTFT_PROMPT
from llmcli.bench.rows import Row
from llmcli.remote.session import RemoteSession, exchange


def endpoint_rows(session: RemoteSession, generation: GenerationOptions, gen_tokens: int, repetitions: int,
                  parallel: tuple[int, ...], row: Callable[[str, str, str], Row]) -> Iterator[str]:
    generation = replace(generation, max_tokens=gen_tokens)

    def answer(index: int) -> Done:
        *_, done = exchange(session, f"{TTFT_PROMPT} ({index})", generation, [])
        assert isinstance(done, Done)
        return done

    answer(0)  # warm-up: the server loads, pages in, builds its graphs
    ttft, decode = row("ttft", "endpoint", "s"), row(f"tg{gen_tokens}", "endpoint", "t/s")
    together = {n: row(f"tg{gen_tokens} x{n}", "endpoint, aggregate", "t/s") for n in parallel if n > 1}
    for repetition in range(repetitions):
        done = answer(repetition + 1)
        ttft.samples.append(done.stats.ttft_s)
        decode.samples.append(done.stats.decode_tps)
        yield "ttft, decode"
        for n, target in together.items():
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                results = list(pool.map(answer, range(n)))
            target.samples.append(sum(r.stats.completion_tokens for r in results) / (time.perf_counter() - started))
            yield target.test
