"""What a protocol's reply is to the one request runner (llmcli/serve/answering.py): an `Exchange` turns the events
of a request's answers into that protocol's objects — a whole response, or the items of its stream."""

from __future__ import annotations

from typing import Any, Protocol

from llmcli.answer.events import DecodeEvent, Done
from llmcli.serve.answer_request import ApiError

# One item of a stream: an SSE event's name (None: a plain `data:` line; NDJSON has no names) and its data
# (a JSON object, or text sent as it is: OpenAI's "[DONE]"); COMMENT as the name: an SSE comment line.
Item = tuple[str | None, Any]
COMMENT = ":"


class Exchange(Protocol):
    """One request's reply in one protocol. Its answers are numbered (a completions request may hold several
    prompts); every other protocol has one, index 0."""

    def error_body(self, error: ApiError) -> Any:
        """The protocol's error object (an error before the answer started, or a whole answer that failed)."""

    def opening(self) -> list[Item]:
        """What a stream sends before the first event."""

    def on_event(self, index: int, event: DecodeEvent) -> list[Item]:
        """A stream's items for one event of answer `index` (its Done included)."""

    def closing(self, dones: list[Done]) -> list[Item]:
        """What a stream sends once every answer is done."""

    def failed(self, error: ApiError) -> list[Item]:
        """How a stream ends when an answer failed after it started."""

    def keepalive(self) -> list[Item]:
        """What a stream sends when nothing else has been sent for a while (a long prompt being evaluated), so that a
        client with an idle timeout stays: what the protocol allows (none for NDJSON)."""

    def whole(self, dones: list[Done]) -> Any:
        """The whole response (not streamed)."""
