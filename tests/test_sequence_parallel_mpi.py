"""End to end over MPI: GPT with sequence parallelism logs the 1-device losses.

`hspmd run -n N examples/gpt.py --strategy S` with `[0,1]: tp=2 sp=1` and `[0-3]: dp=2 tp=2 sp=1`
(the residual stream split along the sequence over tp, reduce-scatter / all-gather around the
blocks' matmuls, a vocabulary-split embedding and loss) trains as on one device: 20 steps of
the small GPT of tests/test_strategies_mpi.py, losses within 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_strategies_mpi import STEPS, _losses, reference  # noqa: F401 - `reference` is a fixture


@pytest.mark.mpi
@pytest.mark.parametrize("n,strategy", [(2, "[0,1]: tp=2 sp=1"), (4, "[0-3]: dp=2 tp=2 sp=1")])
def test_gpt_sequence_parallel_over_mpi_logs_the_single_device_losses(tmp_path, reference, n, strategy):  # noqa: F811
    losses = _losses(tmp_path, n, strategy)
    assert len(losses) == int(STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
