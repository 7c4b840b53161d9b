"""OpenAI's API as its own app under `/v1`: chat and text completions, Responses (with the responses it keeps for
`previous_response_id`), embeddings, the model list; its errors in OpenAI's shape. The wire format is
llmcli/serve/openai_api.py's and responses_api.py's; this module only routes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmcli.answer.message import Message
from llmcli.serve import embeddings_api, openai_api, responses_api
from llmcli.serve.answering import Asked, ServerState, check_key, requested_model
from llmcli.serve.model_facts import ModelFacts
from llmcli.serve.model_pool import Served
from llmcli.serve.route_kit import ModelLists, answering, embedded, guarded, posted, protocol_app

SHAPE = openai_api.error_body


class KeptResponses(OrderedDict[str, list[Message]]):
    """The conversations of the latest MAX_KEPT stored responses, for `previous_response_id`, oldest first."""

    def keep(self, response_id: str, conversation: list[Message]) -> None:
        self[response_id] = conversation
        while len(self) > responses_api.MAX_KEPT:
            self.popitem(last=False)


def app(state: ServerState, models: ModelLists, hosts: tuple[str, ...] | None) -> Starlette:
    kept = KeptResponses()

    def completions(chat: bool) -> Callable[[Any, Served], Asked]:
        parse = openai_api.parse_chat if chat else openai_api.parse_completion

        def asked(body: Any, served: Served) -> Asked:
            requests = parse(body, served.prompter)
            return Asked(requests, lambda prepared: openai_api.Reply.new(chat, served.name, requests, prepared,
                                                                          served.prompter))

        return asked

    def responses(body: Any, served: Served) -> Asked:
        request = responses_api.parse_response_request(body, served.prompter, kept)
        return Asked([request.answer], lambda prepared: responses_api.ResponsesReply(served.name, request, kept.keep))

    async def embeddings(body: Any) -> Any:
        served, release = await requested_model(state, body)
        try:
            asked = embeddings_api.parse_embeddings(body, served.prompter)
            results = await embedded(served, asked.texts)
            return embeddings_api.embeddings_reply(asked, results, served.name, served.embeddings.dimensions)
        finally:
            release()

    async def models_list(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse({"object": "list", "data": [_model_card(f) for f in await models.listed()]})

    async def one_model(request: Request) -> Response:
        check_key(request, state)
        return JSONResponse(_model_card(await models.facts_of(request.path_params["name"])))

    return protocol_app([
        Route("/v1/chat/completions", answering(state, completions(True), SHAPE), methods=["POST"]),
        Route("/v1/completions", answering(state, completions(False), SHAPE), methods=["POST"]),
        Route("/v1/responses", answering(state, responses, SHAPE), methods=["POST"]),
        Route("/v1/embeddings", posted(state, SHAPE, embeddings), methods=["POST"]),
        Route("/v1/models", guarded(models_list, SHAPE), methods=["GET"]),
        Route("/v1/models/{name:path}", guarded(one_model, SHAPE), methods=["GET"]),
    ], SHAPE, hosts)


def _model_card(facts: ModelFacts) -> dict[str, Any]:
    """OpenAI's model object; a loaded model's also says its context here (`max_model_len`, as vLLM names it): what a
    prompt and its answer may take, the limit `max_tokens` is clamped to."""
    card = {"id": facts.name, "object": "model", "created": int(facts.modified), "owned_by": "llmcli"}
    return {**card, "max_model_len": facts.n_ctx} if facts.n_ctx else card
