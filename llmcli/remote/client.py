"""An OpenAI-compatible server as the engine (`--endpoint URL`): vLLM, llama-server, Ollama, llama-cpp-python's
server, `llmcli serve`. Requests go out, answers stream back as the same events a local model yields, timed here.

Failures map onto llmcli's exit codes: nothing listening or no answer in time -> 4 (network); 401/403 -> 1 with
a hint; 404 -> 3 (no such model); 400/413/422 -> 2 (the server refused the request); 429 and 5xx are retried
with backoff (only before any of the answer arrived), then 4.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2

from llmcli.errors import ExitCode, LlmcliError, ModelNotFoundError, UsageError

RETRIES = 3  # after the first try, for 429 and 5xx
BACKOFF_S = 0.5  # doubled each retry; a Retry-After the server sends is honoured (up to 10 s)
PREFILL_COMMENT = re.compile(r":\s?prefill (\d{1,9})/(\d{1,9}) (\d{1,9})")  # llmcli serve's progress (an SSE comment)
PROMPT_COMMENT = re.compile(r":\s?prompt_tokens (\d{1,9})")  # and a choice's prompt, before its first chunk
DROPPED_COMMENT = re.compile(r":\s?dropped (\d{1,6})")  # and the oldest exchanges it dropped to fit (fit_history)
TRACE_COMMENT = re.compile(r":\s?trace (\{.{1,65536}\})")  # and a traced answer's tokens (a request's `trace`)


class NetworkError(LlmcliError):
    exit_code = ExitCode.NETWORK


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API base, …/v1
    api_key: str | None = None
    timeout: float = 60.0  # seconds to connect, or between bytes of an answer
    socket: str | None = None  # a Unix socket to reach it through (a private warm server), instead of TCP
    name: str | None = None  # what messages call it (a warm server's URL means nothing to the user); None: its URL

    @property
    def where(self) -> str:
        return self.name or self.url

    @staticmethod
    def parse(url: str, api_key: str | None, timeout: float) -> Endpoint:
        text = url.strip().rstrip("/")
        if not text.startswith(("http://", "https://")) or len(text) > 2048:
            raise UsageError(f"--endpoint {url!r} is not an http(s) URL", hint="e.g. --endpoint http://127.0.0.1:8080/v1")
        return Endpoint(text if text.endswith("/v1") else text + "/v1", api_key, timeout)


def socket_transport(socket: str) -> httpx2.HTTPTransport:
    """HTTP over a Unix socket (a private warm server). No TLS there, so no certificate store is read: that read is
    ~30 ms of a warm run's start."""
    return httpx2.HTTPTransport(uds=socket, verify=False)


