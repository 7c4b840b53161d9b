"""The chat page at `/` of `llmcli serve`: four files shipped in the package (llmcli/serve/webui/), nothing fetched
from elsewhere, so it works offline and behind a firewall. It talks to the server's own OpenAI routes.

Model output is text on that page, and the policy below says so to the browser as well: scripts, styles and requests
only from this server, no inline script or style, no frames, no form posts, no plugins. `GET /` answers a browser
(one that accepts HTML) with the page, anything else with the one line that tells a client the server is up.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
FILES = {"chat.js": "text/javascript; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8",
         "chat.css": "text/css; charset=utf-8"}
RUNNING = "llmcli is running (Ollama's API at /api, OpenAI's and Anthropic's at /v1)"


def _read(name: str) -> bytes:
    return (resources.files("llmcli.serve") / "webui" / name).read_bytes()


def routes(webui: bool) -> list[Route]:
    """`/` (and, with the page, its script, Markdown renderer and style under /ui/); without it `/` says only that the
    server runs."""
    if not webui:
        return [Route("/", lambda request: PlainTextResponse(RUNNING), methods=["GET", "HEAD"])]
    page = _read("index.html")
    assets = {name: (_read(name), kind) for name, kind in FILES.items()}

    async def index(request: Request) -> Response:
        if "text/html" not in request.headers.get("accept", ""):
            return PlainTextResponse(RUNNING)
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            raise HTTPException(404)
        body, kind = assets[name]
        return Response(body, media_type=kind, headers=HEADERS)

    return [Route("/", index, methods=["GET", "HEAD"]), Route("/ui/{name}", asset, methods=["GET"])]
