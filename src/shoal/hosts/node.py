"""A hosted session's place, as the caller sees it: the user's place, made on a node instead.

`OnNode` stands in for the place the user gave (`where=`): opening it starts the session's
actor and has the actor make the real place on its node; after every turn it fetches the
work so far (a patch, for a copy or worktree); closing it has the node give the place back and
keeps the last patch here, in shoal's state directory, whenever it holds anything — so the
work of every finished turn outlives the node.

It is also where a session moves when its actor is lost: `ready()` starts a fresh actor, which
makes the place again (with the patch applied) and picks the conversation up if its node can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.backends.base import Conversation
from shoal.errors import HostLost
from shoal.hosts.results import changed_paths
from shoal.places import registry
from shoal.places.base import Place
from shoal.reply import Notice

if TYPE_CHECKING:
    from shoal.hosts.ray import RayBackend

log = logging.getLogger("shoal")
STOP_WAIT = 45.0  # for a cancelled remote turn to stop its CLI (the actor gives it 30 s)
SHUTDOWN_WAIT = 30.0


def patches_dir() -> Path:
    """Where the work of hosted copies and worktrees is kept on this side."""
    return registry.root() / "hosted"


class OnNode:
    """A place made on the node of the session's actor (see the module docstring)."""

    VAR = "SHOAL_HOST_SESSION"  # in the conversation's env: which OnNode a turn belongs to
    kind = "ray"

    def __init__(self, backend: RayBackend, inner: Place) -> None:
        self.backend = backend
        self.inner = inner
        self.id = uuid.uuid4().hex[:12]
        self.name = f"shoal-{backend.settings.agent_id}-{self.id}"  # the actor's name in Ray
        self.actor: Any = None
        self.alive = False
        self.where: dict[str, Any] = {}
        self.state: dict[str, Any] = {}  # the conversation's portable state, for a fresh actor
        self.held: list[int] = []
        self.patch = ""  # the place's work as of the last finished turn (copy and worktree)
        self.saved: Path | None = None  # where that patch was kept at the end
        self.pushed: str | None = None
        self.moves = 0
        self.closed = False

    # --- the Place protocol ------------------------------------------------------------------

    def check(self) -> None:
        return None  # the place is made on a node the caller may not see: it is checked there

    async def open(self) -> Path:
        if self.alive:
            return Path(self.where["cwd"])
        await self._start(None)
        return Path(self.where["cwd"])

    def env(self) -> dict[str, str]:
        return {self.VAR: self.id}

    async def after_turn(self) -> None:
        if not self.alive:
            return  # the turn already said what happened to its node
        try:
            patch = await self.call(self.actor.after_turn.remote())
        except Exception as exc:  # not the turn's failure: say so, keep the last good patch
            log.warning("session %s: could not fetch its work from node %s: %s", self.id, self.where.get("ip"), exc)
            return
        if patch is not None:
            self.patch = patch

    async def close(self) -> str | None:
        if self.closed or self.actor is None:
            return None
        self.closed = True
        notes: list[str] = []
        if self.alive:
            try:
                got = await self.call(self.actor.close.remote(self.backend.host.push, f"shoal/{self.id}",
                                                              f"shoal: the work of session {self.id}"))
            except Exception as exc:
                notes.append(f"its node could not give the place back ({exc})")
            else:
                self.patch = got["patch"] if got["patch"] is not None else self.patch
                self.pushed = got["pushed"]
                if got["pushed"]:
                    notes.append(f"pushed branch {got['pushed']}")
                if got["push_failed"]:
                    notes.append(f"could not push its branch: {got['push_failed']}")
                if got["note"]:
                    notes.append(f"on node {self.where.get('ip')} ({self.where.get('hostname')}): {got['note']}")
        else:
            notes.append(f"its node {self.where.get('ip')} is gone")
        if self.patch:
            self.saved = await asyncio.to_thread(self._save)
            files = changed_paths(self.patch)
            notes.insert(0, f"the work of hosted session {self.id} ({len(files)} file(s)) is kept as a patch: "
                            f"{self.saved} (apply with `git apply {self.saved}`)")
        await self.shutdown()
        return "; ".join(notes) or None

    def describe(self) -> str:
        where = f"ray node {self.where.get('ip')} ({self.where.get('hostname')})" if self.where else "a ray node"
        return f"{self.inner.describe()} on {where}"

    # --- the actor ---------------------------------------------------------------------------

    async def call(self, ref: Any) -> Any:
        try:
            return await self.backend.call(ref, self.id, self.where)
        except HostLost:
            self.alive = False
            raise

    async def _start(self, session_id: str | None) -> bool:
        """A fresh actor with the place made on its node; whether it holds the conversation."""
        self.actor, where = await self.backend.new_actor(self.name)
        self.alive = True
        try:
            opened = await self.call(self.actor.open.remote(self.inner, self.id, session_id, self.state, self.patch))
        except BaseException:
            self.alive = False
            self.backend.kill(self.actor)
            raise
        self.where = {**where, **opened}
        return bool(opened["resumable"])

    async def ready(self, conv: Conversation) -> list[Notice]:
        """Before a turn: a live actor for it, started afresh if the last one was lost."""
        if self.alive:
            return []
        if self.closed:
            raise HostLost(f"hosted session {self.id} is closed", backend=self.backend.name)
        lost = self.where
        self.backend.kill(self.actor)  # a dead actor stays dead (no restarts behind our back)
        resumed = await self._start(conv.session_id)
        self.moves += 1
        conv.cwd = Path(self.where["cwd"])
        was = f"{lost.get('ip')} ({lost.get('hostname')})"
        now = f"{self.where.get('ip')} ({self.where.get('hostname')})"
        if conv.session_id and not resumed:
            old, conv.session_id = conv.session_id, None
            self.state = {}
            raise HostLost(f"session {self.id} moved from node {was} to {now}, which cannot resume conversation {old}: "
                           f"the CLI kept it in the agent's home ({self.backend.settings.home}) on the lost machine. "
                           f"The place is restored; the next turn starts a new conversation there (put the agent's "
                           f"home on a filesystem every node shares to resume across machines)",
                           backend=self.backend.name, session_id=old)
        return [Notice("host", f"session {self.id} moved from lost node {was} to {now}"
                               + (f"; conversation {conv.session_id} resumed" if conv.session_id else ""))]

    async def stop_turn(self) -> None:
        """A turn given up on here: stop it on the node, and wait until its CLI is stopped."""
        if not self.alive:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.call(self.actor.cancel.remote())), STOP_WAIT)

    async def shutdown(self) -> None:
        """End the actor: stop its CLI processes (the reaper sweeps the rest), then kill it."""
        if self.actor is None:
            return
        actor, self.actor = self.actor, None
        if self.alive:
            self.alive = False
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.backend.call(actor.shutdown.remote(self.backend.remote_home(self.where)),
                                                         self.id, self.where), SHUTDOWN_WAIT)
        self.backend.kill(actor)

    def _save(self) -> Path:
        out = patches_dir()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.patch"
        path.write_text(self.patch)
        return path
