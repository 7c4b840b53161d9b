"""Anthropic's Messages API as its own app under `/v1/messages`: messages and count_tokens, its errors in Anthropic's
shape. The wire format is llmcli/serve/anthropic_api.py's; this module only routes."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

from llmcli.serve import anthropic_api
from llmcli.serve.answer_request import count_tokens
from llmcli.serve.answering import Asked, ServerState, requested_model
from llmcli.serve.model_pool import Served
from llmcli.serve.route_kit import answering, posted, protocol_app

SHAPE = anthropic_api.error_body


def app(state: ServerState, hosts: tuple[str, ...] | None) -> Starlette:
    def messages(body: Any, served: Served) -> Asked:
        return Asked(anthropic_api.parse_messages(body, served.prompter),
                     lambda prepared: anthropic_api.MessagesReply(served.name, len(prepared[0].tokens)))

    async def count(body: Any) -> Any:
        served, release = await requested_model(state, body)
        try:
            (asked,) = anthropic_api.parse_messages(body, served.prompter, counting=True)
            return anthropic_api.count_reply(await asyncio.to_thread(count_tokens, asked, served.prompter))
        finally:
            release()

    return protocol_app([
        Route("/v1/messages", answering(state, messages, SHAPE), methods=["POST"]),
        Route("/v1/messages/count_tokens", posted(state, SHAPE, count), methods=["POST"]),
    ], SHAPE, hosts)
