"""MCP: tools from Model Context Protocol servers, through the official `mcp` SDK (the `mcp` extra; imported only
when MCP is used), offered to the model as `SERVER_TOOL` functions and run by the same tool loop as `--functions`.

The configuration is the `mcpServers` shape Claude Desktop, Cursor and LM Studio read:

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {}, "cwd": "/tmp", "tools": ["read_file"]},
        "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer …"}}
    }}

`command` (with `args`, `env`, `cwd`) starts a stdio server; `url` (with `headers`) reaches a Streamable HTTP one;
`tools` is an allow-list; `timeout` the seconds a server may take to start (10). The servers are started in
parallel, on one asyncio loop in a thread of their own; a server that fails to start, or answers garbage, is one
notice and the rest go on. A call past `--tool-timeout`, or a server that dies mid-call, is an error result for the
model. A stdio server runs under llmcli/reaper.py, so that closing, SIGTERM, Ctrl-C and even `kill -9` of llmcli end
its whole process tree (children it started in a new session too): no child outlives llmcli. Its stderr goes to a
file of its own, and a server that fails to start says its last lines in its notice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli import paths, reaper
from llmcli.answer.tool_calls import Tool, ToolCall, ToolResult
from llmcli.errors import UsageError
from llmcli.text_escapes import neutralised

DEFAULT_START_TIMEOUT = 10.0
DEFAULT_CALL_TIMEOUT = 60.0
MAX_RESULT_CHARS = 32_000
STDERR_LINES, STDERR_CHARS = 5, 400  # of a server that failed to start, in its notice


def default_config() -> Path:
    return paths.config_file().parent / "mcp.json"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    allowed: tuple[str, ...] | None = None  # the config's `tools`: only these are offered
    start_timeout: float = DEFAULT_START_TIMEOUT

    @property
    def where(self) -> str:
        return self.url or " ".join([self.command or "", *self.args]).strip()


def read_config(path: Path, only: tuple[str, ...] = ()) -> list[ServerConfig]:
    """The servers of an `mcpServers` file (those named in `only`, when given); a one-line UsageError otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"no MCP configuration at {path}", hint='Write {"mcpServers": {"NAME": {"command": …}}} '
                         "there, or give --mcp FILE.") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the MCP configuration {path}: {exc}") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise UsageError(f"{path}: expected {{\"mcpServers\": {{NAME: {{…}}}}}}")
    unknown = [name for name in only if name not in servers]
    if unknown:
        raise UsageError(f"--mcp-server {unknown[0]!r} is not in {path}", hint=f"Servers: {', '.join(servers) or 'none'}")
    return [_server(name, entry, path) for name, entry in servers.items() if not only or name in only]


def _server(name: str, entry: Any, path: Path) -> ServerConfig:
    where = f"{path}: mcpServers.{name}"
    if not isinstance(entry, dict):
        raise UsageError(f"{where} must be an object")
    def strings(key: str) -> bool:
        return entry.get(key) is None or isinstance(entry.get(key), str)

    def mapping(key: str) -> bool:
        value = entry.get(key) or {}
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())

    def listed(key: str) -> bool:
        value = entry.get(key, [])
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    if not all(strings(k) for k in ("command", "cwd", "url")) or not all(mapping(k) for k in ("env", "headers")) \
            or not listed("args") or ("tools" in entry and not listed("tools")):
        raise UsageError(f"{where}: command, cwd, url are strings; args and tools lists of strings; env, headers "
                         "objects of strings")
    if bool(entry.get("command")) == bool(entry.get("url")):
        raise UsageError(f"{where}: give either command (a stdio server) or url (Streamable HTTP)")
    timeout = entry.get("timeout", DEFAULT_START_TIMEOUT)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise UsageError(f"{where}: timeout is a number of seconds > 0")
    return ServerConfig(name, entry.get("command"), tuple(entry.get("args", [])), dict(entry.get("env") or {}),
                        entry.get("cwd"), entry.get("url"), dict(entry.get("headers") or {}),
                        tuple(entry["tools"]) if "tools" in entry else None, float(timeout))


