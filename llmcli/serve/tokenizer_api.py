"""The served model's tokenizer over HTTP, in the shapes evaluation harnesses and clients ask for: vLLM's `/tokenize`
(a prompt or messages), `/detokenize` and `/tokenizer_info` (lm-evaluation-harness's `tokenizer_backend=remote`: the
harness counts and cuts its prompts with the server's own tokenizer, nothing from the Hub), and llama-server's
`/tokenize` and `/detokenize` (`content`). A body -> a response object; no HTTP here (llmcli/serve/app.py routes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmcli.answer.openai_wire import WireError, message_of
from llmcli.serve.answer_request import MAX_MESSAGES, AnswerRequest, ApiError, Prompter, prompt_tokens

MAX_IDS = 1 << 20  # token ids one /detokenize may hold


def tokenized(body: Mapping[str, Any], prompter: Prompter) -> dict[str, Any]:
    """vLLM's `{"prompt", "add_special_tokens"}` or `{"messages", "add_generation_prompt"}` -> `{"count", "tokens",
    "max_model_len", "token_strs"}`; llama-server's `{"content", "add_special", "with_pieces"}` -> `{"tokens"}`.
    Special tokens written in the text (`<|im_end|>`) are read as such, as both servers read them."""
    if "content" in body:  # llama-server's shape
        content = body["content"]
        if not isinstance(content, str):
            raise ApiError(400, "content must be a string", param="content")
        tokens = _tokens(content, _flag(body, "add_special", False), prompter)
        if _flag(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": prompter.detokenize([t], True)} for t in tokens]}
        return {"tokens": tokens}
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or len(messages) > MAX_MESSAGES:  # (before any is read, as chat's are)
            raise ApiError(400, f"messages must be a list of at most {MAX_MESSAGES}", param="messages")
        try:
            chat = [message_of(message, index) for index, message in enumerate(messages)]
        except WireError as exc:
            raise ApiError(400, exc.message, param="messages") from None
        tokens = prompt_tokens(AnswerRequest(messages=chat), prompter)  # (rendered as an answer's prompt is)
        if not _flag(body, "add_generation_prompt", True):
            raise ApiError(400, "add_generation_prompt false is not supported (the model's template adds it)",
                           param="add_generation_prompt")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (or give messages)", param="prompt")
        tokens = _tokens(prompt, _flag(body, "add_special_tokens", True), prompter)
    strs = [prompter.detokenize([t], True) for t in tokens] if _flag(body, "return_token_strs", False) else None
    return {"count": len(tokens), "max_model_len": prompter.limits.n_ctx, "tokens": tokens, "token_strs": strs}


def detokenized(body: Mapping[str, Any], prompter: Prompter) -> dict[str, Any]:
    """`{"tokens": [ids]}` -> vLLM's `{"prompt": text}` and llama-server's `{"content": text}` (control tokens
    written as their text)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < prompter.n_vocab for t in tokens):
        raise ApiError(400, f"tokens must be a list of at most {MAX_IDS} token ids in [0, {prompter.n_vocab})",
                       param="tokens")
    text = prompter.detokenize(tokens, True) if tokens else ""
    return {"prompt": text, "content": text}


def tokenizer_info(prompter: Prompter) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: the special tokens' text (lm-evaluation-harness reads the end of text here, and
    tokenizes it back to its id), the chat template, the context."""
    return {"tokenizer_class": "llama.cpp", **prompter.special_tokens, "pad_token": None,
            "chat_template": prompter.template_source or None, "model_max_length": prompter.limits.n_ctx}


def _tokens(text: str, add_special: bool, prompter: Prompter) -> list[int]:
    return prompter.tokenize(text) if add_special else prompter.tokenize_piece(text)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return value
