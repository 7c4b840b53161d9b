"""serve's side of OpenAI's embeddings: a request body -> what to embed, and the vectors -> OpenAI's list (float or
base64). No HTTP here (llmcli/serve/openai_routes.py routes it; the vectors are `llmcli embed`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmcli.serve.answer_request import ApiError, Prompter


@dataclass(frozen=True)
class EmbeddingRequest:
    texts: list[str]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI sends it
    dimensions: int | None


def parse_embeddings(body: Any, prompter: Prompter) -> EmbeddingRequest:
    """An embeddings request: `input` a string or a list of strings; ApiError (400, 404) otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompter.check_model(body.get("model"))
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input must be a string or a non-empty list of strings (token ids are not taken)",
                       param="input")
    if len(texts) > 2048:
        raise ApiError(400, "input holds at most 2048 texts", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise ApiError(400, "dimensions must be an integer", param="dimensions")
    return EmbeddingRequest(texts, encoding == "base64", dimensions)


def embeddings_reply(request: EmbeddingRequest, results: list[Any], model: str, n_embd: int) -> dict[str, Any]:
    """OpenAI's embeddings list; a text that cannot be embedded (too long, empty) is a 400 naming it."""
    import base64
    from array import array

    if request.dimensions is not None and request.dimensions != n_embd:
        raise ApiError(400, f"dimensions must be {n_embd} for this model (its vectors are not shortened)",
                       param="dimensions")
    data = []
    for index, result in enumerate(results):
        if result.vector is None:
            raise ApiError(400, f"input[{index}]: {result.error}", param="input",
                           code="context_length_exceeded" if result.too_long else None)
        vector: Any = result.vector
        if request.base64:
            packed = array("f", vector)
            if packed.itemsize != 4:  # pragma: no cover - every platform llama.cpp runs on has 4-byte floats
                raise ApiError(500, "no 32-bit float here", "server_error")
            vector = base64.b64encode(packed.tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = sum(result.tokens for result in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
