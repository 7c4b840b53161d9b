"""An MCP server for the tests, written with the official SDK: `python mcp_server.py stdio` or
`python mcp_server.py http PORT` (Streamable HTTP on 127.0.0.1 only). Its pid is written to $MCP_PID_FILE."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated

from mcp.server import MCPServer
from mcp.server.mcpserver import Image
from pydantic import Field

server = MCPServer("test-tools")


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper() + "!"


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def hang(seconds: Annotated[int, Field(ge=1, le=99)]) -> str:
    """Wait, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def die(code: int) -> str:
    """The server exits in the middle of the call."""
    os._exit(code)


@server.tool()
def picture() -> Image:
    """A tiny PNG."""
    return Image(data=bytes.fromhex("89504e470d0a1a0a") + b"\0" * 32, format="png")


if __name__ == "__main__":
    if os.environ.get("MCP_PID_FILE"):
        with open(os.environ["MCP_PID_FILE"], "a", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()}\n")
    if sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
