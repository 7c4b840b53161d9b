"""`llmcli launch AGENT`: a coding agent run against a local model — a loopback `llmcli serve` of the model, started
in the background (or the one already running for it), with a context sized for the agent and a key of its own,
and the agent configured the way it expects: environment for Claude Code and OpenCode, `-c` overrides for Codex,
flags for aider. Nothing of the user's own configuration is written or changed.

A launch server is a warm server on TCP (agents speak HTTP, not Unix sockets): one per model and context, recorded
in the private warm servers' directory (its URL, key and pid, 0600), exiting once its model has been idle for the
keep-alive. Speaks HTTP only: no llama.cpp here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2

from llmcli import __version__, paths
from llmcli.config import settings
from llmcli.errors import ExitCode, LlmcliError, UsageError
from llmcli.pipeline.warm import Health, starting
from llmcli.units import keeps_loaded

ANSWER_ROOM = 4096  # tokens an agent's answers (and a few turns) need beyond its own prompt
LAUNCH_KEEP_ALIVE = "30m"  # a launch server outlives a pause in the session (unless a keep-alive is set)
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Served:
    """The server an agent talks to: its base URL (no path), key, model name, context and process."""

    url: str
    key: str
    model: str
    n_ctx: int
    pid: int


@dataclass(frozen=True)
class Setup:
    """How an agent is pointed at the server: its environment and its arguments (before the user's own)."""

    env: dict[str, str]
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Agent:
    name: str  # as `llmcli launch` takes it
    title: str
    command: str  # the executable on PATH
    install: str  # how to install it
    prompt_tokens: int  # about how many tokens its own prompt (instructions and tool definitions) takes: measured in
    # Gemma-3's vocabulary for Claude Code 2.1.197 (19,332 with its default tools) and Codex 0.171 (8,747); OpenCode's
    # and aider's as their projects describe them
    context: int  # the context it is given when the model's trained context allows
    configure: Callable[[Served], Setup]

    @property
    def needs(self) -> int:
        """The least context that holds the agent's prompt and its answers."""
        return self.prompt_tokens + ANSWER_ROOM


def _claude(served: Served) -> Setup:
    """Claude Code: the Anthropic API at the server, every model tier mapped to the local model, no traffic to
    Anthropic (telemetry, updates) and no API key of the user's sent."""
    return Setup({"ANTHROPIC_BASE_URL": served.url, "ANTHROPIC_AUTH_TOKEN": served.key, "ANTHROPIC_API_KEY": "",
                  "ANTHROPIC_MODEL": served.model, "ANTHROPIC_SMALL_FAST_MODEL": served.model,
                  "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
                  "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})


def _codex(served: Served) -> Setup:
    """Codex: a model provider named llmcli (the Responses API) given as `-c` overrides, its key in the
    environment — the user's config.toml is read as always and never written."""
    provider = f'{{name = "llmcli", base_url = "{served.url}/v1", wire_api = "responses", env_key = "LLMCLI_LAUNCH_KEY"}}'
    return Setup({"LLMCLI_LAUNCH_KEY": served.key},
                 ("-c", f"model_providers.llmcli={provider}", "-c", 'model_provider="llmcli"', "-m", served.model))


def _opencode(served: Served) -> Setup:
    """OpenCode: an inline config (OPENCODE_CONFIG_CONTENT, merged over the user's): an OpenAI-compatible provider."""
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"llmcli": {"npm": "@ai-sdk/openai-compatible", "name": "llmcli",
                                      "options": {"baseURL": f"{served.url}/v1", "apiKey": served.key},
                                      "models": {served.model: {"name": served.model,
                                                                "limit": {"context": served.n_ctx, "output": ANSWER_ROOM}}}}},
              "model": f"llmcli/{served.model}"}
    return Setup({"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


def _aider(served: Served) -> Setup:
    """aider: OpenAI-compatible flags (litellm's `openai/` prefix), the key in the environment."""
    return Setup({"OPENAI_API_KEY": served.key},
                 ("--openai-api-base", f"{served.url}/v1", "--model", f"openai/{served.model}",
                  "--no-show-model-warnings"))


AGENTS = {agent.name: agent for agent in (
    Agent("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code", 19_400, 32_768, _claude),
    Agent("codex", "Codex", "codex", "npm install -g @openai/codex", 8_800, 32_768, _codex),
    Agent("opencode", "OpenCode", "opencode", "npm install -g opencode-ai", 10_000, 32_768, _opencode),
    Agent("aider", "aider", "aider", "pipx install aider-chat", 3_000, 16_384, _aider),
)}


def agent_of(name: str) -> Agent:
    try:
        return AGENTS[name]
    except KeyError:
        raise UsageError(f"no agent {name!r} to launch", hint="Agents: " + ", ".join(AGENTS)) from None


def context_for(agent: Agent, model: str, trained: int | None, given: int | None) -> int:
    """The context the agent's server gets: the one given, else the agent's own capped at the model's trained
    context; a ResourceError (exit 6) when that cannot hold the agent's prompt and its answers."""
    n_ctx = given or min(agent.context, trained or agent.context)
    if n_ctx < agent.needs:
        what = f"--ctx-size {given}" if given else f"{model}'s trained context ({trained} tokens)"
        raise LlmcliError(f"{what} cannot hold {agent.title}'s prompt (about {agent.prompt_tokens:,} tokens) and its "
                          f"answers: it needs at least {agent.needs:,}",
                          hint=f"Use a model trained on at least {agent.needs:,} tokens, e.g. -m gemma3-270m.",
                          exit_code=ExitCode.RESOURCES)
    return n_ctx


# -- the server ------------------------------------------------------------------------------------


def _record_path(model_path: Path, n_ctx: int) -> Path:
    identity = json.dumps([__version__, str(model_path.resolve()), n_ctx])
    return paths.warm_servers_dir() / f"launch-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"


def health(url: str, key: str, timeout: float = 2.0) -> Health | None:
    """What the launch server at `url` says of itself (with its key: its pid too), or None."""
    try:
        found: Health = httpx2.get(f"{url}/health", timeout=timeout,
                                           headers={"Authorization": f"Bearer {key}"}).json()
        return found if "models" in found else None
    except (httpx2.HTTPError, OSError, ValueError):
        return None


def running() -> list[tuple[Path, Health]]:
    """The launch servers of this user that answer: each record's path, with the server's health (a record whose
    server is gone is removed)."""
    folder = paths.warm_servers_dir()
    try:
        mine = folder.is_dir() and paths.private_warm_servers_dir() == folder
    except OSError:
        mine = False
    found = []
    for record in sorted(folder.glob("launch-*.json")) if mine else []:
        try:
            saved = json.loads(record.read_text())
            state = health(saved["url"], saved["key"])
        except (OSError, ValueError, KeyError, TypeError):
            state = None
        if state is None:
            for leftover in (record, record.with_suffix(".log"), record.with_suffix(".lock")):
                leftover.unlink(missing_ok=True)
        else:
            found.append((record, {**state, "url": saved["url"]}))
    return found


def ensure(model_ref: str, model_path: Path, n_ctx: int, effective: settings.Settings) -> Served:
    """The launch server of this model and context: the one running, else one started now (LlmcliError if it will
    not start)."""
    record = _record_path(model_path, n_ctx)
    found = _running_at(record, n_ctx)
    if found is not None:
        return found
    with starting(record):  # one start at a time: a second launch waits, then finds the first one's server
        return _running_at(record, n_ctx) or _start(record, model_ref, n_ctx, effective)


def _running_at(record: Path, n_ctx: int) -> Served | None:
    """The server a record names, if it answers as the one recorded."""
    try:
        saved = json.loads(record.read_text())
        state = health(saved["url"], saved["key"])
        if state is not None and int(state.get("pid") or 0) == saved["pid"]:
            return Served(saved["url"], saved["key"], str(state.get("model") or saved["model"]), n_ctx, saved["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _start(record: Path, model_ref: str, n_ctx: int, effective: settings.Settings) -> Served:
    key = "llmcli-" + secrets.token_urlsafe(24)
    keep_alive = str(effective["keep_alive"] if given_keep_alive(effective) else LAUNCH_KEEP_ALIVE)
    command = [sys.executable, "-m", "llmcli", "serve", "-m", model_ref, "--host", "127.0.0.1", "--port", "0",
               "-c", str(n_ctx), "--keep-alive", keep_alive, "--exit-when-idle",
               "-P", "1", "--max-models", "1", "--no-webui"]
    environment = {**os.environ, "LLMCLI_API_KEY": key}  # (not in argv: other users can read a command line)
    environment.pop("LLMCLI_KEEP_ALIVE", None)
    log = record.with_suffix(".log")
    log.unlink(missing_ok=True)
    with os.fdopen(paths.open_private(log, os.O_RDWR | os.O_CREAT | os.O_EXCL), "w+b") as output:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=output,
                                   env=environment, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            output.seek(0)
            text = output.read().decode(errors="replace")
            found = re.search(r"http://127\.0\.0\.1:(\d+)", text)
            state = health(f"http://127.0.0.1:{found.group(1)}", key) if found else None
            if found and state is not None:
                served = Served(f"http://127.0.0.1:{found.group(1)}", key, str(state.get("model") or model_ref), n_ctx,
                                process.pid)
                saved = {"url": served.url, "key": key, "pid": process.pid, "model": served.model, "n_ctx": n_ctx}
                with os.fdopen(paths.open_private(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as handle:
                    json.dump(saved, handle)
                return served
            if process.poll() is not None:
                reason = " ".join(text.split()[-40:]) or f"exit {process.returncode}"
                raise LlmcliError(f"the model's server did not start: {reason}")
            time.sleep(0.1)
    process.terminate()
    raise LlmcliError(f"the model's server did not answer within {START_TIMEOUT_S:.0f} s")


def given_keep_alive(effective: settings.Settings) -> bool:
    """A keep-alive the user set (flag, environment, config file) that keeps the model loaded: the launch server's."""
    return effective.sources["keep_alive"] != "default" and keeps_loaded(effective["keep_alive"])
