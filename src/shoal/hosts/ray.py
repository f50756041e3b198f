"""Sessions hosted on a Ray cluster: `shoal.Agent(..., hosts=shoal.Ray(address="auto"))`.

Each session gets a Ray actor of its own (`actor.py`), scheduled by Ray on a node with the
resources asked for (`num_cpus`, `memory`, custom `resources`, node `labels`). The actor makes
the session's place on that node, holds the backend and its CLI processes for the session's
life, and runs the turns there. The flow, the journal and the caller stay here: to them this
is one more `Backend` (`RayBackend`), and the session's place is an `OnNode` standing in for
the one the user gave, which is made on the node instead.

What comes back: every event of a turn (for the caller, the journal and the terminal view),
the usage in them (priced here, as for local turns), errors as the same named exceptions, and
for a copy or worktree the work itself — a patch after every turn, kept here, so a node that
goes away takes no finished turn's work with it (`results.py`); at the end, if `push=` names a
remote, the place's branch pushed there from the node.

Faults: a node or actor that dies mid-turn is `HostLost`. The session stays usable: its next
turn starts a fresh actor, wherever Ray puts it, makes the place again (a copy or worktree
anew, with the saved patch applied) and resumes the conversation — which the CLI keeps in the
agent's home directory. On one machine, or with `home=` on a filesystem every node shares, the
fresh actor finds it there. On another machine it is not there: that turn says so
(`HostLost`, "cannot resume") and the session's next turn starts a new conversation in the
restored place.

`import ray` happens only in this package and only when a hosted agent is made: the rest of
shoal never imports it (`pip install 'shoal[ray]'` brings it).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal import backends
from shoal.backends.base import Backend, Conversation, Settings
from shoal.errors import CLINotFound, HostError, HostLost, TurnFailed
from shoal.hosts.actor import Failed, Finished, SessionHost, Stopped
from shoal.hosts.node import OnNode
from shoal.places.base import Place
from shoal.reply import Event, Started

log = logging.getLogger("shoal")
POLL_WAIT = 10.0  # seconds the actor holds a poll open when it has nothing to say
_connect_lock = threading.Lock()


@dataclass
class Ray:
    """Where hosted sessions run, and what each one asks of a node.

    `address`: "auto" (the cluster `ray start` made on this machine), "host:port" of a head
    node, or "ray://host:10001" (Ray Client). An already connected Ray (`ray.init` called by
    the program) is used as it is. `num_cpus`, `memory` (bytes) and `resources` are what one
    session's actor reserves on its node; `labels` picks nodes by label (`ray start --labels`);
    `strategy` is a Ray scheduling strategy ("SPREAD" spreads sessions over nodes).
    `push`: a git remote (a name configured on the node, a path or a URL) each copy's or
    worktree's work is pushed to at the end, as its branch. `runtime_env`: Ray's, for each
    session's actor (e.g. to install shoal on nodes that lack it). `start_timeout`: how long a session
    waits for a node to take it."""

    address: str | None = "auto"
    num_cpus: float = 1.0
    memory: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    strategy: str | None = None
    push: str | None = None
    runtime_env: dict[str, Any] | None = None
    namespace: str = "shoal"
    start_timeout: float = 300.0

    def attach(self, settings: Settings) -> RayBackend:
        """The backend of one agent whose sessions run on this cluster (see `Agent(hosts=)`)."""
        if not installed():
            raise HostError("hosts=shoal.Ray(...) needs Ray: `pip install 'shoal[ray]'` (or `pip install ray`)")
        return RayBackend(self, settings)

    def actor_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "name": name, "namespace": self.namespace,
                                "max_restarts": 0, "max_concurrency": 16}  # next(), cancel() and the rest at once
        if self.runtime_env:
            opts["runtime_env"] = dict(self.runtime_env)  # per actor: holds even when Ray was connected already
        if self.memory:
            opts["memory"] = self.memory
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.labels:
            opts["label_selector"] = dict(self.labels)
        if self.strategy:
            opts["scheduling_strategy"] = self.strategy
        return opts


def installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def connect(host: Ray) -> Any:
    """The `ray` module, connected (once per process; an existing connection is kept).

    Ray holds one connection per process: the first hosted agent (or the program's own
    `ray.init`) decides which cluster every hosted agent of this process uses."""
    import ray

    with _connect_lock:
        # Ray Client starts a server process per connection, which on a busy machine can miss
        # the client's own deadline: a ray:// address gets a few tries before it is an error.
        tries = 3 if str(host.address).startswith("ray://") else 1
        for attempt in range(tries):
            if ray.is_initialized():
                break
            try:
                ray.init(address=host.address, namespace=host.namespace, log_to_driver=False,
                         logging_level=logging.WARNING)
            except ConnectionError as exc:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                if attempt + 1 < tries:
                    time.sleep(2.0 * (attempt + 1))
                    continue
                raise HostError(f"cannot reach the Ray cluster at {host.address!r}: {exc}. Start one "
                                f"(`ray start --head`) or pass its address: shoal.Ray(address=...)") from None
    return ray


def locate() -> dict[str, Any]:
    """Where the calling actor runs (called on the node)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "machine": machine()}


