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
def shout(text: Annotated[str, Field(max_length=24)]) -> str:  # (bounded: a greedy call ends on any CPU)
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
def escapes() -> str:
    """Terminal control sequences: a window title, clear screen, a clipboard write (OSC 52)."""
    return "\x1b]0;pwned\x07\x1b[2J\x1b]52;c;cHduZWQ=\x07done"


@server.tool()
def picture() -> Image:
    """A tiny PNG."""
    return Image(data=bytes.fromhex("89504e470d0a1a0a") + b"\0" * 32, format="png")


def _spawn_children() -> list[int]:
    """MCP_SPAWN=1: two children that would outlive their server, one of them in a session of its own."""
    import subprocess

    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    return [subprocess.Popen(sleep, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).pid,
            subprocess.Popen(sleep, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True).pid]


if __name__ == "__main__":
    pids = [os.getpid(), *(_spawn_children() if os.environ.get("MCP_SPAWN") else [])]
    if os.environ.get("MCP_PID_FILE"):
        with open(os.environ["MCP_PID_FILE"], "a", encoding="utf-8") as handle:
            handle.write("".join(f"{pid}\n" for pid in pids))
    if sys.argv[1] == "garbage":  # not MCP at all on stdout
        sys.stdout.write("this is not JSON-RPC\n{\"jsonrpc\": 7}\n\x00\xff\n")
        sys.stdout.flush()
        time.sleep(30)
        sys.exit(0)
    if sys.argv[1] == "broken":  # fails at start, as a server with a missing import does
        sys.stderr.write("Traceback (most recent call last):\nModuleNotFoundError: No module named 'fastmcp_helpers'\n")
        sys.exit(1)
    if sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
