"""What a benchmark measures (light: the CLI reads its defaults without loading llama.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

from llmcli.config.settings import default


@dataclass(frozen=True)
class BenchPlan:
    prompt_tokens: int = 512
    gen_tokens: int = 128
    repetitions: int = 5
    threads: tuple[int, ...] = ()  # empty: one per physical core
    depths: tuple[int, ...] = (0,)
    n_batch: int = default("batch_size")
    batch_sizes: tuple[int, ...] = ()  # prefill measured at each of these batch sizes too (-b 64,512)
    parallel: tuple[int, ...] = ()  # sequences decoded together (aggregate decode rate), e.g. (1, 8)
    contention: bool = False  # two llmcli processes decoding at once: shared cores vs every core each
    busy: int = 0  # also decode while this many other processes keep a core busy: default threads vs each fixed count
    cache_lengths: tuple[int, ...] = ()  # prompt lengths for TTFT cold vs warm (prompt cache), e.g. (512, 2048)
    kv_types: tuple[str, ...] = ()  # KV cache types to compare (speed and memory), e.g. ("f16", "q8_0")
    speculation: bool = False  # pass costs, and decoding with and without drafts (grounded and ungrounded)
    image: str | None = None  # a picture: its encoding and the TTFT of a question about it (models that see)
    sampling: bool = False  # what choosing a token costs in the decode loop: plain, --logprobs 5, --trace
