"""Coding-agent CLIs, one module each, behind the `Backend` Protocol in `base.py`."""

from __future__ import annotations

import importlib

from shoal.backends.base import Backend, Conversation, Settings
from shoal.errors import UnknownBackend

# name -> "module:class"; imported on first use so an agent of one backend loads only its own
REGISTRY: dict[str, str] = {
    "opencode": "shoal.backends.opencode:OpenCode",
    "claude": "shoal.backends.claude:Claude",
    "codex": "shoal.backends.codex:Codex",
}


def make(settings: Settings) -> Backend:
    ref = REGISTRY.get(settings.backend)
    if ref is None:
        raise UnknownBackend(settings.backend, list(REGISTRY))
    module, _, cls = ref.partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(settings)
    return backend


__all__ = ["REGISTRY", "Backend", "Conversation", "Settings", "make"]
