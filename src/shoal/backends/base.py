"""The one Protocol every coding-agent CLI is driven through, and what backends share.

A backend turns a prompt into a stream of events for one conversation. It is told where
the conversation lives (`Conversation.cwd`) and keeps the CLI's own conversation id on it
(`Conversation.session_id`) so the next turn resumes it. A backend never knows about
places, flows or agents.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.errors import CLINotFound
from shoal.reply import Event

# Where pinned CLIs land: `npm ci` in the checkout that holds this package.
PROJECT_ROOT = Path(__file__).resolve().parents[3]

# Permission rules the script's user gets unless the agent says otherwise: edits and shell
# inside the session's directory, nothing outside it, nothing left waiting for a human.
DEFAULT_PERMISSIONS: dict[str, str] = {
    "edit": "allow",
    "bash": "allow",
    "webfetch": "deny",
    "external_directory": "deny",
    "question": "deny",
}


@dataclass
class Settings:
    """Everything a backend needs to run its CLI for one agent."""

    backend: str
    model: str
    base_url: str | None  # the loopback model's URL when model == "loopback"
    home: Path  # the agent's private HOME / config dirs for this CLI
    agent_id: str
    permissions: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_PERMISSIONS))
    env: dict[str, str] = field(default_factory=dict)  # extra environment (e.g. API keys)
    args: list[str] = field(default_factory=list)  # extra CLI arguments
    turn_timeout: float | None = 600.0
    transport: str | None = None  # how the CLI is driven ("run", "held", "server"...); None: its best


@dataclass
class Conversation:
    """A backend's view of one session: where it runs and the CLI's own id for it."""

    cwd: Path
    session_id: str | None = None
    state: dict[str, Any] = field(default_factory=dict)  # a held-open process, a thread id...
    # extra environment the place asks for (e.g. a SHELL that lands commands in a container);
    # every process a backend starts for this conversation gets it on top of its own
    env: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    name: str
    settings: Settings
    # keys of `Conversation.state` that name something of this process (a process handle, the
    # generation of a server it started): a session resumed by another process (a Ray actor on
    # another node) leaves them behind; the rest of its state travels with it
    process_bound: frozenset[str]

    def turn(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        """Run one turn; yield its events; raise `TurnFailed` (or a subclass) if it fails."""
        ...

    def log(self, conv: Conversation) -> Path | None:
        """Where the CLI keeps its own record of this conversation, here; None if not (yet) known."""
        ...

    async def end(self, conv: Conversation) -> None:
        """The session is over: stop whatever is held open for it."""
        ...

    async def aclose(self) -> None:
        """The agent is closing: stop everything this backend started."""
        ...


def find_cli(command: str, package: str) -> str:
    """The pinned CLI from the checkout's node_modules, else one on PATH; an override wins."""
    for var in (f"SHOAL_{command.upper()}_BIN", f"{command.upper()}_BIN"):
        override = os.environ.get(var)
        if override:
            if shutil.which(override) is None:
                raise CLINotFound(command, package, detail=f"${var} names {override!r}, which is not an executable")
            return override
    local = PROJECT_ROOT / "node_modules" / ".bin" / command
    if local.exists():
        return str(local)
    found = shutil.which(command)
    if found:
        return found
    raise CLINotFound(command, package)


def base_env(settings: Settings) -> dict[str, str]:
    """A clean environment for a CLI: the agent's own HOME and XDG dirs, nothing of the user's."""
    home = settings.home
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "USER", "LOGNAME", "SHELL", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        XDG_CACHE_HOME=str(home / ".cache"),
        SHOAL_AGENT=settings.agent_id,
        # a CLI that tries to install packages at start-up fails at once instead of waiting
        NPM_CONFIG_REGISTRY="http://127.0.0.1:9/",
    )
    env.update(settings.env)
    return env
