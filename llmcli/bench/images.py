"""`bench --image PATH`: what a picture costs a model that sees — its encoding alone, and the time to the first token
of a question about it cold (encoded now), with its embeddings kept (a new conversation about the same picture), and
with its KV cells kept (the next question in the same conversation)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from llmcli.answer.events import Done
from llmcli.answer.generation import GenerationOptions
from llmcli.answer.image_bytes import read_image
from llmcli.answer.sampling_config import greedy_without_end
from llmcli.bench.rows import Row
from llmcli.chat.session import Session
from llmcli.llama.engine import Engine
from llmcli.llama.engine_config import EngineConfig

QUESTION = "Describe this picture in one sentence."


def image_rows(model: Path, projector: Path, image: str, threads: int, n_batch: int, repetitions: int,
               row: Callable[..., Row]) -> Iterator[str]:
    """Rows for `image` asked of `model` with `projector` (loaded once; the first question warms it up)."""
    picture = read_image(image)
    with Engine(model, EngineConfig(n_ctx=4096, n_threads=threads, n_batch=n_batch)) as engine:
        engine.use_projector(projector)
        session = Session(engine)
        generation = GenerationOptions(greedy_without_end(engine.vocab.end_of_generation_tokens()), 1, speculate="off")

        def ask(keep_embeddings: bool, keep_cells: bool) -> Done:
            vision = engine.load_vision()
            if not keep_embeddings:
                vision.forget_embeddings()
            if not keep_cells:
                engine.kv.clear()
            session.history.clear()
            return next(e for e in session.ask(QUESTION, generation, images=(picture,)) if isinstance(e, Done))

        ask(False, False)  # warm-up: the projector's graphs, the weights paged in
        encode = row("image encode", f"{picture.width}x{picture.height}", "s")
        cold = row("ttft + image", "encoded now", "s")
        kept = row("ttft + image", "embeddings kept", "s")
        cached = row("ttft + image", "KV cells kept", "s")
        for _ in range(repetitions):
            done = ask(False, False)
            encode.samples.append(done.stats.image_s)
            cold.samples.append(done.stats.ttft_s)
            yield "image, encoded now"
            kept.samples.append(ask(True, False).stats.ttft_s)
            yield "image, embeddings kept"
            cached.samples.append(ask(True, True).stats.ttft_s)
            yield "image, KV cells kept"
