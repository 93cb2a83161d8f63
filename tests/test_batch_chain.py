"""Batch chains (`codegen/schedule/chains.py`, `runtime/cpu/batch_chain.py`, `runtime/cpu/native/chain.cpp`):
causal attention's products and softmax run by slices of their batch give the bits of the steps
one after the other; the schedule marks the chains and keeps their values' buffers alive to
each chain's end; a hazard or a missing native library makes a chain run whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from hspmd.codegen.schedule.chains import find_chains, leading_chunks
from hspmd.runtime.cpu import batch_chain, native

from conftest import gpt_cpu_step, train_plan

F32 = np.dtype(np.float32)


def _chains(plan) -> list[batch_chain.Chain]:
    return [f for f, *_ in plan.steps if isinstance(f, batch_chain.Chain)]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16, 24]), seq=st.sampled_from([8, 24, 40]),
       batch=st.sampled_from([2, 3, 8]), threads=st.sampled_from([1, 2]))
def test_a_gpt_step_is_bit_identical_with_batch_chains(heads, head_dim, seq, batch, threads):
    """Random GPT shapes (heads, sequence lengths off the vector width, odd batches), BLAS on one
    or two threads: every chain runs by slices, and 3 steps give the losses and parameters of
    the steps one after the other, bit for bit."""
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.plan import build_plan

    script, compiled, fn = gpt_cpu_step({"model.layers": 2, "model.d_model": heads * head_dim, "model.heads": heads,
                                          "model.seq_len": seq, "data.batch_size": batch, "model.vocab_size": 128})
    results = {}
    with threadpool_limits(threads, user_api="blas"):
        for chains in (False, True):
            plan = build_plan(fn, 0, InProcessCommunicator.create_world(1)[0], batch_chains=chains)
            assert bool(_chains(plan)) == chains
            results[chains] = train_plan(plan, script, compiled)
            for chain in _chains(plan):
                assert chain.last_run_sliced, "a chain ran whole (a hazard in the schedule's buffers?)"
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], value, err_msg=name)


def test_the_schedule_marks_attention_forward_and_backward():
    """GPT's layer: the forward chain (the qkv bias, scores, masked softmax, p @ v) and the
    backward chain (four products and two kernels) per layer."""
    from hspmd.codegen.schedule import build_schedule

    _, _, fn = gpt_cpu_step({"model.layers": 3, "model.d_model": 32, "model.heads": 2, "model.seq_len": 16,
                              "data.batch_size": 4, "model.vocab_size": 128})
    schedule = build_schedule(fn, 0)
    assert len(schedule.chains) == 6
    for first, last in schedule.chains:
        names = [schedule.steps[i].name for i in range(first, last + 1)]
        members = [n for n in names if n in ("graph.matmul",) or n.startswith("kernel.fused")]
        assert len(members) in (4, 6), names
        assert all(n in ("graph.matmul", "graph.transpose", "graph.reshape", "graph.split")
                   or n.startswith("kernel.fused") for n in names), names


def test_a_chain_runs_whole_without_the_native_library(monkeypatch):
    """No native library (no C++ compiler): the chains run one step after the other, same bits."""
    import hspmd.runtime.plan as plan_module
    from hspmd.runtime.comm import InProcessCommunicator

    script, compiled, fn = gpt_cpu_step({"model.layers": 1, "model.d_model": 32, "model.heads": 2,
                                          "model.seq_len": 16, "data.batch_size": 4, "model.vocab_size": 128})
    reference = train_plan(plan_module.build_plan(fn, 0, InProcessCommunicator.create_world(1)[0], batch_chains=False),
                       script, compiled)
    monkeypatch.setattr(plan_module.native, "library", lambda: None)
    plan = plan_module.build_plan(fn, 0, InProcessCommunicator.create_world(1)[0])
    losses, state = train_plan(plan, script, compiled)
    assert _chains(plan) and not any(c.last_run_sliced for c in _chains(plan))
    assert losses == reference[0]
    for name, value in reference[1].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_crossing_finds_writes_into_other_entries():
    buf = np.zeros((8, 4, 6), np.float32)
    assert not batch_chain.crossing(buf, buf)  # entry i against entry i only
    assert not batch_chain.crossing(buf, buf.transpose(0, 2, 1))  # a view of each entry's own memory
    assert not batch_chain.crossing(buf[:, :2], buf[:, 2:])  # the halves of each entry
    assert not batch_chain.crossing(buf, np.zeros_like(buf))
    flat = np.zeros(8 * 24 + 24, np.float32)
    a = flat[:8 * 24].reshape(8, 24)
    shifted = flat[12:12 + 8 * 24].reshape(8, 24)  # entry i overlaps entries i and i + 1 of `a`
    assert batch_chain.crossing(a, shifted) and batch_chain.crossing(shifted, a)
    assert batch_chain.crossing(buf, buf.reshape(4, 2, 4, 6))  # another leading extent, same memory


def test_a_chain_with_a_hazard_runs_whole():
    """Two members where the second writes over the first's operand one entry on: sliced, entry 0
    of the second would clobber entry 1 of the first's operand before it is read."""
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(9 * 16, dtype=np.float32)
    x = flat[:8 * 16].reshape(8, 4, 4)
    y = flat[16:].reshape(8, 4, 4)  # entry i of y is entry i + 1 of x
    mid = np.empty((8, 4, 4), np.float32)
    expect_mid = x + 1  # before y's writes reach x
    expect_y = expect_mid * 2

    def add_one(a, out):
        return np.add(a, 1, out=out)

    def double(a, out):
        return np.multiply(a, 2, out=out)

    def sliced(*args, out):  # describes itself, as the C++ steps do, but is never run sliced here
        return []

    members = [batch_chain._Member(add_one, (0,), (1,), mid, sliced),
               batch_chain._Member(double, (1,), (2,), y, sliced)]
    ran = []
    chain = batch_chain.Chain(members, 8, (0,), (1, 2), 64, lambda *a: ran.append(a) or 0, lambda: 2)
    got_mid, got_y = chain(x)
    assert not ran and not chain.last_run_sliced
    np.testing.assert_array_equal(got_mid, expect_mid)
    np.testing.assert_array_equal(got_y, expect_y)


