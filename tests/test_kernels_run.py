"""`hspmd run` trains with the fused CPU kernels by default; the losses equal NumPy per op's.

Tolerance (docs/kernels.md): the fused kernels round like NumPy but for exp/tanh, within a few
ulp, so float32 losses agree to about 1e-6 relative after a few steps; the test asks 3e-5.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.seq_len=16", "--set", "data.batch_size=8"]


def _run(tmp_path, *extra: str) -> tuple[list[float], str]:
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.jsonl"
    proc = run_cli("hspmd", "run", "-n", "2", GPT, "--steps", "6", "--log", str(log), *SMALL, *extra,
                   check=True, timeout=600)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()], proc.stdout


@pytest.mark.mpi
def test_run_uses_fused_kernels_by_default_with_numpy_losses(tmp_path):
    fused, out = _run(tmp_path)
    numpy, out_numpy = _run(tmp_path, "--kernels", "numpy")
    assert " 0 fused kernels" not in out and "fused kernels" in out, out
    assert " 0 fused kernels" in out_numpy, out_numpy
    assert len(fused) == 6
    np.testing.assert_allclose(fused, numpy, rtol=3e-5)