def tool_name(server: str, tool: str) -> str:
    """SERVER_TOOL, within the 64 letters, digits, _ and - a tool's name may have."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}_{tool}")[:64]


@dataclass
class ServerState:
    config: ServerConfig
    state: str = "starting"  # running, failed, stopped
    error: str | None = None
    tools: list[Tool] = field(default_factory=list)  # as the model sees them (SERVER_TOOL)
    names: dict[str, str] = field(default_factory=dict)  # SERVER_TOOL -> the server's own tool name
    client: Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    stop: Any = None  # an asyncio.Event of the servers' loop
    task: Any = None  # the future of its serving coroutine
    hung: bool = False  # a call of it timed out or was interrupted: its tree is ended at once when the servers close


class McpServers:
    """The MCP servers of a run or a chat, as one tool source (`tools`, `run`); `close()` stops them all."""

    def __init__(self, configs: list[ServerConfig], call_timeout: float = DEFAULT_CALL_TIMEOUT):
        self.servers = [ServerState(config) for config in configs]
        self.call_timeout = call_timeout
        self.notices: list[str] = []
        self._waited = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmcli-mcp", daemon=True)
        self._stderr: dict[str, Any] = {}  # server name -> the file its stderr goes to
        self._sdk_log = _SdkLog()  # what the SDK logs (a server's garbage on stdout): one notice, not tracebacks

    def start(self) -> McpServers:
        """Start every server at once, in the background (the model loads meanwhile); `wait()` (or the first look at
        `tools`) waits for each up to its start-up timeout. Failures are notices."""
        try:
            import mcp  # noqa: F401  (the extra: said once, clearly, before any server starts)
        except ImportError:
            from llmcli.config.install_hint import install_hint

            raise UsageError("MCP needs its extra (the mcp package is missing)", hint=install_hint("mcp")) from None
        _SdkLog.install(self._sdk_log)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_all(), self._loop).result(timeout=10)
        return self

    async def _start_all(self) -> None:
        for server in self.servers:
            server.stop = asyncio.Event()
            server.task = asyncio.create_task(self._serve(server))

    def wait(self) -> list[str]:
        """Wait for every server to be up (or to have failed, or timed out); the notices of those that are not."""
        if self._waited:
            return list(self.notices)
        self._waited = True
        began = time.monotonic()
        for server in self.servers:
            left = max(0.0, server.config.start_timeout - (time.monotonic() - began))
            if not server.ready.wait(left):
                server.state, server.error = "failed", f"did not start within {server.config.start_timeout:g} s"
                self._end_hung(server)  # now, not after the SDK's wait for a clean exit (2 s)
                self._loop.call_soon_threadsafe(server.task.cancel)  # its process is stopped as the task unwinds
            if server.state != "running":
                said = self._last_stderr(server.config.name)
                server.error = f"{server.error}; its stderr: {said}" if said else server.error
                self.notices.append(f"MCP server {server.config.name}: {server.error}; going on without it")
        if self._sdk_log.said:
            self.notices.append(self._sdk_log.summary())
        return list(self.notices)

    @property
    def tools(self) -> tuple[Tool, ...]:
        self.wait()
        return tuple(tool for server in self.servers if server.state == "running" for tool in server.tools)

    async def _serve(self, server: ServerState) -> None:
        from mcp.client.client import Client

        try:
            async with Client(self._transport(server.config), mode="legacy") as client:
                listed = await client.list_tools()
                allowed = server.config.allowed
                for tool in listed.tools:
                    if allowed is not None and tool.name not in allowed:
                        continue
                    name = tool_name(server.config.name, tool.name)
                    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object"}
                    server.tools.append(Tool(name, tool.description or "", json.dumps(schema)))
                    server.names[name] = tool.name
                server.client, server.state = client, "running"
                server.ready.set()
                await server.stop.wait()
        except BaseException as exc:  # a server that would not start, or answered garbage: a notice, not the end
            if server.state != "running":
                server.state, server.error = "failed", _reason(exc)
            else:
                server.state = "stopped"
            server.ready.set()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            server.client = None
            if server.state == "running":
                server.state = "stopped"

    def _transport(self, config: ServerConfig) -> Any:
        if config.url is not None:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            client = httpx2.AsyncClient(headers=dict(config.headers), timeout=httpx2.Timeout(30.0, read=300.0))
            return streamable_http_client(config.url, http_client=client)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        # through llmcli.reaper: whatever the server starts (in a new session too) ends with it, or with llmcli
        program = reaper.command(os.getpid(), [config.command or "", *config.args], self._reaper_name(config))
        parameters = StdioServerParameters(command=program[0], args=program[1:], env=dict(config.env) or None,
                                           cwd=config.cwd)
        return stdio_client(parameters, errlog=self._stderr_of(config.name))

    def _reaper_name(self, config: ServerConfig) -> str:
        return f"{id(self):x}.{config.name}"  # (this object's: another McpServers may run a server of that name)

    def _end_hung(self, server: ServerState) -> None:
        """A stdio server that stopped answering: its reaper ends its process tree now. (Closing its stdin, as a
        server's orderly end goes, makes the MCP SDK wait 2 s for an exit that a hung server never makes.)"""
        if server.config.url is None:
            reaper.end_named(self._reaper_name(server.config))

    def _stderr_of(self, name: str) -> Any:
        """Where a stdio server's stderr goes: a file of its own, whose last lines explain a failed start."""
        if name not in self._stderr:
            self._stderr[name] = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        return self._stderr[name]

    def _last_stderr(self, name: str) -> str:
        """The last lines a server wrote on stderr, as one line (empty: none)."""
        handle = self._stderr.get(name)
        if handle is None:
            return ""
        try:
            handle.flush()
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = [line.strip() for line in handle.read().splitlines() if line.strip()][-STDERR_LINES:]
        except (OSError, ValueError):
            return ""
        return neutralised(" | ".join(lines))[:STDERR_CHARS]

    def call(self, server_name: str, tool: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """Call one server's tool: (the result as text, whether it is an error). Ctrl-C cancels it (and raises)."""
        server = next((s for s in self.servers if s.config.name == server_name), None)
        if server is None or server.state != "running" or server.client is None:
            state = "not configured" if server is None else server.error or server.state
            return f"Error: the MCP server {server_name} is not running ({state})", True
        future = asyncio.run_coroutine_threadsafe(server.client.call_tool(tool, dict(arguments)), self._loop)
        try:
            result = future.result(self.call_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            server.hung = True
            return f"Error: {server_name}.{tool} did not answer within {self.call_timeout:g} s (--tool-timeout)", True
        except KeyboardInterrupt:  # (the call left mid-way: no orderly exit to wait for either)
            future.cancel()
            server.hung = True
            raise
        except Exception as exc:  # the server died mid-call, or refused it
            return f"Error: {server_name}.{tool} failed: {_reason(exc)}", True
        return describe_result(result)

    def run(self, call: ToolCall) -> ToolResult:
        """A model's call of SERVER_TOOL, as a result it can read."""
        if call.error is not None:
            return ToolResult(call.id, call.name, f"Error: the call is not valid: {call.error}", error=True)
        for server in self.servers:
            if call.name in server.names:
                arguments = call.arguments_value()
                text, error = self.call(server.config.name, server.names[call.name],
                                        arguments if isinstance(arguments, dict) else {})
                return ToolResult(call.id, call.name, text, error)
        return ToolResult(call.id, call.name, f"Error: no tool is called {call.name!r}", error=True)

    def close(self) -> None:
        """Stop every server and the loop: stdio servers' processes end (terminated, then killed) before this returns."""
        if not self._thread.is_alive():
            self._close_stderr()
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):  # exiting anyway: what is left dies
            asyncio.run_coroutine_threadsafe(self._stop_all(), self._loop).result(timeout=30)  # with the process
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._close_stderr()

    def _close_stderr(self) -> None:
        for handle in self._stderr.values():
            handle.close()
        self._stderr.clear()

    async def _stop_all(self) -> None:
        """Each server's context exits (a stdio server's process tree is terminated, then killed): awaited here, on
        the loop, so no process is left when close() returns."""
        tasks = [server.task for server in self.servers if server.task is not None]
        for server in self.servers:
            if server.hung:
                self._end_hung(server)
            if server.stop is not None:
                server.stop.set()
        _, pending = await asyncio.wait(tasks, timeout=10) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)

    def __enter__(self) -> McpServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SdkLog(logging.Handler):
    """The MCP SDK's log records (it logs a traceback for each line a server writes on stdout that is not JSON-RPC),
    kept as one notice instead of reaching stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0] if record.getMessage() else record.name
        self.said[message] = self.said.get(message, 0) + 1

    def summary(self) -> str:
        return "the MCP SDK said: " + "; ".join(f"{text} ({count} times)" if count > 1 else text
                                                for text, count in self.said.items())

    @staticmethod
    def install(handler: _SdkLog) -> None:
        sdk = logging.getLogger("mcp")
        for old in [h for h in sdk.handlers if isinstance(h, _SdkLog)]:
            sdk.removeHandler(old)
        sdk.addHandler(handler)
        sdk.propagate = False


def describe_result(result: Any) -> tuple[str, bool]:
    """A tool's result as text for the model: text as it is; an image, audio or a resource described, not dumped."""
    parts = []
    for item in getattr(result, "content", None) or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(str(getattr(item, "text", "")))
        elif kind in ("image", "audio"):
            size = len(getattr(item, "data", "") or "") * 3 // 4
            parts.append(f"[{kind}: {getattr(item, 'mime_type', None) or getattr(item, 'mimeType', '?')}, about {size} bytes]")
        elif kind == "resource":
            resource = getattr(item, "resource", None)
            parts.append(f"[resource: {getattr(resource, 'uri', '?')}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {getattr(item, 'uri', '?')}]")
        else:
            parts.append(f"[{kind or 'content'}]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"… (cut: {len(text)} characters in all)"
    return text, bool(getattr(result, "is_error", False))


def _reason(exc: BaseException) -> str:
    """One line for what went wrong (an exception group: its first leaf)."""
    while getattr(exc, "exceptions", None):  # an exception group (anyio's task groups)
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
