"""`llmcli serve`: an OpenAI-compatible server over one model, continuous batching across requests."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmcli.cli import options as o
from llmcli.decode.kept_states import KEPT_MIB
from llmcli.errors import UsageError

if TYPE_CHECKING:
    import socket
    from types import FrameType

    import uvicorn
    from rich.console import Console

    from llmcli.pipeline import Request

_SERVER = "Server"
# settings of a client, not of a server: serve always answers with its local model (a config file's endpoint, which
# points run and chat at a server, is not serve's), and where thinking goes is the client's to choose;
# serve's --api-key and --keep-alive are its own
SERVE_SKIPS = ("endpoint", "endpoint_timeout", "reasoning", "api_key", "logprobs", "keep_alive", "markdown",
               "max_models", "answer_color")  # (serve has its own --keep-alive and --max-models: of the models of one server)
ServeKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", help="The key every request must bring as `Authorization: Bearer KEY` ($LLMCLI_API_KEY).",
    show_default=False, rich_help_panel=_SERVER)]
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback needs --api-key "
                                      "(or --insecure).", rich_help_panel=_SERVER)]
PortOpt = Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: any free one, printed).",
                                      rich_help_panel=_SERVER)]
SlotsOpt = Annotated[int, typer.Option("--parallel", "-P", min=1, max=64, rich_help_panel=_SERVER,
                                       help="Requests answered together (slots), each with --ctx-size tokens.")]
QueueOpt = Annotated[Optional[int], typer.Option(
    "--queue", min=0, rich_help_panel=_SERVER, show_default=False,
    help="Requests that may wait for a slot; beyond them: 429 with Retry-After. [default: 4 × --parallel]")]
CacheRamOpt = Annotated[int, typer.Option(
    "--cache-ram", min=0, metavar="MIB", rich_help_panel=_SERVER,
    help="Memory (MiB) for what a slot held when another request took it (an agent's earlier session, a chat left for "
    "another), given back when its conversation goes on rather than evaluated again; the least recently used given up "
    "first. 0: none kept.")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="Allow a non-loopback --host without an API key.",
                                           rich_help_panel=_SERVER)]
MaxBodyOpt = Annotated[int, typer.Option("--max-body", min=1024, help="Largest request body, in bytes.",
                                         rich_help_panel=_SERVER)]
StepTimeoutOpt = Annotated[float, typer.Option(
    "--step-timeout", min=1.0, help="Seconds one step of a model's engine may take (a grammar's sampling of one token "
    "included): past it the engine is started again, the request it was sampling fails, the others resume.",
    rich_help_panel=_SERVER)]
MaxAnswerOpt = Annotated[int, typer.Option("--max-answer", min=1, help="The most tokens a request may ask for.",
                                           rich_help_panel=_SERVER)]
GraceOpt = Annotated[float, typer.Option(
    "--shutdown-grace", min=0, rich_help_panel=_SERVER, help="On SIGTERM or Ctrl-C: seconds the answers in flight have "
    "to finish; then they are cut (finish reason abort).")]
HeaderTimeoutOpt = Annotated[float, typer.Option(
    "--header-timeout", min=0.1, rich_help_panel=_SERVER,
    help="Seconds a connection has to send a request's headers (and a request its body); then it is closed.")]
MaxConnectionsOpt = Annotated[int, typer.Option("--max-connections", min=1, rich_help_panel=_SERVER,
                                                help="Open connections at most; more are closed as they open.")]
MaxModelsOpt = Annotated[int, typer.Option(
    "--max-models", min=1, rich_help_panel=_SERVER,
    help="Models loaded at once; the least recently used idle one is unloaded to load another.")]
KeepAliveOpt = Annotated[str, typer.Option(
    "--keep-alive", rich_help_panel=_SERVER, help="How long a model a request loaded stays loaded after its last "
    "request: 30s, 5m, 1h, 0 (unload at once), -1 (never). The -m model never expires.")]
SocketOpt = Annotated[Optional[Path], typer.Option(
    "--socket", rich_help_panel=_SERVER, show_default=False, help="Listen on this Unix socket (mode 0600: only you "
    "may connect) instead of a TCP port; it is removed when the server ends.")]
ExitIdleOpt = Annotated[bool, typer.Option(
    "--exit-when-idle", rich_help_panel=_SERVER,
    help="The -m model expires too (--keep-alive), and the server exits once no model is loaded; its KV cache "
    "grows with the work, as run's (a server for llmcli's own runs and agents: warm servers, launch).")]
AllowPullOpt = Annotated[bool, typer.Option(
    "--allow-pull", rich_help_panel=_SERVER,
    help="A request may name a Hub model not downloaded yet (it is downloaded), and Ollama's /api/pull downloads one "
    "(`ollama pull hf.co/OWNER/REPO:QUANT`); else only models here.")]
WebuiOpt = Annotated[bool, typer.Option(
    "--webui/--no-webui", rich_help_panel=_SERVER,
    help="The chat page at / (a browser's GET /): streamed answers, stop, regenerate, conversations kept in the "
    "browser; shipped in the package, nothing fetched from elsewhere.")]
CorsOpt = Annotated[Optional[list[str]], typer.Option(
    "--cors", help="Let web pages from this origin (https://app.example) call the server from a browser. Repeatable; "
    "off by default.", show_default=False, rich_help_panel=_SERVER)]
KeepaliveOpt = Annotated[float, typer.Option(
    "--stream-keepalive", min=0.05, rich_help_panel=_SERVER,
    help="Seconds a stream may stay silent (a long prompt being evaluated) before it sends its protocol's keep-alive: "
    "an SSE comment (OpenAI), a ping (Anthropic), response.in_progress (Responses).")]
AllowHostOpt = Annotated[Optional[list[str]], typer.Option(
    "--allow-host", help="A name requests may give as their Host besides IP addresses, localhost and --host (a reverse "
    "proxy's: llm.example.org; * for any). Repeatable. Others get a 403 (DNS rebinding).", show_default=False,
    rich_help_panel=_SERVER)]


@o.with_settings(exclude=SERVE_SKIPS)
def serve(
    *,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8080,
    parallel: SlotsOpt = 4,
    queue: QueueOpt = None,
    cache_ram: CacheRamOpt = KEPT_MIB,
    insecure: InsecureOpt = False,
    max_body: MaxBodyOpt = 1 << 20,
    max_answer: MaxAnswerOpt = 4096,
    api_key: ServeKeyOpt = None,
    cors: CorsOpt = None,
    allow_host: AllowHostOpt = None,
    stream_keepalive: KeepaliveOpt = 10.0,
    shutdown_grace: GraceOpt = 10.0,
    header_timeout: HeaderTimeoutOpt = 10.0,
    max_connections: MaxConnectionsOpt = 512,
    max_models: MaxModelsOpt = 3,
    keep_alive: KeepAliveOpt = "5m",
    allow_pull: AllowPullOpt = False,
    step_timeout: StepTimeoutOpt = 300.0,
    socket_path: SocketOpt = None,
    exit_when_idle: ExitIdleOpt = False,
    webui: WebuiOpt = True,
    request: Request,
) -> None:
    """Serve the model over HTTP, in the protocols local clients speak: OpenAI's (/v1/chat/completions,
    /v1/completions, /v1/responses, /v1/embeddings, /v1/models), Anthropic's (/v1/messages) and Ollama's (/api/chat,
    /api/generate, /api/embed, /api/tags, /api/show, …); /health; a chat page at / for a browser.

    -m is the model of requests that name none, loaded at start; a request may name any other model `-m` takes
    (loaded on first use, kept --keep-alive, at most --max-models at once). The settings (temperature, -n, stop
    sequences, …) are the defaults of requests that do not say otherwise: --grammar, --json-schema and --format
    constrain every answer whose request sets no grammar, format or tools of its own, and --logit-bias applies before
    a request's own biases. --api-key (or $LLMCLI_API_KEY) is the key every request must bring.

    Each model's engine (llama.cpp) runs in a process of its own: if it dies, it is started again and the answers in
    flight resume where they were; a step longer than --step-timeout ends the request it was sampling.
    """
    api_key = api_key or os.environ.get("LLMCLI_API_KEY") or None
    if not _loopback(host) and api_key is None and not insecure:
        raise UsageError(f"--host {host} is reachable from other machines: give --api-key (or $LLMCLI_API_KEY)",
                         hint="Or --insecure to serve without a key on purpose.")
    from llmcli.serve import engine_zygote

    engine_zygote.start()  # (the process each model's engine is forked from: its imports go on while this one's do)
    try:
        import uvicorn

        from llmcli.serve.app import ServerState, create_app
        from llmcli.serve.connections import guarded
    except ImportError as exc:
        from llmcli.config.install_hint import install_hint

        raise UsageError(f"llmcli serve needs its extra ({exc.name} is missing)",
                         hint=install_hint("serve")) from None
    import socket

    from llmcli.cli import output
    from llmcli.pipeline import warm
    from llmcli.serve.model_pool import ModelPool
    from llmcli.serve.setup import ServerModels
    from llmcli.units import parse_keep_alive

    try:
        expiry = parse_keep_alive(keep_alive)
    except ValueError as exc:
        raise UsageError(f"--keep-alive: {exc}") from None
    for origin in cors or ():
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise UsageError(f"--cors {origin!r} is not an origin", hint="e.g. --cors https://app.example")
    if socket_path is None:
        _check_listen(host, port)  # before the model loads: a taken port is a one-line error, not uvicorn's
        listen: dict[str, Any] = {"host": host, "port": port}
    else:
        listening = _private_socket(socket_path)
        listen = {"fd": listening.fileno()}
        warm.listening_here(socket_path)  # (the model's memory check never asks this process's own socket)
    console = output.stderr_console()
    found = ServerModels(request, parallel, queue if queue is not None else 4 * parallel, max_body,
                         max_answer, allow_pull, step_timeout, lambda line: output.print_stats_line(console, line),
                         cache_ram, grows=exit_when_idle)
    with output.download_progress() as progress:
        first = found.load(None, progress)
    for notice in first.notices:
        output.print_notice(console, notice)
    pool = ModelPool(found.resolve, found.load, max_models, expiry)
    pool.preloaded(first, pinned=not exit_when_idle)
    state = ServerState(pool, max_body, api_key, shutdown_grace=shutdown_grace, body_timeout=header_timeout,
                        keepalive_s=stream_keepalive, report=lambda line: output.print_stats_line(console, line),
                        pull=found.pull if allow_pull else None)
    hosts = None if socket_path is not None else (host, socket.gethostname(), *(allow_host or ()))
    app = create_app(state, found.describe, found.loadable, tuple(cors or ()), webui=webui and socket_path is None,
                     hosts=hosts)
    config = uvicorn.Config(app, **listen, log_level="warning", lifespan="on",
                            http=guarded(header_timeout, max_connections),
                            timeout_graceful_shutdown=int(shutdown_grace) + 5)  # (the cut answers' ends go out)
    server = uvicorn.Server(config)
    stop = server.handle_exit

    def handle_exit(sig: int, frame: FrameType | None) -> None:  # SIGTERM, Ctrl-C: the answers in flight have the grace
        if not server.should_exit:
            answering = sum(served.in_flight for served in list(pool.loaded.values()))
            if answering:  # (said, so that the wait is not a silent one)
                second = "Ctrl-C again" if sig == signal.SIGINT else "a second signal"
                sys.stderr.write(f"llmcli serve: waiting up to {shutdown_grace:g} s for {answering} answer"
                                 f"{'' if answering == 1 else 's'} in flight ({second} cuts them)\n")
                sys.stderr.flush()
            cut = threading.Timer(shutdown_grace, pool.cancel_all)
            cut.daemon = True  # the answers done sooner, the process need not wait for it
            cut.start()
            # and the process is gone soon after, whatever a worker thread is still doing (a C call, a slow disk)
            last = threading.Timer(shutdown_grace + EXIT_AFTER_GRACE_S, _exit_now, (128 + sig,))
            last.daemon = True
            last.start()
        else:  # a second signal: now
            pool.cancel_all()
        stop(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    if exit_when_idle:
        pool.on_empty = lambda: setattr(server, "should_exit", True)
    config.load()
    logging.getLogger("uvicorn.error").addFilter(not_a_shutdown_cut)
    server.config.callback_notify = None
    try:
        _announce(server, console, first.name, parallel, first.prompter.limits.n_ctx, api_key is not None, webui)
        server.run()
    finally:
        if socket_path is not None:  # (a private server: its launcher's lock and log go with it)
            for leftover in (socket_path, *((socket_path.with_suffix(".lock"), socket_path.with_suffix(".log"))
                                            if exit_when_idle else ())):
                leftover.unlink(missing_ok=True)
        for served in list(pool.loaded.values()):  # (uvicorn's lifespan closed them; a failed start did not)
            if served.thread is None:
                served.close()


EXIT_AFTER_GRACE_S = 10.0  # after the grace, the cut answers' ends and the models' closing have this long


def not_a_shutdown_cut(record: logging.LogRecord) -> bool:
    """uvicorn's log without its words for answers it cancels once the graceful shutdown's time is up (an engine
    that does not return: llmcli's own line says so at the end of the grace): their CancelledError is not a bug's
    traceback."""
    cut = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
    return not cut and "timeout graceful shutdown exceeded" not in record.getMessage()


def _exit_now(code: int) -> None:
    sys.stderr.write(f"llmcli serve: still busy {EXIT_AFTER_GRACE_S:g} s after the grace; exiting now\n")
    sys.stderr.flush()
    os._exit(code)


def _private_socket(path: Path) -> socket.socket:
    """A Unix socket only its user may connect to: its directory 0700, the socket 0600 from the moment it exists
    (bound here: uvicorn's own `uds` makes it 0666). One that answers belongs to a running server: an error."""
    import socket

    from llmcli import paths
    from llmcli.errors import LlmcliError

    if not path.parent.exists():  # made 0700 with any missing parent; one that exists is the user's choice (the
        paths.private_dir(path.parent, path.parent)  # socket is 0600 whatever the folder); a warm server's is checked
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # a server that died left it
            else:
                raise LlmcliError(f"a server already listens on {path}", hint="llmcli ps; llmcli stop")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        listening.bind(str(path))
    finally:
        os.umask(mask)
    listening.listen(128)
    return listening


def _check_listen(host: str, port: int) -> None:
    import socket

    from llmcli.errors import UsageError

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",  # (exit 2: choose another)
                         hint="Another server holds the port? Choose one with --port (0: any free one).") from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _announce(server: uvicorn.Server, console: Console, model: str, parallel: int, n_ctx: int, keyed: bool, webui: bool) -> None:
    """Say where the server listens, once it does (port 0: the one the system chose)."""
    started = server.startup

    async def startup(sockets: list[socket.socket] | None = None) -> None:
        await started(sockets=sockets)
        for listener in server.servers:
            for sock in listener.sockets:
                address = sock.getsockname()
                where = f"unix:{address}" if isinstance(address, str) else f"http://{address[0]}:{address[1]}/v1"
                console.print(f"llmcli serve · {model} · {where} · {parallel} slots of {n_ctx} tokens"
                              + (" · API key required" if keyed else ""))
                if webui and not isinstance(address, str):
                    console.print(f"chat page: http://{address[0]}:{address[1]}/")

    server.startup = startup  # type: ignore[method-assign]
