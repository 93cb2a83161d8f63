"""End to end over MPI: pipeline stages with dp or tp inside log the 1-device losses.

`hspmd run -n 4 examples/gpt.py --strategy "[0-3]: dp=1 tp=2 pp=2" --steps 20 --log F` (and
`dp=2 pp=2`), with one micro-batch, with `--set microbatches=2` and with
`--set pipeline_schedule=1f1b`, against `hspmd run -n 1` of the same script
(the reference and the script sizes come from tests/test_strategies_mpi.py).

A run tests one case with tp stages and one with dp stages, sampled by its seed (`HSPMD_TEST_SEED`,
printed in pytest's header; the test ids name them): tests/test_pipeline_hybrid.py checks every
case's numbers in-process; successive runs cover every case here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli, sampled_kinds
import test_strategies_mpi
from test_strategies_mpi import GPT, SMALL, STEPS

reference = test_strategies_mpi.reference  # the module-scoped fixture: the 1-device run's losses


def _pipeline_losses(tmp_path, n: int, strategy: str, settings: list[str]) -> list[float]:
    log = tmp_path / "log.jsonl"
    sets = [a for s in settings for a in ("--set", s)]
    run_cli("hspmd", "run", "-n", str(n), GPT, "--strategy", strategy, "--steps", STEPS, "--log", str(log),
            *SMALL, *sets, check=True, timeout=600)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, settings", sampled_kinds([
    ("[0-3]: dp=1 tp=2 pp=2", []),
    ("[0-3]: dp=2 pp=2", []),
    ("[0-3]: dp=1 tp=2 pp=2", ["microbatches=2"]),
    ("[0-3]: dp=2 pp=2", ["microbatches=2"]),
    ("[0-3]: dp=1 tp=2 pp=2", ["microbatches=4", "pipeline_schedule=1f1b"]),
    ("[0-3]: dp=2 pp=2", ["microbatches=2", "pipeline_schedule=1f1b"]),
], lambda case: "tp=" in case[0], "pipeline-hybrid-mpi"))
def test_gpt_pipeline_with_dp_or_tp_stages_logs_the_single_device_losses(tmp_path, reference, strategy, settings):
    losses = _pipeline_losses(tmp_path, 4, strategy, settings)
    assert len(losses) == int(STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
