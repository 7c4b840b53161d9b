"""huggingface_hub's and the transport's exceptions -> one-line LlmcliErrors with hints: one ordered table."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from llmcli.errors import ExitCode, LlmcliError, ModelNotFoundError, ResourceError, UsageError
from llmcli.references import HubReference


def endpoint() -> str:
    from llmcli.hub import endpoint as hub_endpoint

    return hub_endpoint()


@contextmanager
def translated(reference: HubReference | None) -> Iterator[None]:
    """huggingface_hub's and the transport's exceptions -> one-line LlmcliErrors (order matters)."""
    from llmcli.hub import _hf

    _hf()  # configures the library before its first use
    from huggingface_hub import errors

    name = str(reference) if reference else "the cache"
    repo = reference.repo_id if reference else ""
    try:
        yield
    except (LlmcliError, KeyboardInterrupt):
        raise
    except errors.GatedRepoError:
        raise LlmcliError(
            f"{repo} is gated: you need to accept its terms and authenticate to download it",
            hint="Accept the license on the model page, then set HF_TOKEN to a token with access.",
        ) from None
    except errors.RepositoryNotFoundError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", 404)
        raise ModelNotFoundError(
            f"repository {repo} not found on {endpoint()}" + (" (or it is private)" if status == 401 else ""),
            hint="Check the name (OWNER/REPO); a private repository needs HF_TOKEN.",
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"revision {reference.revision if reference else ''!r} not found in {repo}") from None
    except errors.RemoteEntryNotFoundError:
        raise ModelNotFoundError(f"{name}: file not found in the repository", hint="`llmcli pull OWNER/REPO` lists the files.") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise ModelNotFoundError(f"{name} is not in the cache and the Hub cannot be asked (offline)",
                                 hint="Run `llmcli pull` while online.") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise LlmcliError(f"{endpoint()} refused access to {repo} (HTTP {status})",
                              hint="Set HF_TOKEN to a token with access to this repository.") from None
        raise LlmcliError(f"the Hub answered HTTP {status} for {name}", exit_code=ExitCode.NETWORK,
                          hint="Try again later, or use --offline for what is cached.") from None
    except UsageError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ResourceError(f"the disk filled up while downloading {name}",
                                hint="Free some space and pull again; nothing partial was kept.") from None
        raise _network_error(name, exc) from None
    except Exception as exc:  # the HTTP library's transport errors (connect, read, truncated body)
        raise _network_error(name, exc) from None


def _network_error(name: str, exc: BaseException) -> LlmcliError:
    return LlmcliError(
        f"download of {name} from {endpoint()} failed: {type(exc).__name__}: {str(exc)[:200]}",
        exit_code=ExitCode.NETWORK,
        hint="Check the connection and pull again; --offline uses only the cache.",
    )
