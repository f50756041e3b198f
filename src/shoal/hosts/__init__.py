"""Where sessions run when one machine is not enough: hosts for an agent's sessions.

A host takes an agent's settings and gives back the agent's backend (`attach`), whose
sessions run somewhere else, and turns each place a session is given into one made there
(`place`). The one host is Ray (`shoal.Ray`): an existing distributed engine that users
already operate, never one of shoal's own. Importing this package does not import ray.
"""

from __future__ import annotations

from typing import Protocol

from shoal.backends.base import Backend, Settings
from shoal.hosts.ray import Ray, RayBackend
from shoal.places.base import Place


class HostedBackend(Backend, Protocol):
    def place(self, place: Place) -> Place:
        """The session's place, made where the session will run."""
        ...


class Host(Protocol):
    def attach(self, settings: Settings) -> HostedBackend:
        """The backend of one agent whose sessions run on this host."""
        ...


__all__ = ["Host", "HostedBackend", "Ray", "RayBackend"]
