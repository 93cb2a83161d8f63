"""Bucketed, overlapped gradient all-reduces (hspmd.runtime.buckets): same bits, earlier starts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from hspmd.codegen.schedule.flatten import flatten
from hspmd.dialects import comm as comm_dialect
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.buckets import Bucket
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.plan import build_plan
from hspmd.runtime.worker import step_inputs

SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "data.batch_size=4"]


@pytest.fixture(scope="module")
def gpt_dp2():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(SMALL))
    return script, compile_script(script, "[0,1]: dp=2", 2)


def _fn(compiled, rank):
    for devices, module in physical_groups(compiled.physical):
        if rank in devices:
            return next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
                        and op.sym_name.data == "train_step")
    raise AssertionError(rank)


def _train(script, compiled, steps, **plan_options):
    def body(comm):
        plan = build_plan(_fn(compiled, comm.rank), comm.rank, comm, **plan_options)
        state = plan.initial_state(0)
        config = {**script.config, "lr_schedule": compiled.lr_schedule}
        names = {leaf.name for leaf in plan.inputs}
        batches = script.batches()
        losses = []
        for step in range(1, steps + 1):
            out = plan.run(state, plan.local_batch({**next(batches), **step_inputs(step, config, names)}))
            losses.append(float(out["loss"]))
        return losses, state, plan

    return run_spmd(2, body, timeout=300)


@pytest.mark.parametrize("bucket_bytes", [1, 16 * 1024, 1 << 30])
def test_buckets_give_the_bits_of_one_all_reduce_per_gradient(gpt_dp2, bucket_bytes):
    script, compiled = gpt_dp2
    bucketed = _train(script, compiled, 2, bucket_bytes=bucket_bytes)
    plain = _train(script, compiled, 2, bucket_bytes=None)
    for (l1, s1, p1), (l2, s2, p2) in zip(bucketed, plain):
        # one bucket of everything would start after the last gradient, with nothing to overlap: not made
        assert (bool(p1.buckets) or bucket_bytes > 1 << 20) and not p2.buckets
        assert l1 == l2
        assert all(s1[k].tobytes() == s2[k].tobytes() for k in s1)


def test_buckets_start_after_their_operands_and_end_before_their_uses(gpt_dp2):
    script, compiled = gpt_dp2
    fn = _fn(compiled, 0)
    # per step, as the schedule runs them: a stacked gradient's all-reduce once per layer
    n_all_reduce = sum(isinstance(node.op, comm_dialect.AllReduceOp) for node in flatten(fn).nodes)
    bucket_bytes = 64 * 1024
    (_, _, plan), _ = _train(script, compiled, 1, bucket_bytes=bucket_bytes)
    starts, waits, written, read = {}, {}, {}, {}
    for i, (fn_, ins, outs, _, _) in enumerate(plan.steps):
        owner = getattr(fn_, "__self__", None)
        if isinstance(owner, Bucket) and fn_.__name__ == "start":
            starts[id(owner)] = (i, ins)
        elif isinstance(owner, Bucket) and fn_.__name__ == "wait":
            waits[id(owner)] = (i, outs)
        for o in outs:
            written.setdefault(o, i)
        for a in ins:
            read.setdefault(a, []).append(i)
    assert set(starts) == set(waits) and len(starts) == len(plan.buckets)
    bucketed = sum(count for _, count, _ in plan.buckets)
    blocking = sum(getattr(fn_, "__name__", "") == "<lambda>" and fn_.__qualname__.startswith("comm_kernel")
                   for fn_, *_ in plan.steps)
    assert bucketed + blocking == n_all_reduce and bucketed > blocking  # the rest run where the program has them
    for key, (s, ins) in starts.items():
        w, outs = waits[key]
        assert s < w
        assert all(written.get(a, -1) < s for a in ins)  # its operands are computed before it starts
        assert all(min(read.get(o, [len(plan.steps)])) > w for o in outs)  # waited on before any use
        between = plan.steps[max(written.get(a, -1) for a in ins) + 1: s]
        assert all(getattr(f, "__name__", "") in ("start", "poll") for f, *_ in between)  # as soon as ready
    buffers = {id(fn_.__self__): fn_.__self__.buffer for fn_, *_ in plan.steps if isinstance(getattr(fn_, "__self__", None), Bucket)}
    direct = [kw["out"] for _, _, _, kw, _ in plan.steps if isinstance(kw.get("out"), np.ndarray)
              and any(np.shares_memory(kw["out"], b) for b in buffers.values())]
    assert len(direct) >= 2 * 4  # the weight gradients (matmul_rhs_grad) are written into their buckets
    sizes = [(count, nbytes) for _, count, nbytes in plan.buckets]
    assert all(nbytes <= bucket_bytes or count == 1 for count, nbytes in sizes)
    assert len(plan.buckets) > 1
    # the backward pass overlaps: some bucket starts before the last gradient is computed
    first_start = min(s for s, _ in starts.values())
    last_matmul = max(i for i, (fn_, *_) in enumerate(plan.steps) if getattr(fn_, "__name__", "") == "matmul_rhs_grad_values")
    assert first_start < last_matmul


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7)), min_size=1, max_size=5),
       st.sampled_from(["float32", "float64"]), st.integers(2, 3))
def test_a_bucket_returns_views_holding_each_tensors_sum(shapes, dtype, n):
    def body(comm):
        g = tuple(range(comm.size))
        xs = [np.full(s, comm.rank + i + 0.25, dtype) for i, s in enumerate(shapes)]
        bucket = Bucket(comm, g, np.dtype(dtype), [x.shape for x in xs])
        bucket.start(*xs)
        bucket.poll()
        got = bucket.wait()
        got = got if isinstance(got, tuple) else (got,)
        return [(a.copy(), comm.all_reduce(x, g)) for a, x in zip(got, xs)]

    for pairs in run_spmd(n, body, timeout=60):
        for a, b in pairs:
            assert a.shape == b.shape and a.tobytes() == b.tobytes()


# --- sums across device groups (coalesce-group-sums): every program makes the same buckets ------

HETERO_SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=8", "data.batch_size=12"]


@st.composite
def hetero_strategies(draw):
    """A strategy of two or three device groups over 3 ranks, with drawn batch shares."""
    a, b, c = (draw(st.integers(1, 3)) for _ in range(3))
    return draw(st.sampled_from([
        f"[0,1]: dp=2 share={a} | [2]: dp=1 share={b}",
        f"[0]: dp=1 share={a} | [1,2]: dp=2 share={b}",
        f"[0]: dp=1 share={a} | [1]: dp=1 share={b} | [2]: dp=1 share={c}",
        f"[0,1]: tp=2 share={a} | [2]: dp=1 share={b}",
    ]))


def _train_groups(compiled, script, steps, bucket_bytes):
    def body(comm):
        fn = _fn(compiled, comm.rank)
        plan = build_plan(fn, comm.rank, comm, bucket_bytes=bucket_bytes)
        state = plan.initial_state(0)
        config = {**script.config, "lr_schedule": compiled.lr_schedule}
        names = {leaf.name for leaf in plan.inputs}
        batches = script.batches()
        losses = [plan.run(state, plan.local_batch({**next(batches), **step_inputs(step, config, names)}))["loss"]
                  for step in range(1, steps + 1)]
        return [float(x) for x in losses], state, plan.buckets

    return run_spmd(3, body, timeout=300)


@settings(max_examples=6, deadline=None)
@given(hetero_strategies())
def test_sums_across_groups_coalesce_into_the_same_buckets_with_the_same_bits(strategy):
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(HETERO_SMALL))
    compiled = compile_script(script, strategy, 3)
    marked = [op for _, module in physical_groups(compiled.physical) for op in module.walk()
              if isinstance(op, comm_dialect.AllReduceOp) and comm_dialect.COALESCE_ATTR in op.attributes]
    assert marked  # the loss's and the gradients' sums across the groups
    coalesced = _train_groups(compiled, script, 2, -1)
    plain = _train_groups(compiled, script, 2, None)
    across = [[b for b in buckets if len(b[0]) == 3] for _, _, buckets in coalesced]
    assert across[0] and across[0] == across[1] == across[2]  # every program made the same bucket(s)
    for (l1, s1, _), (l2, s2, _) in zip(coalesced, plain):
        assert l1 == l2
        assert all(s1[k].tobytes() == s2[k].tobytes() for k in s1)
