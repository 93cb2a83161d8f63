"""docs/your-own-pass.md works as written: its `sh` blocks run, in order, from the repository root
(one bash, `set -euo pipefail`), and print what its `text` blocks show; its pass is the file
`examples/passes/fuse_silu.py` and its FileCheck excerpt is in `tests/filecheck/fuse-silu.mlir`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "your-own-pass.md"
#: a row of the --pass-timing table: name, level, wall ms, share, ops before, ops after
TIMING_ROW = re.compile(r"^(\S+)\s+(\S+)\s+[\d.]+\s+[\d.]+%\s+(\d+)\s+(\d+)$")


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


def test_the_pass_on_the_page_is_the_example_file():
    (code,) = _blocks("python")
    assert code == (ROOT / "examples" / "passes" / "fuse_silu.py").read_text()
    (excerpt,) = _blocks("mlir")
    test_lines = (ROOT / "tests" / "filecheck" / "fuse-silu.mlir").read_text().splitlines()
    assert all(line in test_lines for line in excerpt.splitlines() if line != "...")


def test_the_commands_of_the_page_run_and_print_what_it_shows():
    script = "set -euo pipefail\n" + "\n".join(_blocks("sh"))
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = done.stdout.splitlines()
    rows = [m.groups() for m in map(TIMING_ROW.match, out) if m]
    for block in _blocks("text"):
        for line in block.splitlines():
            row = TIMING_ROW.match(line)
            if row:  # times vary; the pass, its level and the op counts do not
                assert (row.group(1), row.group(2), row.group(3), row.group(4)) in rows, (line, rows)
            else:
                assert line in out, (line, done.stdout[-3000:])
