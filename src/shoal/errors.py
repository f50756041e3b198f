"""One hierarchy for everything shoal raises: each error says what went wrong and what to do."""

from __future__ import annotations


class ShoalError(Exception):
    """Base of every error shoal raises on purpose."""


class UnknownBackend(ShoalError, ValueError):
    def __init__(self, name: str, known: list[str]) -> None:
        self.name, self.known = name, known
        super().__init__(f"unknown backend {name!r}; known backends: {', '.join(sorted(known))}")


class BadModel(ShoalError, ValueError):
    """The model name cannot be used with this backend."""


class BadSetting(ShoalError, ValueError):
    """A setting shoal cannot use (a transport, a permission, a batch option); nothing was started."""


class BadArgument(BadSetting, TypeError):
    """A setting or argument of the wrong type (a str where a list goes, a str for a number);
    nothing was started. Both `except ValueError` and `except TypeError` catch it."""


class AgentClosed(ShoalError, RuntimeError):
    """The agent was closed; open a new one (or `clone` it) for more sessions."""


class CLINotFound(ShoalError):
    def __init__(self, cli: str, package: str, detail: str = "") -> None:
        self.cli, self.package = cli, package
        super().__init__(
            (f"{detail}. " if detail else "")
            + f"the {cli!r} command was not found. Install the pinned CLIs with `bash scripts/setup.sh` in the shoal "
            f"checkout (or `npm install -g {package}`), or point ${cli.upper()}_BIN / "
            f"SHOAL_{cli.upper()}_BIN at the executable."
        )


class PlaceError(ShoalError):
    """A session's place could not be made, found or used."""


class TurnFailed(ShoalError):
    """A turn did not complete. The session stays usable for the next turn."""

    def __init__(
        self,
        message: str,
        *,
        backend: str = "",
        exit_code: int | None = None,
        stderr_tail: str = "",
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> None:
        self.backend, self.exit_code, self.stderr_tail = backend, exit_code, stderr_tail
        self.request_id, self.session_id = request_id, session_id
        detail = [message]
        if exit_code is not None:
            detail.append(f"exit code {exit_code}")
        if request_id:
            detail.append(f"request id {request_id}")
        text = "; ".join(detail)
        if stderr_tail:
            text += "\n--- stderr (last lines) ---\n" + stderr_tail
        super().__init__(text)


class BackendCrashed(TurnFailed):
    """The CLI process died or exited non-zero without an answer."""


class ProviderError(TurnFailed):
    """The model provider answered with an error (rate limit, server error, bad credentials)."""

    def __init__(self, message: str, *, status: int | None = None, **kw: object) -> None:
        self.status = status
        super().__init__(message, **kw)  # type: ignore[arg-type]


class TurnTimeout(TurnFailed):
    """A turn ran past the agent's `turn_timeout`; its CLI was stopped."""


class HostLost(TurnFailed):
    """The node or actor hosting a session died (mid-turn, or before); the next turn starts afresh."""


class HostError(ShoalError):
    """A host for sessions cannot be used: Ray not installed, the cluster unreachable, no node free."""


class ProtocolMismatch(ShoalError):
    """The installed CLI does not speak what shoal expects (wrong version)."""


class WrongLoop(ShoalError, RuntimeError):
    """A blocking call was made from shoal's own event loop, where it would deadlock."""


class RunNotFound(ShoalError, FileNotFoundError):
    """No run by that name (or none at all) where runs are kept."""


class FlowError(ShoalError):
    """A flow could not be loaded or called (bad file, bad reference, not a coroutine)."""


class FlowArguments(FlowError, TypeError):
    """A flow was called with arguments its `async def` does not take (or without ones it needs)."""

    def __init__(self, message: str, *, missing: list[str] | None = None) -> None:
        self.missing = list(missing or [])
        super().__init__(message)


class FlowDepthExceeded(FlowError):
    """A chain of flow calls went deeper than the bottom (64)."""


class BudgetExceeded(ShoalError):
    """A flow's budget (cost, tokens or seconds) ran out; the work under it was stopped."""

    def __init__(self, message: str, *, kind: str, flow: str, limit: float, spent: float) -> None:
        self.kind, self.flow, self.limit, self.spent = kind, flow, limit, spent
        super().__init__(message)


# --- places: each names what was wrong with where a session was asked to work ------------------


class NotAGitRepo(PlaceError):
    """A Worktree was asked of a directory that is not inside a git repository."""


class DirtyBase(PlaceError):
    """The repository a Worktree branches from has uncommitted changes (pass `allow_dirty=True`)."""


class EngineNotFound(PlaceError):
    """The container engine (podman, docker) is not installed, or its daemon cannot be reached."""


class ImageNotFound(PlaceError):
    """The container image is not in the engine's local store."""


class HostUnreachable(PlaceError):
    """An SSH target could not be reached (no route, refused, timed out, unknown name)."""


class KeyRefused(PlaceError):
    """An SSH target refused the key (or the host key did not match)."""


class CheckFailed(ShoalError):
    """A unit's acceptance check did not pass (after any retries)."""

    def __init__(self, message: str, *, reply: object = None, check: object = None, tries: int = 1) -> None:
        self.reply, self.check, self.tries = reply, check, tries
        super().__init__(message)


class Stuck(CheckFailed):
    """A unit failed the same way twice in a row and was stopped instead of spending more."""


class CanaryFailed(ShoalError):
    """The first unit of a batch, run alone, failed: none of the rest were started."""


class CannotWrite(ShoalError, OSError):
    """A file shoal was asked to write (e.g. `shoal trace --perfetto OUT`) cannot be written there."""


class NotStarted(ShoalError):
    """A unit that was never started (the batch's cost cap was reached first)."""


# --- checks of what a caller passed, shared by the modules that take settings ------------------


def number(what: str, value: object, *, minimum: float = 0.0, above: bool = True, integer: bool = False,
           optional: bool = True, hint: str = "") -> None:
    """Refuse `value` unless it is a number (an int if `integer`) above (or at least) `minimum`;
    None passes when `optional`. `what` names the setting in the message."""
    if value is None and optional:
        return
    kind = "a whole number" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        none = " (or None)" if optional else ""
        raise BadArgument(f"{what} must be {kind}{none}, got {value!r} ({type(value).__name__}){hint}")
    if value != value or (value <= minimum if above else value < minimum):  # NaN is no number either
        bound = f"more than {minimum:g}" if above else f"at least {minimum:g}"
        raise BadSetting(f"{what} must be {bound}, got {value!r}{hint}")


def strings(what: str, value: object, *, example: str) -> None:
    """Refuse `value` unless it is a list or tuple of str (a lone str is the usual slip)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BadArgument(f"{what} must be a list of strings, e.g. {example}; got {value!r}")
