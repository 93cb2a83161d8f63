"""Heterogeneous tensor parallelism: the general reshard between unions (an exchange over the finest
common slices), its comm op and runtime kernel, deadlock-free on blocking point-to-point."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import TensorType, f64
from xdsl.ir import Block

from hspmd.ir.layout import gather, scatter
from hspmd.ir.layout_text import parse_layout
from hspmd.ir.reshard_plan import plan_transition
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.comm_kernels import comm_kernel
from hspmd.transforms.lower_reshard import _exchange_op
from test_reshard_plan import union_transitions


def _run_exchange(src, dst, a, rng):
    """Return {rank: piece} after running the lowered exchange on every rank over in-process comms."""
    (step,) = plan_transition(src, dst, a.shape)
    assert step.kind == "exchange"
    pieces = scatter(src, a, rng)
    n = max(src.devices) + 1

    def body(c):
        r = c.rank
        if r not in src.devices:
            return None
        block = Block(arg_types=[TensorType(f64, list(pieces[r].shape))])

        class _R:  # the reshard's result type, as lower-reshard reads it
            result = type("T", (), {"type": TensorType(f64, list(dst.local_shape(r, a.shape)))})()

        op = _exchange_op(step, block.args[0], _R, (r,), src, dst, tuple(a.shape))
        op.verify()
        assert tuple(op.result.type.get_shape()) == dst.local_shape(r, a.shape)
        return comm_kernel(op, r, c)(pieces[r])

    out = run_spmd(n, body, timeout=30)
    return {r: out[r] for r in dst.devices}


def test_tp_gradient_exchange_runs_on_three_ranks():
    src = parse_layout("[0,1]: split(1)=2 | [2]: dup=1 ; hetero=partial")
    dst = parse_layout("[0,1]: split(1)=2 | [2]: dup=1 ; hetero=dup")
    a = np.arange(24.0).reshape(4, 6)
    out = _run_exchange(src, dst, a, np.random.default_rng(0))
    np.testing.assert_allclose(out[0], a[:, :3]), np.testing.assert_allclose(out[1], a[:, 3:])
    np.testing.assert_allclose(out[2], a)


@settings(max_examples=40, deadline=None)
@given(union_transitions(), st.integers(0, 2**32 - 1))
def test_exchange_kernel_matches_the_simulator_without_deadlock(case, seed):
    src, dst, shape = case
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    steps = plan_transition(src, dst, shape)
    if len(steps) != 1 or steps[0].kind != "exchange":
        return
    out = _run_exchange(src, dst, a, rng)
    np.testing.assert_allclose(gather(dst, out, shape), a, atol=1e-9)


# --------------------------------------------------------------------------------------
# End to end: "[0,1]: tp=2 share=2 | [2]: tp=1 share=1" on 3 ranks equals 1 device

import json  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402

from conftest import EXAMPLES, run_cli  # noqa: E402
from hspmd.compiler import compile_script, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script, parse_overrides  # noqa: E402
from hspmd.runtime.checkpoint import load_checkpoint  # noqa: E402
from hspmd.runtime.worker import train  # noqa: E402

STEPS = 4
HETERO_TP = "[0,1]: tp=2 share=2 | [2]: tp=1 share=1"
SMALL = {
    "mlp.py": ["batch_size=12", "hidden=32"],  # 12 rows: 8 (both tp ranks) and 4
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=6",
              "optim.warmup=1"],
}


def _script(example: str):
    return load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}"]))


def _train(tmp_path, example: str, strategy: str, n: int):
    bundle = tmp_path / f"{example}-{n}"
    compiled = compile_script(_script(example), strategy, n)
    write_bundle(compiled, str(bundle))
    return compiled, run_spmd(n, lambda c: train(str(bundle), c, steps=STEPS, quiet=True, keep_outputs=True),
                              timeout=300)


@pytest.mark.parametrize("example", ["mlp.py", "gpt.py"])
def test_hetero_tensor_parallel_equals_one_device(tmp_path, example):
    _, (ref,) = _train(tmp_path, example, "[0]: dp=1", 1)
    compiled, ranks = _train(tmp_path, example, HETERO_TP, 3)
    text = str(compiled.physical)
    assert "comm.exchange" in text  # the column weights' gradients: partial across groups, split in group 0
    print(f"\n{example} {HETERO_TP}: losses {ranks[0].losses} (1 device {ref.losses})")
    for got in ranks:
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    atol = 5e-5 if example == "gpt.py" else 1e-6
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.mpi
def test_mpi_hetero_tensor_parallel_equals_one_rank(tmp_path):
    mlp = os.path.join(EXAMPLES, "mlp.py")
    for n, strategy in (("1", "[0]: dp=1"), ("3", HETERO_TP)):
        run_cli("hspmd", "run", "-n", n, mlp, "--strategy", strategy, "--steps", "5", "--set", "batch_size=12",
                "--log", str(tmp_path / f"log{n}.jsonl"), "--checkpoint", str(tmp_path / f"ck{n}.npz"),
                check=True, timeout=300)
    logs = {n: [json.loads(line)["loss"] for line in open(tmp_path / f"log{n}.jsonl")] for n in ("1", "3")}
    print(f"\nMPI {HETERO_TP}: losses {logs['3']} (1 rank {logs['1']})")
    assert len(logs["3"]) == 5
    np.testing.assert_allclose(logs["3"], logs["1"], rtol=1e-5)
    p1, _ = load_checkpoint(str(tmp_path / "ck1.npz"))
    p3, _ = load_checkpoint(str(tmp_path / "ck3.npz"))
    for name in p1:
        np.testing.assert_allclose(p3[name], p1[name], rtol=1e-5, atol=1e-6)


def test_exchange_op_does_not_grow_with_the_number_of_ranks():
    """comm.exchange names its layouts and shape, not its transfers: the IR stays one line whatever the ranks."""

    sizes = []
    for n in (4, 16, 64):
        src = parse_layout(f"[0-{n // 2 - 1}]: split(1)={n // 2} | [{n // 2}-{n - 1}]: split(0)={n // 2} ; hetero=partial")
        dst = parse_layout(f"[0-{n // 2 - 1}]: split(1)={n // 2} | [{n // 2}-{n - 1}]: split(0)={n // 2} ; hetero=dup")
        shape = (n * 2, n * 2)
        (step,) = plan_transition(src, dst, shape)
        assert step.kind == "exchange" and len(step.transfers) >= n
        block = Block(arg_types=[TensorType(f64, list(src.local_shape(0, shape)))])

        class _R:
            result = type("T", (), {"type": TensorType(f64, list(dst.local_shape(0, shape)))})()

        op = _exchange_op(step, block.args[0], _R, (0,), src, dst, shape)
        op.verify()
        assert len(op.transfer_list()) == len(step.transfers)
        block.add_op(op)
        sizes.append(len(str(op)))
    assert max(sizes) - min(sizes) < 40, sizes  # only the device ranges' digits differ