def test_a_view_step_that_copies_makes_the_chain_run_whole():
    """A reshape between members that must copy (computed before the member that writes its
    source) would slice stale values: the chain runs one step after the other instead."""
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    mid = np.empty((8, 12), np.float32)
    out = np.empty((8, 3, 4), np.float32)

    def add_one(a, out):
        return np.add(a, 1, out=out)

    def copy_reshape(a):
        return np.array(a.reshape(8, 3, 4))  # a copy, as NumPy makes for a non-contiguous value

    def double(a, out):
        return np.multiply(a, 2, out=out)

    def described(*args, out):
        return []

    parts = [batch_chain._Member(add_one, (0,), (1,), mid, described), batch_chain._View(copy_reshape, (1,), (2,)),
             batch_chain._Member(double, (2,), (3,), out, described)]
    ran = []
    chain = batch_chain.Chain(parts, 8, (0,), (1, 2, 3), 64, lambda *a: ran.append(a) or 0, lambda: 2)
    got_mid, got_view, got_out = chain(x)
    assert not ran and not chain.last_run_sliced
    np.testing.assert_array_equal(got_out, (x + 1).reshape(8, 3, 4) * 2)


@pytest.mark.parametrize("ins, outs, launches, ok", [
    ([((4, 2, 8, 8), F32)], [((4, 2, 8, 8), F32)], [("row", "k", 64, 8)], True),
    ([((4, 2, 8, 8), F32), ((), F32)], [((4, 2, 8, 8), F32)], [("row", "k", 64, 8)], True),  # a scalar
    ([((8, 8), F32)], [((8, 8), F32)], [("row", "k", 8, 8)], False),  # rank 2: a mask's r % rows
    ([((4, 8, 8), F32), ((8,), F32)], [((4, 8, 8), F32)], [("row", "k", 32, 8)], False),  # broadcast
    ([((4, 8, 8), F32)], [((4, 8, 8), F32)], [("elementwise", "k", 256, 0)], False),
    ([((4, 8, 8), F32)], [((4, 8, 8), F32)], [("row", "k", 32, 8), ("elementwise", "k2", 8, 32)], False),
])
def test_leading_chunks(ins, outs, launches, ok):
    assert leading_chunks(ins, outs, launches, ()) is ok
    assert not leading_chunks(ins, outs, launches, (16,))  # scratch


