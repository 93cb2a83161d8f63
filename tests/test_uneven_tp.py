"""Tensor parallelism over dims tp does not divide (`tp=2` over 3 heads): uneven pieces inside a
group, laid out over tp sub-groups (`transforms/uneven_tensor_parallel.py`), give the 1-device
numbers."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train

STEPS = 3
GPT3 = ["model.d_model=24", "model.seq_len=8", "model.heads=3", "model.layers=2", "data.batch_size=4",
        "optim.warmup=1"]
MLP = ["batch_size=8", "hidden=10"]


def _train(tmp_path, example: str, sets: list[str], strategy: str, n: int, **kw):
    script = load_script(os.path.join(EXAMPLES, example), parse_overrides(sets + [f"steps={STEPS}"]))
    bundle = tmp_path / f"{example}-{n}-{abs(hash(strategy))}"
    compiled = compile_script(script, strategy, n)
    write_bundle(compiled, str(bundle))
    ranks = run_spmd(n, lambda c: train(str(bundle), c, steps=STEPS, quiet=True, keep_outputs=True, **kw),
                     timeout=300)
    return compiled, ranks


def _assert_same(ref, ranks, atol):
    for got in ranks:
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.parametrize("strategy,n", [("[0,1]: tp=2", 2), ("[0-3]: dp=2 tp=2", 4)])
def test_gpt_three_heads_over_tp2_equals_one_device(tmp_path, strategy, n):
    _, (ref,) = _train(tmp_path, "gpt.py", GPT3, "[0]: dp=1", 1)
    compiled, ranks = _train(tmp_path, "gpt.py", GPT3, strategy, n)
    text = str(compiled.annotated)
    assert "hetero=split(1), shares=2:1" in text  # the qkv weight: 2 heads on one tp rank, 1 on the other
    print(f"\ngpt 3 heads {strategy}: losses {ranks[0].losses} (1 device {ref.losses})")
    _assert_same(ref, ranks, atol=5e-5)


@pytest.mark.parametrize("strategy,n,hidden", [("[0-2]: tp=3", 3, 10), ("[0-3]: tp=4", 4, 30)])
def test_mlp_width_tp_does_not_divide_equals_one_device(tmp_path, strategy, n, hidden):
    sets = ["batch_size=8", f"hidden={hidden}"]
    _, (ref,) = _train(tmp_path, "mlp.py", sets, "[0]: dp=1", 1)
    compiled, ranks = _train(tmp_path, "mlp.py", sets, strategy, n)
    assert "hetero=split(1), shares=1:1" in str(compiled.annotated)  # 10 columns: 4, 3, 3; 30: 8, 8, 7, 7
    _assert_same(ref, ranks, atol=1e-6)


def test_llama_three_heads_over_tp2_equals_one_device(tmp_path):
    sets = ["model.d_model=24", "model.seq_len=8", "model.heads=3", "model.layers=1", "data.batch_size=4",
            "optim.warmup=1"]
    _, (ref,) = _train(tmp_path, "llama.py", sets, "[0]: dp=1", 1)
    _, ranks = _train(tmp_path, "llama.py", sets, "[0,1]: tp=2", 2)
    _assert_same(ref, ranks, atol=5e-5)


def test_checkpoint_under_uneven_tp_resumes_on_one_device(tmp_path):
    """Each tp rank writes its uneven pieces; the 1-device reader reshards them and step 3 goes on alike."""
    from hspmd.runtime.worker import CheckpointOptions

    ck = tmp_path / "ck"
    _, ranks = _train(tmp_path, "gpt.py", GPT3, "[0,1]: tp=2", 2, checkpoints=CheckpointOptions(str(ck), every=2))
    _, (one,) = _train(tmp_path, "gpt.py", GPT3, "[0]: dp=1", 1, checkpoints=CheckpointOptions(resume=str(ck / "step-2")))
    assert one.first_step == 3
    np.testing.assert_allclose(one.losses, ranks[0].losses[2:], rtol=1e-5)
    for name, value in ranks[0].params.items():
        np.testing.assert_allclose(one.params[name], value, rtol=1e-5, atol=5e-5, err_msg=name)
