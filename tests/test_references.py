"""Hub reference parsing, validation and quant choice: pure units, no network."""

from __future__ import annotations

import pytest

from llmcli.errors import UsageError
from llmcli.store.references import Choice, HubReference, choices, parse, quant_of, select


@pytest.mark.parametrize(
    "text, expected",
    [
        ("owner/repo", HubReference("owner/repo")),
        ("owner/repo:q4_k_m", HubReference("owner/repo", quant="Q4_K_M")),
        ("hf.co/owner/repo:Q8_0", HubReference("owner/repo", quant="Q8_0")),
        ("https://huggingface.co/owner/repo", HubReference("owner/repo")),
        ("owner/repo/sub/model-Q4_0.gguf", HubReference("owner/repo", filename="sub/model-Q4_0.gguf")),
        ("owner/repo:Q4_K_M@v1.2", HubReference("owner/repo", quant="Q4_K_M", revision="v1.2")),
        ("owner/repo/file.gguf@0123abc", HubReference("owner/repo", filename="file.gguf", revision="0123abc")),
    ],
)
def test_valid_references(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "owner/../repo", "../owner/repo", "owner/repo/../x.gguf", "owner/repo//x.gguf", "owner/repo/x.bin",
        "owner/repo@..", "owner/repo:Q4/..", "own\0er/repo", "owner\\repo/x", "o" * 200 + "/repo",
        "owner/re--po", "owner/repo/a.gguf:Q4_K_M", "owner/repo@/etc",
    ],
)
def test_unsafe_or_malformed_references_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse(text)


@pytest.mark.parametrize(
    "name, quant",
    [
        ("SmolLM2-135M-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
        ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
        ("model.F16.gguf", "F16"),
        ("big-Q4_K_M-00002-of-00003.gguf", "Q4_K_M"),
        ("model.gguf", None),
    ],
)
def test_quant_of_file_names(name, quant):
    assert quant_of(name) == quant


def test_choices_group_shards_and_skip_projectors_and_incomplete_sets():
    names = [
        "m-Q4_K_M.gguf", "mmproj-m-f16.gguf",
        "big-Q8_0-00002-of-00002.gguf", "big-Q8_0-00001-of-00002.gguf",
        "half-Q6_K-00001-of-00003.gguf",
    ]
    found = choices(names)
    assert Choice(("big-Q8_0-00001-of-00002.gguf", "big-Q8_0-00002-of-00002.gguf"), "Q8_0") in found
    assert [c.first for c in found] == ["big-Q8_0-00001-of-00002.gguf", "m-Q4_K_M.gguf"]


def test_select_prefers_q4_k_m_then_the_documented_order():
    found = choices(["m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q2_K.gguf"])
    assert select(found, None, "o/r").quant == "Q4_K_M"
    assert select(choices(["m-Q8_0.gguf", "m-Q6_K.gguf"]), None, "o/r").quant == "Q6_K"
    with pytest.raises(LookupError, match="available: Q2_K, Q4_K_M, Q8_0"):
        select(found, "Q5_K_M", "o/r")
    with pytest.raises(LookupError, match="holds several models"):
        select(choices(["a-Q3_K_XL.gguf", "b-IQ2_M.gguf"]), None, "o/r")
    assert select(choices(["only.gguf"]), None, "o/r").first == "only.gguf"
