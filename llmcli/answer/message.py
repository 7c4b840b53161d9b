"""A message of a conversation, as templates, records and every protocol read it: its role, its text, the tool
calls an assistant made and the call a tool's result answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmcli.answer.images import MARKER, ImageInput, described, with_markers
from llmcli.answer.tool_calls import ToolCall


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    interrupted: bool = False  # a reply cut short by Ctrl-C (kept in the history, marked in records)
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    name: str | None = None  # ... and the tool's name
    images: tuple[ImageInput, ...] = ()  # pictures in the message: `content` holds a MARKER where each one sits

    def record(self) -> dict[str, Any]:
        """As records keep a message (/save, the log): each image named in the text, not its pixels."""
        found = dataclasses.asdict(dataclasses.replace(self, content=described(self.content, self.images), images=()))
        del found["images"]
        return found

    def openai_dict(self) -> dict[str, Any]:
        """As OpenAI's chat API takes a message (a call's arguments as JSON text; images as `image_url` parts)."""
        found = self.template_dict()
        if self.images:
            pieces = self.content.split(MARKER)
            parts: list[dict[str, Any]] = []
            for index, piece in enumerate(pieces):
                if piece:
                    parts.append({"type": "text", "text": piece})
                if index < len(self.images):
                    parts.append({"type": "image_url", "image_url": {"url": self.images[index].data_uri()}})
            found["content"] = parts
        if self.tool_calls:  # (content stays a string: OpenAI takes "", and some servers refuse null)
            found["tool_calls"] = [call.openai() for call in self.tool_calls]
        return found

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Message:
        """A message saved with dataclasses.asdict (/save, conversation records)."""
        calls = tuple(ToolCall(str(c["id"]), str(c["name"]), str(c.get("arguments") or "{}"), c.get("error"))
                      for c in record.get("tool_calls") or ())
        return cls(record["role"], record["content"], bool(record.get("interrupted")), calls,
                   record.get("tool_call_id"), record.get("name"))

    def template_dict(self) -> dict[str, Any]:
        """As chat templates read a message (OpenAI's shape: a call's arguments as an object, as templates expect)."""
        found: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            found["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments_value()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            found["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            found["name"] = self.name
        return found


def user_message(text: str, images: tuple[ImageInput, ...] = ()) -> Message:
    """A user's message: its text, its images first (markers the user typed stay text)."""
    return Message("user", with_markers(text, len(images)) if images else text, images=images)
