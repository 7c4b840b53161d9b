"""Errors the core raises and the exit codes they map to.

The core raises an `LlmcliError` with a one-line message and an optional hint;
the CLI's single error funnel (`llmcli.cli.main`) prints them on stderr and
exits with `exit_code`. The table below is the contract documented in the README.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1  # internal or otherwise unclassified error
    USAGE = 2  # bad flags or arguments
    NOT_FOUND = 3  # model reference that resolves to nothing
    NETWORK = 4  # the Hub could not be reached
    INTEGRITY = 5  # not a GGUF, corrupt/truncated file, checksum mismatch
    RESOURCES = 6  # context window, memory or disk too small
    TEMPLATE = 7  # chat template failed to compile or render
    INVALID_ANSWER = 8  # the answer is not the JSON that --format json / --json-schema asked for
    INTERRUPTED = 130  # SIGINT (Ctrl-C)
    STDOUT_CLOSED = 141  # the reader of stdout went away (128 + SIGPIPE)
    TERMINATED = 143  # SIGTERM


class LlmcliError(Exception):
    """An error with a message fit for a user, a hint, and an exit code."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, hint: str | None = None, exit_code: ExitCode | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(LlmcliError):
    exit_code = ExitCode.USAGE


class ModelNotFoundError(LlmcliError):
    exit_code = ExitCode.NOT_FOUND


class IntegrityError(LlmcliError):
    exit_code = ExitCode.INTEGRITY


class ResourceError(LlmcliError):
    exit_code = ExitCode.RESOURCES


class ContextLost(ResourceError):
    """A KV cache that could not grow, and then not be made again at the size it had: the engine has no context
    left (its process cannot answer again: a server starts another, a chat ends)."""


class TemplateError(LlmcliError):
    exit_code = ExitCode.TEMPLATE


class InvalidAnswer(LlmcliError):
    """The answer was printed, but it is not the JSON that --format json / --json-schema asked for."""

    exit_code = ExitCode.INVALID_ANSWER


class StdoutClosed(LlmcliError):
    """Raised by the output sink when the reader of stdout has gone away."""

    exit_code = ExitCode.STDOUT_CLOSED

    def __init__(self) -> None:
        super().__init__("stdout was closed by its reader")


class Terminated(BaseException):
    """SIGTERM outside generation: unwinds like Ctrl-C so cleanup (temporary files, locks) runs.

    A BaseException, so that code catching Exception (a library's retry loop) cannot swallow it."""