def test_leading_chunks_takes_a_bias_broadcast_onto_trailing_dims():
    """An operand broadcast onto the result's trailing dims (a bias) is passed whole to every
    slice; one of another shape, or not marked as such a broadcast, is not."""
    out = [((4, 8, 6), F32)]
    launch = [("row", "k", 32, 6)]
    assert leading_chunks([((4, 8, 6), F32), ((6,), F32)], out, launch, (), [False, True])
    assert leading_chunks([((4, 8, 6), F32), ((8, 6), F32)], out, launch, (), [False, True])
    assert not leading_chunks([((4, 8, 6), F32), ((6,), F32)], out, launch, (), [False, False])
    assert not leading_chunks([((4, 8, 6), F32), ((4,), F32)], out, launch, (), [False, True])
    assert not leading_chunks([((4, 8, 6), F32), ((1, 8, 6), F32)], out, launch, (), [False, True])


def test_trailing_broadcasts_reads_the_kernel_body():
    """GPT's fused kernels: the qkv bias add's bias is a trailing broadcast (so the kernel joins
    the forward chain); a layer norm's weight, read by the norm itself, is not."""
    from hspmd.codegen.schedule.chains import trailing_broadcasts
    from hspmd.runtime.kernel_exec import fused_ops

    _, compiled, _ = gpt_cpu_step({"model.layers": 1, "model.d_model": 32, "model.heads": 2,
                                    "model.seq_len": 16, "data.batch_size": 4, "model.vocab_size": 128})
    ((_, fused),) = compiled.kernel_groups()
    seen = {}
    for op in fused_ops(fused):
        names = {o.name for o in op.body.block.ops}
        seen.setdefault(frozenset(names), trailing_broadcasts(op))
    bias_adds = [f for names, f in seen.items() if names == {"graph.broadcast", "graph.add", "func.return"}
                 or names == {"graph.broadcast", "graph.add", "kernel.yield"}]
    assert any(f == [False, True] for f in bias_adds), seen
    norms = [f for names, f in seen.items() if "graph.layer_norm" in names]
    assert norms and all(not any(f) for f in norms)


def test_find_chains_stops_at_other_steps():
    from types import SimpleNamespace as N

    def node(name, ins, outs):
        return N(kind="op", op=N(name=name), ins=ins, outs=outs, microbatch=None)

    nodes = [node("m", (0, 1), (2,)), node("graph.transpose", (2,), (3,)), node("m", (3, 1), (4,)),
             node("graph.concat", (4,), (5,)),  # not a view: ends the chain
             node("m", (5, 1), (6,)), node("m", (6, 1), (7,))]
    leads = {0: 4, 2: 4, 4: 4, 5: 4}
    assert find_chains(nodes, leads.get) == [(0, 2), (4, 5)]
    assert find_chains(nodes, {0: 4, 2: 3}.get) == []  # members of other extents


@pytest.mark.skipif(native.library() is None, reason="needs a C++ compiler for the native library")
def test_a_malformed_description_runs_nothing():
    lib = native.library()
    for desc in ([7, 0, 0], [0, 1, 2], [1, 0, 1, 1, 5]):
        packed = np.array(desc, dtype=np.int64)
        assert lib.hs_chain_run(4, 1, packed.ctypes.data, packed.size, 2) == -1
