"""Runs the FileCheck tests of tests/filecheck (one `.mlir` file per pass) through lit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FILECHECK_DIR = Path(__file__).parent / "filecheck"


def test_filecheck_suite() -> None:
    # lit (no `python -m lit` in lit 23) runs under this Python, so lit.cfg.py finds
    # hspmd-opt and filecheck beside it
    proc = subprocess.run(
        [sys.executable, "-c", "from lit.main import main; main()", "-v", str(FILECHECK_DIR)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"lit failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "Passed" in proc.stdout, f"lit ran no tests:\n{proc.stdout}\n{proc.stderr}"
