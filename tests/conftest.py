"""Shared fixtures: one loopback model per test run, a leftover-process counter."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal import backends
from shoal.loopback import LoopbackModel, shared
from shoal.procs import tagged_pids


def available_backends() -> list[str]:
    names = []
    for name, ref in backends.REGISTRY.items():
        try:
            importlib.import_module(ref.partition(":")[0])
        except ImportError:
            continue  # a backend not written yet is not part of the suite
        names.append(name)
    return names


# A backend's other transports run the suite too, as "name:transport"; plain "name" is its default.
OTHER_TRANSPORTS: dict[str, list[str]] = {"opencode": ["run"], "claude": ["run"], "codex": ["run"]}
BACKENDS = available_backends()
BACKENDS += [f"{name}:{t}" for name in list(BACKENDS) for t in OTHER_TRANSPORTS.get(name, [])]


def make_agent(backend: str, **kwargs: Any) -> shoal.Agent:
    """An agent for a suite entry: "name" (its default transport) or "name:transport"."""
    name, _, transport = backend.partition(":")
    return shoal.Agent(name, transport=transport or None, **kwargs)


def stray(agent: shoal.Agent, settle: float = 1.0) -> list[Any]:
    """What turns left behind: the agent's tagged processes, less those its backend holds by design."""
    held = {str(pid) for pid in getattr(agent.backend, "held_pids", list)()}
    return [p for p in leftovers(agent.id, settle) if str(p).split(":")[0] not in held]


@pytest.fixture(scope="session", autouse=True)
def shoal_state() -> Iterator[Path]:
    """shoal's state (agents' homes, the places registry) for this test session alone, removed at
    its end: what a SIGKILLed shoal of a test leaves there (its agent's home) never piles up in
    ~/.cache/shoal. Outside /tmp, as agents' homes are (codex will not put its helpers in /tmp)."""
    state = Path.home() / ".cache" / "shoal" / "test-sessions" / str(os.getpid())
    before = os.environ.get("SHOAL_HOME")
    os.environ["SHOAL_HOME"] = str(state)
    yield state
    if before is None:
        os.environ.pop("SHOAL_HOME", None)
    else:
        os.environ["SHOAL_HOME"] = before
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def loopback() -> LoopbackModel:
    """The embedded loopback model every default agent in this process talks to."""
    return shared()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def wait_for_request(loopback: LoopbackModel, marker: str, timeout: float = 60) -> None:
    """Block until the loopback model has seen a request whose prompt holds `marker`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(marker in r.prompt for r in list(loopback.requests)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no request with {marker!r} reached the loopback model")


def leftovers(agent_id: str, settle: float = 3.0) -> list[str]:
    """Processes still carrying this agent's tag (pid and command line), after a moment to exit."""
    deadline = time.monotonic() + settle
    while True:
        pids = tagged_pids(f"SHOAL_AGENT={agent_id}")
        if not pids or time.monotonic() > deadline:
            return [f"{pid}: {_cmdline(pid)}" for pid in pids]
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
