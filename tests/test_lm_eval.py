"""lm-evaluation-harness scores against `llmcli serve`, offline (issue 60, item 1): `/v1/completions` with `echo`
gives the prompt's tokens and their log-probabilities, and vLLM's tokenizer routes give the harness the model's own
tokenizer. The harness (~760 MB installed) is not a test dependency: tests/data/lm_eval/requests.json holds what
lm-eval 0.4.13 sent to a server on SmolLM2 (captured by tests/data/lm_eval/capture.py, which runs the real harness),
and these tests replay it — the same bodies, scored by the harness's own rule (the sum of the continuation's
token_logprobs; its accuracy: the choice of highest sum) — against llama.cpp's logits computed independently.

Greedy numbers differ between CPUs and KV layouts: the server's and the independent computation's log-probabilities
are compared within a tolerance, the accuracies exactly. Every request goes to 127.0.0.1 only."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import HTTP, start_server, stop_server

CAPTURED = json.loads((Path(__file__).parent / "data" / "lm_eval" / "requests.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_server(tmp_path_factory.mktemp("lm-eval"), "-P", "2", "-c", "1024", "--temp", "0")
    yield url
    stop_server(proc)


def post(url: str, path: str, body: dict) -> dict:
    response = HTTP.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


INDEPENDENT = """
import json, sys
import llama_cpp
import numpy as np

model, requests = sys.argv[1], json.loads(sys.stdin.read())
llm = llama_cpp.Llama(model_path=model, n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=1,
                      flash_attn=True)
found = []
for tokens, ctxlen in requests:
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    rows = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    picked = [rows[i - 1, tokens[i]] for i in range(ctxlen, len(tokens))]
    greedy = all(rows[i - 1].argmax() == tokens[i] for i in range(ctxlen, len(tokens)))
    found.append([float(sum(picked)), bool(greedy)])
print(json.dumps(found))
"""


def independent(model: Path, requests: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """llama.cpp's logits for each position through llama-cpp-python's high-level API (one sequence, every logit
    kept), in a process of its own (a process that ran llama.cpp's thread pool cannot fork the suite's CLI runs):
    each request's continuation log-likelihood and whether each of its tokens is the argmax."""
    done = subprocess.run([sys.executable, "-c", INDEPENDENT, str(model)], input=json.dumps(requests),
                          capture_output=True, text=True, check=True, timeout=120)
    return [(value, greedy) for value, greedy in json.loads(done.stdout)]


def accuracy(scores: list[float]) -> float:
    """The harness's multiple-choice accuracy: per document, the choice of highest log-likelihood against the gold."""
    docs: dict[int, list[tuple[float, int, int]]] = {}
    for item, score in zip(CAPTURED["loglikelihood"], scores, strict=True):
        docs.setdefault(item["doc"], []).append((score, item["choice"], item["gold"]))
    return sum(max(choices)[1] == choices[0][2] for choices in docs.values()) / len(docs)


def test_the_harness_tokenizer_routes_give_the_tokens_it_scored(server):
    """vLLM's /tokenizer_info, /tokenize and /detokenize, as lm-eval's remote tokenizer calls them: the context it
    tokenized comes back as the ids it sent; the end-of-text token's text tokenizes to one id; llama-server's shapes
    too; bad input is a 400 in OpenAI's shape."""
    info = HTTP.get(f"{server}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 1024 and "im_start" in info["chat_template"]
    assert post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"] == [2]
    for item in CAPTURED["loglikelihood"][::4]:
        sent = item["body"]["prompt"][0]
        found = post(server, "/tokenize", {"prompt": item["context"], "add_special_tokens": False})
        assert found["tokens"] == sent[: item["ctxlen"]] and found["count"] == item["ctxlen"]
        assert post(server, "/detokenize", {"tokens": sent})["prompt"].startswith(item["context"])
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"][0] == 1 and chat["count"] == len(chat["tokens"])  # (<|im_start|>: the template's)
    pieces = post(server, "/tokenize", {"content": "Hello world", "with_pieces": True})["tokens"]
    assert [p["piece"] for p in pieces] == ["Hello", " world"]
    assert post(server, "/detokenize", {"tokens": [p["id"] for p in pieces]})["content"] == "Hello world"
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens")]:
        response = HTTP.post(f"{server}{path}", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_harness_multiple_choice_accuracy_equals_the_one_computed_from_the_logits(server, smollm2):
    """The bodies lm-eval sent (prompt token ids, max_tokens 1, logprobs 1, echo): each answer's logprobs cover the
    prompt (the first token None) and the one token after it; the harness's score of each choice agrees with llama.cpp's
    logits computed independently, and so does the accuracy it makes."""
    served: list[float] = []
    greedy: list[bool] = []
    for item in CAPTURED["loglikelihood"]:
        body, ctxlen = item["body"], item["ctxlen"]
        tokens = body["prompt"][0]
        choice = post(server, "/v1/completions", body)["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(tokens) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) == 1
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and choice["finish_reason"] == "length"
        assert choice["text"].startswith(item["context"])
        kept = logprobs["token_logprobs"][ctxlen:-1]  # (the harness's slice: the continuation's tokens)
        served.append(sum(kept))
        greedy.append(all(value == max(top.values())
                          for value, top in zip(kept, logprobs["top_logprobs"][ctxlen:-1], strict=True)))
    direct = independent(smollm2, [(item["body"]["prompt"][0], item["ctxlen"]) for item in CAPTURED["loglikelihood"]])
    assert np.allclose(served, [value for value, _ in direct], atol=1e-3), (served, direct)  # (1.4e-7 here)
    assert greedy == [flag for _, flag in direct]
    assert accuracy(served) == accuracy([value for value, _ in direct]) >= 0.5  # (six easy questions: not chance)
    print(f"accuracy through serve {accuracy(served):.4f}, from the logits {accuracy([v for v, _ in direct]):.4f}, "
          f"the harness's own run {CAPTURED['accuracy']:.4f}")


def test_generation_requests_and_echo_shapes(server):
    """The harness's generation bodies (token ids, stops) are answered; `echo` with max_tokens 0 scores the prompt
    alone; a streamed echo sends the prompt first; echo with logprobs is answered whole (a stream is refused)."""
    for body in CAPTURED["generation"]:
        choice = post(server, "/v1/completions", body)["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and not any(s in choice["text"] for s in body["stop"])
    prompt = "The capital of France is Paris"
    scored = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": True})
    choice = scored["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert "".join(choice["logprobs"]["tokens"]) == prompt and len(choice["logprobs"]["top_logprobs"][1]) == 2
    with HTTP.stream("POST", f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                                               "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == prompt and len(chunks) >= 2
    refused = HTTP.post(f"{server}/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "stream": True},
                        timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    refused = HTTP.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 0}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
