"""End to end over MPI: a pipelined group beside a group without stages logs the 1-device losses.

`hspmd run -n N examples/gpt.py --strategy S --steps 20 --log F` for Hetu v2's flagship shape
`[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 pp=1 share=1` (6 ranks) and the simpler
`[0,1]: pp=2 share=1 | [2]: dp=1 share=1`, `[0,1]: pp=2 share=3 | [2]: pp=1 share=1` and the
pipelined group second, with micro-batches (GPipe, 1F1B; with tp in every group too), and two
pipelines side by side,
against `hspmd run -n 1`
(reference and sizes from tests/test_strategies_mpi.py).

A run tests one case of each kind (`_kind`: one micro-batch, several, two pipelines side by side),
sampled by its seed (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name them):
tests/test_hetero_pipeline.py checks these shapes' numbers in-process; successive runs cover every
case here.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_strategies_mpi
from conftest import sampled_kinds
from test_pipeline_hybrid_mpi import _pipeline_losses
from test_strategies_mpi import STEPS

reference = test_strategies_mpi.reference  # the module-scoped fixture: the 1-device run's losses


def _kind(case) -> str:
    _, strategy, settings = case
    return "two pipelines" if strategy.count("pp=2") >= 2 else \
        "micro-batches" if any(s.startswith("microbatches=") for s in settings) else "one micro-batch"


@pytest.mark.mpi
@pytest.mark.parametrize("n, strategy, settings", sampled_kinds([
    (6, "[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 pp=1 share=1", []),
    (3, "[0,1]: pp=2 share=1 | [2]: dp=1 share=1", []),
    (3, "[0,1]: pp=2 share=3 | [2]: pp=1 share=1", ["pipeline_schedule=1f1b"]),
    (6, "[0,1]: dp=2 share=1 | [2-5]: dp=2 pp=2 layers=1:1 share=3", []),  # pipelined second, dp in stages
    (3, "[0,1]: pp=2 share=3 | [2]: dp=1 share=1", ["microbatches=3", "pipeline_schedule=1f1b"]),
    (6, "[0-3]: dp=2 pp=2 share=1 | [4,5]: dp=2 share=1", ["microbatches=2"]),
    (6, "[0-3]: tp=2 pp=2 share=1 | [4,5]: tp=2 share=1", ["microbatches=2", "pipeline_schedule=1f1b"]),
    (6, "[0-3]: tp=2 pp=2 share=2 | [4,5]: pp=2 share=1", []),  # two pipelines, tp stages beside single ones
    (5, "[0,1]: pp=2 share=1 | [2,3]: pp=2 share=2 | [4]: dp=1 share=1", ["microbatches=2", "pipeline_schedule=1f1b"]),
], _kind, "hetero-pipeline-mpi"))
def test_gpt_hetero_pipeline_logs_the_single_device_losses(tmp_path, reference, n, strategy, settings):
    losses = _pipeline_losses(tmp_path, n, strategy, settings)
    assert len(losses) == int(STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