def machine() -> str:
    """Names one filesystem's machine: a pod or container has a hostname of its own."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class RayBackend:
    """The `Backend` of a hosted agent: each session's turns run by its actor, on its node."""

    process_bound: frozenset[str] = frozenset()  # its actors hold the processes; nothing of them is here

    def __init__(self, host: Ray, settings: Settings) -> None:
        self.host = host
        self.settings = settings
        self.name = settings.backend
        try:
            # the same checks as a local agent (backend, model, transport), at once
            self.local: Backend | None = backends.make(settings)
        except CLINotFound:
            self.local = None  # the CLI is needed where sessions run, not necessarily here
        self.nodes: dict[str, OnNode] = {}
        self.actors: list[Any] = []  # every actor ever started for this agent (for aclose and tests)
        self._ray: Any = None
        self._actor_class: Any = None

    # --- what the agent and its sessions see -------------------------------------------------

    def place(self, place: Place) -> OnNode:
        """The session's place, made on the node that will host the session."""
        node = OnNode(self, place)
        self.nodes[node.id] = node
        return node

    def log(self, conv: Conversation) -> Path | None:
        return None  # it lives on the node that ran the session, not here

    def held_pids(self) -> list[int]:
        return [pid for node in self.nodes.values() if node.alive for pid in node.held]

    async def turn(self, conv: Conversation, prompt: str) -> AsyncIterator[Event]:
        node = self._node(conv)
        for notice in await node.ready(conv):
            yield notice
        done = False
        try:
            try:
                await node.call(node.actor.start.remote(prompt))
            except HostLost:
                # lost between turns (found only now): nothing of this turn ran yet, so it moves at once
                for notice in await node.ready(conv):
                    yield notice
                await node.call(node.actor.start.remote(prompt))
            actor = node.actor
            while not done:
                for item in await node.call(actor.next.remote(POLL_WAIT)):
                    if isinstance(item, Finished):
                        conv.session_id = item.session_id
                        node.state, node.held, done = item.state, item.held, True
                        break
                    if isinstance(item, Failed):
                        done = True
                        raise item.exception()
                    if isinstance(item, Stopped):
                        done = True
                        raise TurnFailed("the turn was stopped on its node", backend=self.name,
                                         session_id=conv.session_id)
                    if isinstance(item, Started):
                        conv.session_id = item.session_id
                    yield item  # type: ignore[misc]
        except HostLost as exc:
            exc.session_id = exc.session_id or conv.session_id  # the conversation the next turn resumes
            raise
        finally:
            if not done:  # cancelled, timed out, given up on: stop the CLI over there, and wait for it
                await node.stop_turn()

    async def end(self, conv: Conversation) -> None:
        node = self._node(conv)
        if node.alive:
            with contextlib.suppress(HostLost):
                await node.call(node.actor.end.remote())

    async def aclose(self) -> None:
        await asyncio.gather(*(node.shutdown() for node in list(self.nodes.values())), return_exceptions=True)
        if self.local is not None:
            await self.local.aclose()

    def _node(self, conv: Conversation) -> OnNode:
        node = self.nodes.get(conv.env.get(OnNode.VAR, ""))
        if node is None:
            raise TurnFailed("a session of a Ray-hosted agent must be opened with agent.session()", backend=self.name)
        return node

    # --- actors ------------------------------------------------------------------------------

    async def new_actor(self, name: str) -> tuple[Any, dict[str, Any]]:
        """A fresh actor for one session, once a node has taken it: (handle, where it runs)."""
        if self._ray is None:
            self._ray = await asyncio.to_thread(connect, self.host)
            self._actor_class = self._ray.remote(SessionHost)
        tag = uuid.uuid4().hex
        actor = self._actor_class.options(**self.host.actor_options(name)).remote(self.settings, tag, locate)
        self.actors.append(actor)
        try:
            where = await asyncio.wait_for(self.call(actor.ready.remote(), name), self.host.start_timeout)
        except TimeoutError:
            self.kill(actor)
            opts = self.host.actor_options(name)
            raise HostError(f"no Ray node took session {name} within {self.host.start_timeout:.0f} s "
                            f"(it asks for num_cpus={opts['num_cpus']}, resources={opts.get('resources', {})}, "
                            f"labels={opts.get('label_selector', {})}); `ray status` shows what the cluster "
                            f"has free") from None
        except BaseException:
            self.kill(actor)
            raise
        return actor, where

    async def call(self, ref: Any, what: str, where: dict[str, Any] | None = None) -> Any:
        """Await an actor call; a dead actor or node is `HostLost`, a remote error is itself."""
        exceptions = self._ray.exceptions
        try:
            return await asyncio.wrap_future(ref.future())
        except exceptions.RayActorError as exc:
            on = f" on node {where.get('ip')} ({where.get('hostname')})" if where else ""
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise HostLost(f"the Ray actor hosting session {what}{on} died: {cause}", backend=self.name) from None
        except exceptions.RayTaskError as exc:
            inner = getattr(exc, "cause", None)
            if isinstance(inner, BaseException):
                raise inner from None
            raise

    def kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(actor, no_restart=True)

    def remote_home(self, where: dict[str, Any]) -> bool:
        """Remove the agent's home on that node at the end? Only one shoal made, and not this machine's."""
        home = self.settings.home
        made = home.name == f"{self.settings.backend}-{self.settings.agent_id}"
        return made and where.get("machine") != machine()


__all__ = ["OnNode", "Ray", "RayBackend", "connect", "machine"]
