"""Mixed precision: float16/bfloat16 compute with float32 master weights and loss scaling."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import ScriptError, load_script, parse_overrides
from hspmd.dialects.context import module_text
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train

TINY = ["model.d_model=32", "model.seq_len=16", "data.batch_size=4", "steps=12", "optim.warmup=2"]


def run(tmp_path, precision, optimizer=True, **extra):
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(TINY))
    script.config.update(precision=precision, **extra)
    compiled = compile_script(script, "[0]: dp=1", 1, optimizer=optimizer)
    bundle = tmp_path / f"{precision}-{optimizer}-{sorted(extra.items())}"
    write_bundle(compiled, str(bundle))
    result = run_spmd(1, lambda comm: train(str(bundle), comm, quiet=True, keep_outputs=True))[0]
    return compiled, result


@pytest.mark.parametrize("precision,tol", [("bfloat16", 2e-2), ("float16", 5e-3)])
def test_reduced_precision_trains_like_float32_with_float32_master_weights(tmp_path, precision, tol):
    _, full = run(tmp_path, "float32")
    compiled, low = run(tmp_path, precision)
    short = {"bfloat16": "bf16", "float16": "f16"}[precision]
    text = module_text(compiled.logical)
    assert "graph.matmul" in text and f"x{short}>" in text
    assert all(v.dtype == np.float32 for k, v in low.params.items() if not k.startswith("opt."))
    np.testing.assert_allclose(low.losses, full.losses, rtol=tol)
    assert low.losses[-1] < low.losses[0] - 0.3


def test_float16_loss_scaling_gives_unscaled_gradients(tmp_path):
    _, full = run(tmp_path, "float32", optimizer=False)
    _, scaled = run(tmp_path, "float16", optimizer=False, loss_scale=4096.0)
    for name, g in full.outputs[0].items():
        if name.startswith("grad:"):
            err = np.linalg.norm(scaled.outputs[0][name] - g) / (np.linalg.norm(g) + 1e-12)
            assert err < 2e-2, (name, err)


def test_bad_precision_settings_are_reported():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(TINY))
    script.config["precision"] = "float8"
    with pytest.raises(ScriptError, match="precision='float8'"):
        compile_script(script, "[0]: dp=1", 1)
    script.config.update(precision="float16", loss_scale=-1)
    with pytest.raises(ScriptError, match="loss_scale=-1"):
        compile_script(script, "[0]: dp=1", 1)
