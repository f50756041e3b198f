"""`shoal demo` end to end: the README's main job, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import shoal
from shoal.demo.run import demo, prompts


def test_shoal_demo_command_runs_conversations_at_once() -> None:
    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "demo", "-n", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3/3 conversations correct" in out.stdout
    assert "app/feature_2.py" in out.stdout
    assert "Wall time" in out.stdout


def test_demo_outcome_is_checked_work() -> None:
    import asyncio

    out = asyncio.run(demo(2, "opencode"))
    assert [c.ok for c in out.conversations] == [True, True]
    for c in out.conversations:
        assert f"app/feature_{c.index}.py" in c.files_changed and "result.txt" in c.files_changed
        assert c.tokens > 0 and c.cost > 0
        assert not Path(c.place).exists()  # throwaway copies are gone
    assert "remember: marker-1" in prompts(1)[0]
    assert isinstance(out.conversations[0].cost, float) and shoal.Agent is not None
