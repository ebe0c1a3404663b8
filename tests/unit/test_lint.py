"""The code stays lint-clean and formatted (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff() -> list[str]:
    found = Path(sys.executable).with_name("ruff")
    if found.exists():
        return [str(found)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed")


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run(
        [*ruff(), *args, "pgq", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
