"""Shared fixtures: paths, and running the hspmd command lines in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
BIN = os.path.dirname(sys.executable)


def run_cli(
    *args: str, timeout: float = 120, check: bool = False, cwd: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run an installed console script (`hspmd`, `hspmd-opt`) and return the finished process."""
    exe = os.path.join(BIN, args[0])
    proc = subprocess.run(
        [exe, *args[1:]], capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli
