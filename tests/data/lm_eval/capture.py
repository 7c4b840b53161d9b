"""Capture what lm-evaluation-harness sends to `llmcli serve` (tests/test_lm_eval.py replays it; the harness itself,
~760 MB installed, is not a test dependency). Run with lm-eval (`pip install "lm_eval[api]"`) against a server
on SmolLM2:

    llmcli serve -m smollm2 --port 8911 &
    python tests/data/lm_eval/capture.py http://127.0.0.1:8911

It runs the harness's `local-completions` model with `tokenizer_backend=remote` on the two tasks here (a multiple-
choice one and a generation one, as YAML + JSONL: README's example runs them) and writes requests.json: every body the harness posted to
/v1/completions, each loglikelihood request with its context length and its document and choice, and the harness's
own scores."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]  # (the tasks name their JSONL files from the checkout's root)
TASKS = ("llmcli_mc", "llmcli_gen")  # llmcli_mc.yaml, llmcli_gen.yaml here


def main(url: str) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    sent: list[dict] = []
    scored: dict[tuple[str, str], dict] = {}
    model_call = LocalCompletionsAPI.model_call
    loglikelihood_tokens = LocalCompletionsAPI._loglikelihood_tokens

    def recording_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
        sent.append(self._create_payload(self.create_message(messages), generate=generate,
                                         gen_kwargs=copy.deepcopy(gen_kwargs), seed=self._seed))
        return model_call(self, messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs)

    def recording_tokens(self, requests, **kwargs):
        for (context, continuation), context_enc, continuation_enc in requests:
            scored[(context, continuation)] = {"tokens": context_enc + continuation_enc, "ctxlen": len(context_enc)}
        return loglikelihood_tokens(self, requests, **kwargs)

    LocalCompletionsAPI.model_call = recording_call
    LocalCompletionsAPI._loglikelihood_tokens = recording_tokens
    os.chdir(ROOT)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=list(TASKS), task_manager=TaskManager(include_path=str(HERE)),
        model_args=f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=remote", log_samples=True)
    loglikelihood = []
    for sample in results["samples"]["llmcli_mc"]:
        for choice, (context, continuation) in enumerate(sample["arguments"]):
            found = scored[(context, continuation)]
            body = next(b for b in sent if b.get("echo") and b["prompt"] == [found["tokens"]])
            loglikelihood.append({"doc": sample["doc_id"], "choice": choice, "gold": sample["doc"]["answer"],
                                  "context": context, "ctxlen": found["ctxlen"], "body": body,
                                  "harness": float(sample["resps"][choice][0][0])})
    generation = [b for b in sent if not b.get("echo")]
    out = {"lm_eval": lm_eval.__version__, "loglikelihood": loglikelihood, "generation": generation,
           "accuracy": results["results"]["llmcli_mc"]["acc,none"],
           "exact_match": results["results"]["llmcli_gen"]["exact_match,strip"]}
    (HERE / "requests.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("lm_eval", "accuracy", "exact_match")}))


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"))
