"""Shared fixtures: one loopback model per test run, a leftover-process counter."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest

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


BACKENDS = available_backends()


@pytest.fixture(scope="session")
def loopback() -> LoopbackModel:
    """The embedded loopback model every default agent in this process talks to."""
    return shared()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


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
