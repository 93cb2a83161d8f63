"""Short batches (an epoch's last): padded to the compiled batch, they count for the rows they hold.

Under `[0,1]: dp=2 share=3 | [2]: dp=1 share=1` the last batch of each epoch of
`tests/mpi_scripts/gpt_epochs.py` has 2 real rows of 8, so group [2] (rows 6..7) holds only
padding: it contributes zero and the run still equals the 1-device run, step by step.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.data.batching import BatchError, compiled_batch_shapes, pad_batch
from hspmd.runtime.comm import run_spmd
from hspmd.data.text import lm_epochs
from hspmd.runtime.worker import train

SCRIPT = os.path.join(os.path.dirname(__file__), "mpi_scripts", "gpt_epochs.py")
HETERO = "[0,1]: dp=2 share=3 | [2]: dp=1 share=1"


def test_pad_batch_fills_rows_with_the_pad_values():
    batch = {"ids": np.ones((2, 3), np.int32), "targets": np.full((2, 3), 7, np.int32), "lr": np.float64(0.1)}
    shapes = [("ids", (4, 3)), ("targets", (4, 3)), ("lr", ())]
    out = pad_batch(batch, shapes, {"ids": 0, "targets": -100})
    assert out["ids"].shape == (4, 3) and out["ids"].dtype == np.int32
    np.testing.assert_array_equal(out["ids"][2:], 0)
    np.testing.assert_array_equal(out["targets"][:2], 7)
    np.testing.assert_array_equal(out["targets"][2:], -100)
    assert out["lr"] == 0.1
    full = {"ids": np.ones((4, 3), np.int32)}
    assert pad_batch(full, shapes, None)["ids"] is full["ids"]  # nothing to pad: no pad values needed


def test_pad_batch_errors_name_the_input_and_the_rule():
    shapes = [("ids", (4, 3))]
    with pytest.raises(BatchError, match=r"input 'ids' has 2 rows, the program was compiled for 4: give "
                                         r"config\['data'\]\['pad'\]\['ids'\]"):
        pad_batch({"ids": np.ones((2, 3))}, shapes, {})
    with pytest.raises(BatchError, match=r"input 'ids' has shape \[5, 3\]; the program was compiled for \[4, 3\]"):
        pad_batch({"ids": np.ones((5, 3))}, shapes, {"ids": 0})
    with pytest.raises(BatchError, match="only a batch with fewer rows"):
        pad_batch({"ids": np.ones((2, 4))}, shapes, {"ids": 0})


def test_compiled_batch_shapes_undo_the_micro_batch_split():
    # a stage in 2 micro-batches reads x@mb, the batch as [2, rows / 2, ...]
    assert compiled_batch_shapes([("x@mb", (2, 2, 5)), ("lr", ())]) == [("x", (4, 5)), ("lr", ())]


def test_lm_epochs_end_with_a_short_batch():
    data = np.arange(81, dtype=np.uint8)
    got = [b["ids"].shape[0] for b, _ in zip(lm_epochs(data, 8, 8), range(5))]
    assert got == [8, 2, 8, 2, 8]
    first = next(lm_epochs(data, 8, 8))
    np.testing.assert_array_equal(first["targets"][0], np.arange(1, 9))
    np.testing.assert_array_equal(first["ids"][1], np.arange(8, 16))
    assert [b["ids"].shape[0] for b in lm_epochs(data, 8, 8, epochs=1)] == [8, 2]


def _run(tmp_path, strategy: str, n: int, overrides: tuple[str, ...] = ()):
    bundle = tmp_path / f"b{n}-{len(overrides)}"
    write_bundle(compile_script(load_script(SCRIPT, parse_overrides(list(overrides))), strategy, n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=4, quiet=True), timeout=300)[0]


def test_a_group_with_an_empty_last_batch_contributes_zero(tmp_path):
    one = _run(tmp_path, "[0]: dp=1", 1)
    three = _run(tmp_path, HETERO, 3)
    assert len(three.losses) == 4 and np.all(np.isfinite(three.losses))
    np.testing.assert_allclose(three.losses, one.losses, rtol=1e-5)
    for name, value in one.params.items():
        np.testing.assert_allclose(three.params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_padded_rows_count_for_nothing(tmp_path):
    # other token ids in the padding rows change nothing: their labels are ignored and the loss
    # divides by the real labels only
    base = _run(tmp_path, "[0]: dp=1", 1)
    other = _run(tmp_path, "[0]: dp=1", 1, ("data.pad.ids=5",))
    assert other.losses == base.losses
    for name, value in base.params.items():
        np.testing.assert_array_equal(other.params[name], value, err_msg=name)
