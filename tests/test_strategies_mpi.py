"""End to end over MPI: `hspmd run -n N examples/gpt.py --strategy S` logs the 1-device losses.

The in-process tests check each strategy's numbers; this sweep checks them through `hspmd run`
over mpiexec, so a run tests one strategy of each kind (`_kind`: one group, unlike groups with
shares, ZeRO, the hierarchical sum across groups), sampled by its seed (`HSPMD_TEST_SEED`, printed
in pytest's header; the test ids name them); successive runs cover every strategy.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli, sampled_kinds

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.seq_len=16", "--set", "data.batch_size=8"]
STEPS = "20"


def _losses(tmp_path, n: int, strategy: str) -> list[float]:
    log = tmp_path / f"log-{n}-{strategy.replace(' ', '_').replace(':', '').replace('|', '')}.jsonl"
    run_cli("hspmd", "run", "-n", str(n), GPT, "--strategy", strategy, "--steps", STEPS, "--log", str(log), *SMALL,
            check=True, timeout=600)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), 1, "[0]: dp=1")


def _kind(case) -> str:
    strategy = case[1]
    return "hierarchical" if "[2,3]: tp=2" in strategy else "zero" if "zero=" in strategy else \
        "groups" if "|" in strategy else "one group"


@pytest.mark.mpi
@pytest.mark.parametrize(
    "n,strategy",
    sampled_kinds([
        (2, "[0,1]: dp=2"),
        (2, "[0,1]: tp=2"),
        (2, "[0,1]: pp=2"),
        (4, "[0-3]: dp=2 tp=2"),
        (3, "[0,1]: dp=2 share=3 | [2]: dp=1 share=1"),
        (3, "[0,1]: tp=2 share=2 | [2]: tp=1 share=1"),
        (4, "[0,1]: tp=2 share=3 | [2,3]: tp=2 share=1"),  # hierarchical: across the groups over matching halves
        (4, "[0-3]: dp=4 zero=2"),
        (4, "[0-3]: dp=2 pp=2 zero=1"),  # ZeRO inside pipeline stages
        (4, "[0,1]: dp=2 zero=1 | [2,3]: dp=2 zero=1"),  # ZeRO in each of two groups
    ], _kind, "strategies-mpi"),
)
def test_gpt_over_mpi_logs_the_single_device_losses(tmp_path, reference, n, strategy):
    losses = _losses(tmp_path, n, strategy)
    assert len(losses) == int(STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
