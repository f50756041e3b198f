"""An agent: one coding-agent CLI with one model and settings, holding many sessions.

    agent = shoal.Agent("opencode", model="loopback")
    s = agent.session(where="some/dir")      # lazy: nothing starts
    r = s.run("...")                         # or: await s.arun("...")

Closing the agent (or leaving its `with` block) stops every turn and process it started
and gives back every place its sessions made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal import backends, fleet, homes
from shoal.backends.base import DEFAULT_PERMISSIONS, Settings
from shoal.errors import AgentClosed, BadArgument, BadModel, BadSetting, number, strings
from shoal.fleet import Where
from shoal.places import Place, as_place
from shoal.runtime import runtime
from shoal.scope import current_scope
from shoal.session import Session

if TYPE_CHECKING:
    from shoal.hosts import Host, HostedBackend

log = logging.getLogger("shoal")


PERMISSION_ACTIONS = ("allow", "deny", "ask")


def _check_settings(backend: object, model: object, permissions: object, env: object, args: object,
                    home: object, turn_timeout: object, hosts: object) -> None:
    """Settings shoal cannot use are refused here, before anything starts (BadSetting / BadArgument)."""
    if not isinstance(model, str):
        raise BadModel(f"model must be a string ('loopback', or e.g. 'anthropic/claude-sonnet-4-5'), got {model!r}")
    if permissions is not None:
        if not isinstance(permissions, dict):
            raise BadArgument(f"permissions must be a dict of rule -> 'allow'/'deny'/'ask', "
                              f"e.g. {{'bash': 'deny'}}; got {permissions!r}")
        for key, action in permissions.items():
            if not isinstance(key, str):
                raise BadArgument(f"permission rule {key!r} must be a string (a tool, or tool:pattern)")
            if backend == "codex" and key == "sandbox":
                continue  # codex's sandbox mode by name (checked by the codex backend)
            if action not in PERMISSION_ACTIONS:
                raise BadSetting(f"permission {key!r}: {action!r} is not allow, deny or ask")
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise BadArgument(f"env must be a dict of str -> str, e.g. {{'ANTHROPIC_API_KEY': '...'}}; got {env!r}")
    if args is not None:
        strings("args", args, example="['--verbose']")
    if home is not None:
        if not isinstance(home, (str, Path)):
            raise BadArgument(f"home must be a directory path, got {home!r}")
        if Path(home).expanduser().exists() and not Path(home).expanduser().is_dir():
            raise BadSetting(f"home {home} exists and is not a directory; pass a directory (or leave home unset)")
    number("turn_timeout (seconds)", turn_timeout, hint="; None means no limit")
    if hosts is not None and not callable(getattr(hosts, "attach", None)):
        raise BadArgument(f"hosts must be a host for sessions such as shoal.Ray(...), got {hosts!r}")


class Agent:
    """One CLI, one model, one set of settings, one id; as many sessions as you like."""

    def __init__(
        self,
        backend: str = "opencode",
        model: str = "loopback",
        *,
        name: str | None = None,
        permissions: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        home: str | Path | None = None,
        turn_timeout: float | None = 600.0,
        base_url: str | None = None,
        transport: str | None = None,
        hosts: Host | None = None,
    ) -> None:
        _check_settings(backend, model, permissions, env, args, home, turn_timeout, hosts)
        self.id = uuid.uuid4().hex[:10]
        self.name = name or f"{backend}-{self.id[:6]}"
        self._own_home = home is None  # a home shoal made is removed with the agent
        if model == "loopback" and base_url is None:
            from shoal.loopback import shared  # the embedded default: started on first use

            base_url = shared().url
        perms = dict(DEFAULT_PERMISSIONS)
        perms.update({k: ("deny" if v == "ask" else v) for k, v in (permissions or {}).items()})
        self.settings = Settings(
            backend=backend,
            model=model,
            base_url=base_url,
            home=Path(home).absolute() if home else homes.agents_dir() / f"{backend}-{self.id}",
            agent_id=self.id,
            permissions=perms,
            env=dict(env or {}),
            args=list(args or []),
            turn_timeout=turn_timeout,
            transport=transport,
        )
        self.hosts = hosts
        # with hosts (e.g. shoal.Ray(...)) each session and its CLI run on a node of theirs:
        # the same Backend protocol either way, and the same checks of the settings at once
        self._hosted: HostedBackend | None = hosts.attach(self.settings) if hosts is not None else None
        self.backend = self._hosted or backends.make(self.settings)  # unknown backend, bad model, missing CLI: now
        self.sessions: list[Session] = []
        self.kept: list[str] = []  # notes on places kept at close because they hold work
        self.closed = False

    @property
    def model(self) -> str:
        return self.settings.model

    def __repr__(self) -> str:
        return f"<Agent {self.name} {self.settings.backend}/{self.model} sessions={len(self.sessions)}>"

    def session(self, where: Place | str | Path | None = None, *, name: str | None = None) -> Session:
        """A new conversation rooted at `where` (a directory or a Place). Starts nothing."""
        if self.closed:
            raise AgentClosed(f"agent {self.name} is closed: open a new one, or clone() it, for more sessions")
        place = as_place(where)
        if self._hosted is not None:
            place = self._hosted.place(place)  # made on the node that hosts the session
        place.check()
        s = Session(self.backend, place, name=name, timeout=self.settings.turn_timeout)
        self.sessions.append(s)
        scope = current_scope()
        if scope is not None:
            scope.adopt(s)  # opened inside a flow: the flow's branch closes it when it ends
            # whose conversation it is, on the record before its first turn (`shoal watch` groups by agent)
            scope.record("session.made", session=s.id, name=s.name, agent=self.id, agent_name=self.name,
                         backend=self.settings.backend, model=self.model, place=place.describe())
        return s

    # --- batches -------------------------------------------------------------------------------

    def batch(self, prompts: Sequence[Any], where: Where = None, *, limit: int | None = None,
              suppress: bool = False, **guardrails: Any) -> list[Any]:
        """One session apiece, answers in the order asked (blocking twin of `abatch`).

        Guardrails: `canary`, `check` (a command run in each unit's place), `retries`,
        `retry_prompt`, `cost_cap`, `on_update` (called with every unit whenever one moves).
        """
        return runtime.call(self._batch(prompts, where, limit, suppress, guardrails))

    async def abatch(self, prompts: Sequence[Any], where: Where = None, *, limit: int | None = None,
                     suppress: bool = False, **guardrails: Any) -> list[Any]:
        """The awaited twin of `batch`: same arguments, same answers."""
        return await runtime.acall(self._batch(prompts, where, limit, suppress, guardrails))

    async def _batch(self, prompts: Sequence[Any], where: Where, limit: int | None, suppress: bool,
                     guardrails: dict[str, Any]) -> list[Any]:
        opts = fleet.options(where, limit, suppress, guardrails)
        return await fleet.run_batch(self, prompts, opts)

    def clone(self, **changes: Any) -> Agent:
        """An agent of its own with these settings changed (a new id, no sessions)."""
        s = self.settings
        kwargs: dict[str, Any] = {
            "backend": s.backend, "model": s.model, "permissions": s.permissions, "env": s.env,
            "args": s.args, "turn_timeout": s.turn_timeout, "base_url": s.base_url, "transport": s.transport,
            "hosts": self.hosts,
        }
        kwargs.update(changes)
        return Agent(**kwargs)

    # --- closing -----------------------------------------------------------------------------

    def close(self) -> list[str]:
        return runtime.call(self._close()) if not self.closed else self.kept

    async def aclose(self) -> list[str]:
        return await runtime.acall(self._close()) if not self.closed else self.kept

    async def _close(self) -> list[str]:
        self.closed = True
        notes = await asyncio.gather(*(s._close() for s in self.sessions), return_exceptions=True)
        for note in notes:
            if isinstance(note, BaseException):
                log.warning("closing a session failed: %s", note)
            elif note:
                self.kept.append(note)
                log.warning("%s", note)
        await self.backend.aclose()
        homes.release(self.settings.home, self.id)
        if self._own_home:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, self.settings.home, True)
        return self.kept

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
