"""End to end: the MLP example trains, and N ranks give the numbers of one.

The reference for the compiled program is an independent NumPy implementation of the same
MLP (forward, backward and SGD written by hand), started from the same initial values.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli
from hspmd.compiler import compile_script, default_strategy, write_bundle
from hspmd.frontend.script import load_script
from hspmd.ir.init_spec import initial_value
from hspmd.runtime.checkpoint import load_checkpoint
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train

MLP = os.path.join(EXAMPLES, "mlp.py")


def _train(tmp_path, n: int, steps: int, strategy: str | None = None):
    script = load_script(MLP)
    bundle = tmp_path / f"bundle{n}"
    write_bundle(compile_script(script, strategy or default_strategy(n), n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=steps, quiet=True), timeout=300)


def numpy_mlp(steps: int):
    """Return (losses, params) of the example MLP trained by hand-written NumPy code."""
    script = load_script(MLP)
    cfg = script.config
    model = script.module.model(cfg)
    params = {
        name: initial_value(p.init, p.shape, "float32", name, cfg["seed"]) for name, p in model.named_parameters()
    }
    n_layers = len(model.layers)
    batches = script.batches()
    losses = []
    for _ in range(steps):
        batch = next(batches)
        x, y = batch["x"], batch["y"]
        acts, pre = [x], []
        for i in range(n_layers):
            z = acts[-1] @ params[f"layers.{i}.weight"] + params[f"layers.{i}.bias"]
            pre.append(z)
            acts.append(np.maximum(z, 0) if i < n_layers - 1 else z)
        logits = acts[-1]
        shifted = logits - logits.max(1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        losses.append(float(-logp[np.arange(len(y)), y].mean()))
        g = np.exp(logp)
        g[np.arange(len(y)), y] -= 1
        g /= len(y)
        grads = {}
        for i in reversed(range(n_layers)):
            if i < n_layers - 1:
                g = g * (pre[i] > 0)
            grads[f"layers.{i}.weight"] = acts[i].T @ g
            grads[f"layers.{i}.bias"] = g.sum(0)
            g = g @ params[f"layers.{i}.weight"].T
        for k in params:
            params[k] = params[k] - np.float32(cfg["lr"]) * grads[k]
    return losses, params


def test_compiled_single_device_program_matches_hand_written_numpy(tmp_path):
    (result,) = _train(tmp_path, 1, steps=5)
    losses, params = numpy_mlp(5)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    for name, value in params.items():
        np.testing.assert_allclose(result.params[name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_in_process_equals_one_device(tmp_path, n):
    one = _train(tmp_path, 1, steps=20)[0]
    many = _train(tmp_path, n, steps=20)
    for rank in many:
        np.testing.assert_allclose(rank.losses, one.losses, rtol=1e-5)
    for name, value in one.params.items():
        np.testing.assert_allclose(many[0].params[name], value, rtol=1e-5, atol=1e-6)


def test_loss_falls(tmp_path):
    (result,) = _train(tmp_path, 1, steps=200)
    assert np.mean(result.losses[-20:]) < 0.5 * np.mean(result.losses[:20])


@pytest.mark.mpi
def test_mpi_two_ranks_equal_one_rank_and_bundles_run(tmp_path):
    steps = "30"
    for n in ("1", "2"):
        run_cli(
            "hspmd", "run", "-n", n, MLP, "--steps", steps,
            "--log", str(tmp_path / f"log{n}.jsonl"), "--checkpoint", str(tmp_path / f"ck{n}.npz"),
            check=True, timeout=300,
        )
    logs = {n: [json.loads(l) for l in open(tmp_path / f"log{n}.jsonl")] for n in ("1", "2")}
    assert [r["step"] for r in logs["2"]] == list(range(1, 31))
    np.testing.assert_allclose([r["loss"] for r in logs["2"]], [r["loss"] for r in logs["1"]], rtol=1e-5)
    p1, s1 = load_checkpoint(str(tmp_path / "ck1.npz"))
    p2, s2 = load_checkpoint(str(tmp_path / "ck2.npz"))
    assert s1 == s2 == 30 and p1.keys() == p2.keys()
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-5, atol=1e-6)

    bundle = tmp_path / "bundle"
    run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--dump-dir", str(bundle), check=True)
    run_cli("hspmd", "run", "-n", "2", str(bundle), "--steps", steps, "--log", str(tmp_path / "logb.jsonl"),
            check=True, timeout=300)
    logb = [json.loads(l)["loss"] for l in open(tmp_path / "logb.jsonl")]
    assert logb == [r["loss"] for r in logs["2"]]
