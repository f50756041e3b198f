"""The code is ruff-clean and type-checks: both run as part of the suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tool", [["ruff", "check", "src", "tests"], ["mypy"]], ids=["ruff", "mypy"])
def test_clean(tool: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