class Client:
    """One connection pool to the endpoint; `cancelled()` is asked between chunks of a streamed answer."""

    def __init__(self, endpoint: Endpoint, cancelled: Callable[[], bool] = lambda: False):
        self.endpoint, self.cancelled = endpoint, cancelled
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        transport = socket_transport(endpoint.socket) if endpoint.socket else None
        self.http = httpx2.Client(headers=headers, transport=transport,
                                  timeout=httpx2.Timeout(endpoint.timeout, connect=min(endpoint.timeout, 10)))

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[str]:
        response = self._send(lambda: self.http.get(f"{self.endpoint.url}/models"))
        try:
            return [str(m["id"]) for m in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise NetworkError(f"{self.endpoint.where}'s /models did not answer as an OpenAI-compatible server") from None

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed answer, as they arrive (retries only before the first)."""
        url = f"{self.endpoint.url}/{path}"
        where = f"{self.endpoint.name} ({path})" if self.endpoint.name else url
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for attempt in range(RETRIES + 1):
            try:
                with self.http.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        response.read()
                        wait = self._retry_wait(response, attempt)
                        if wait is None:
                            raise self._refused(response)
                        time.sleep(wait)
                        continue
                    finished = False  # a chunk said why the answer ended
                    for line in response.iter_lines():
                        if self.cancelled():
                            return
                        if not line.startswith("data:"):
                            progress = PREFILL_COMMENT.fullmatch(line.strip())  # (llmcli serve's: a long prompt)
                            if progress is not None:
                                yield {"llmcli_prefill": [int(n) for n in progress.groups()]}
                            prompt = PROMPT_COMMENT.fullmatch(line.strip())  # (and the prompt's tokens)
                            if prompt is not None:
                                yield {"llmcli_prompt_tokens": int(prompt.group(1))}
                            dropped = DROPPED_COMMENT.fullmatch(line.strip())  # (and what it dropped to fit)
                            if dropped is not None:
                                yield {"llmcli_dropped": int(dropped.group(1))}
                            traced = TRACE_COMMENT.fullmatch(line.strip())  # (and a traced token)
                            if traced is not None:
                                with contextlib.suppress(ValueError):
                                    yield {"llmcli_trace": json.loads(traced.group(1))}
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise NetworkError(f"{where} sent a chunk that is not JSON: {data[:80]!r}") from None
                        if isinstance(chunk, dict) and "error" in chunk:
                            own = _llmcli_error(chunk)
                            if own is not None:
                                raise LlmcliError(own[0], hint=own[1], exit_code=own[2])
                            raise UsageError(f"the server refused the request: {_message(chunk)}")
                        choices = chunk.get("choices") if isinstance(chunk, dict) else None
                        finished = finished or any(isinstance(c, dict) and bool(c.get("finish_reason"))
                                                   for c in choices or [])
                        yield chunk
                    if not finished and self.endpoint.socket:  # a warm server always says why it ended: it went away
                        raise NetworkError(f"{where} ended the answer before it was done (the connection closed)")
                    return
            except httpx2.HTTPError as exc:
                raise self._unreachable(exc) from None
        raise NetworkError(f"{where} is still busy or failing after {RETRIES} retries")

    def _send(self, call: Callable[[], httpx2.Response]) -> httpx2.Response:
        for attempt in range(RETRIES + 1):
            try:
                response = call()
            except httpx2.HTTPError as exc:
                raise self._unreachable(exc) from None
            if response.status_code == 200:
                return response
            wait = self._retry_wait(response, attempt)
            if wait is None:
                raise self._refused(response)
            time.sleep(wait)
        raise NetworkError(f"{self.endpoint.where} is still busy or failing after {RETRIES} retries")

    @staticmethod
    def _retry_wait(response: httpx2.Response, attempt: int) -> float | None:
        """Seconds to wait before trying again (429, 5xx), or None: not worth a retry."""
        if attempt >= RETRIES or not (response.status_code == 429 or response.status_code >= 500):
            return None
        after = response.headers.get("retry-after", "")
        return min(float(after), 10.0) if after.replace(".", "", 1).isdigit() else BACKOFF_S * 2**attempt

    def _refused(self, response: httpx2.Response) -> LlmcliError:
        body = _json_or_text(response)
        status, reason = response.status_code, _message(body)
        where = self.endpoint.where
        own = _llmcli_error(body)
        if own is not None:  # llmcli serve's own error: its words, hint and exit code, as an in-process run says them
            message, hint, code = own
            return LlmcliError(message if self.endpoint.name else f"{where}: {message}", hint=hint, exit_code=code)
        if status in (401, 403):
            return LlmcliError(f"{where} refused the API key ({status}): {reason}",
                               hint="Pass --api-key KEY or set LLMCLI_API_KEY.")
        if status == 404:
            return ModelNotFoundError(f"{where}: not found ({reason})", hint="`-m` names the model as the server lists "
                                      "it (GET /v1/models); the URL ends in /v1.")
        if status in (400, 413, 422):
            return UsageError(f"{where} refused the request ({status}): {reason}")
        if status == 429 or status >= 500:
            return NetworkError(f"{where} is still busy or failing ({status}) after {RETRIES} retries: {reason}")
        return NetworkError(f"{where} failed ({status}): {reason}")

    def _unreachable(self, exc: httpx2.HTTPError) -> LlmcliError:
        where = self.endpoint.where
        if isinstance(exc, httpx2.TimeoutException):
            return NetworkError(f"{where} did not answer within {self.endpoint.timeout:g} s",
                                hint="--endpoint-timeout waits longer.")
        if isinstance(exc, httpx2.ConnectError):
            return NetworkError(f"cannot connect to {where}: {exc}", hint="Is the server running? Check the URL and port.")
        return NetworkError(f"{where}: {type(exc).__name__}: {exc}")


def _llmcli_error(body: Any) -> tuple[str, str | None, ExitCode] | None:
    """The error llmcli serve sends with one of its own (`llmcli_error`): run's words, hint and exit code; else None."""
    error = body.get("error") if isinstance(body, dict) else None
    own = error.get("llmcli_error") if isinstance(error, dict) else None
    if not isinstance(own, dict):
        return None
    message, hint, code = own.get("message"), own.get("hint"), own.get("exit_code")
    try:
        exit_code = ExitCode(code) if type(code) is int else ExitCode.ERROR
    except ValueError:
        exit_code = ExitCode.ERROR
    return (_message({"error": {"message": message}}) if isinstance(message, str) else _message(body),
            " ".join(hint.split())[:300] if isinstance(hint, str) else None, exit_code)


def _json_or_text(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:200]


def _message(body: Any) -> str:
    """The server's reason, on one line (an error is one line: a server's traceback or list is folded and cut)."""
    if isinstance(body, dict):
        error = body.get("error")
        text = str(error.get("message") or error) if isinstance(error, dict) else str(error) if error is not None \
            else str(body.get("detail") or body)
    else:
        text = str(body)
    folded = " ".join(text.split())
    return (folded[:300] + "…" if len(folded) > 300 else folded) or "no reason given"
