"""Matmul results written in their consumer's layout (`hspmd.codegen.schedule.placement`).

The reference is the same plan without reused buffers (`reuse_buffers=False`: no placement,
every reshape and concat copies): the bits of every loss and parameter must agree.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.flatten import flatten
from hspmd.codegen.schedule.placement import placements
from hspmd.codegen.schedule.triangular import triangular_matmuls
from hspmd.compiler import compile_script
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.dialects.graph.matmul import matmul_values
from hspmd.dialects.graph.shape import concat_values
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.kernel_exec import select_program
from hspmd.runtime.plan import build_plan
from hspmd.runtime.worker import step_inputs

SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "data.batch_size=4"]


def _train_step(module):
    return next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
                and op.sym_name.data == "train_step")


@pytest.fixture(scope="module")
def gpt():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(SMALL))
    compiled = compile_script(script, "[0]: dp=1", 1)
    (_, physical), = physical_groups(compiled.physical)
    (_, fused), = compiled.kernel_groups()
    return script, compiled, physical, fused


def _run(plan, script, compiled, steps):
    state = plan.initial_state(0)
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    names = {leaf.name for leaf in plan.inputs}
    batches = script.batches()
    losses = []
    for step in range(1, steps + 1):
        batch = {**next(batches), **step_inputs(step, config, names)}
        losses.append(float(plan.run(state, plan.local_batch(batch))["loss"]))
    return state, losses


def test_attention_outputs_and_qkv_gradients_are_placed(gpt):
    """Per layer: the attention output's matmul (laid out for its reshape) and the q and v
    gradients' matmuls (written into the concat's buffer); k's, computed transposed, is written
    there too where its matmul runs by triangular blocks (the kernel computes `b^T a^T`)."""
    _, _, physical, _ = gpt
    flat = flatten(_train_step(physical))
    found = placements(flat, lambda i: flat.nodes[i].facts.takes_out)
    own = [p for m, p in found.items() if p.host == m]
    into_concat = [p for m, p in found.items() if p.host != m and p.at is None]
    into_stack = [p for m, p in found.items() if p.at is not None]  # each layer's weight gradients, in place
    assert len(own) == 2 and len(into_concat) == 4  # 2 layers
    assert len(into_stack) == 2 * 12 and {p.at for p in into_stack} == {0, 1}  # GPT's 12 weights per layer
    assert {p.select[2] - p.select[1] for p in into_concat} == {32 // 4}
    assert all(p.perm[-1] == len(p.perm) - 1 for p in found.values())  # rows stay rows
    with_k = {m: p for m, p in placements(flat, lambda i: flat.nodes[i].facts.takes_out,
                                          triangular_matmuls(flat)).items() if p.at is None}
    by_columns = [p for m, p in with_k.items() if p.perm[-1] != len(p.perm) - 1]
    assert len(with_k) == 8 and len(by_columns) == 2 and all(p.host != m for m, p in with_k.items() if p in by_columns)
    schedule = build_schedule(_train_step(physical), 0)
    concats = [s for s in schedule.steps if s.op is not None and s.op.name == "graph.concat"]
    placed = [d for s in schedule.steps for d in (s.out or ()) if d.stored is not None and d.at is None]
    assert len(placed) == 8
    assert len(build_schedule(_train_step(physical), 0, triangular=False).steps) == len(schedule.steps)
    assert sum(d.stored is not None and d.at is None for s in build_schedule(
        _train_step(physical), 0, triangular=False).steps for d in (s.out or ())) == 6
    for c in concats:  # the concat's buffer is the one its placed operands were written into
        assert {d.index for d in placed if d.stored == c.out[0].shape} >= {c.out[0].index}


@pytest.mark.parametrize("level", ["physical", "kernel"])
def test_placed_results_give_the_bits_of_copies(gpt, level):
    script, compiled, physical, fused = gpt
    module = physical if level == "physical" else select_program(physical, fused, "cpu")
    comm = InProcessCommunicator.create_world(1)[0]
    fast = build_plan(_train_step(module), 0, comm)
    plain = build_plan(_train_step(module), 0, comm, reuse_buffers=False, bucket_bytes=None)
    s1, l1 = _run(fast, script, compiled, 3)
    s2, l2 = _run(plain, script, compiled, 3)
    assert l1 == l2
    for name in s1:
        assert s1[name].tobytes() == s2[name].tobytes(), name


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40),
       heads_first=st.booleans(), two_d_rhs=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_into_strided_rows_gives_the_bits_of_a_fresh_result(batch, m, k, n, heads_first, two_d_rhs, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, m, k), dtype=np.float32)
    b = rng.standard_normal((k, n) if two_d_rhs else (batch, k, n), dtype=np.float32)
    expect = matmul_values(a, b)  # a fresh result (rows x 2-D: one product of the rows merged)
    if heads_first:  # batch and rows swapped in memory, as attention's output laid out for its reshape
        out = np.zeros((m, batch, n), np.float32).transpose(1, 0, 2)
    else:  # rows at a stride, as a slice of a concat's buffer
        out = np.zeros((batch, m, n + 5), np.float32)[:, :, 2:n + 2]
    got = matmul_values(a, b, out=out)
    assert got is out
    np.testing.assert_array_equal(out, expect)


def test_concat_copies_only_operands_not_already_in_place():
    rng = np.random.default_rng(0)
    out = np.zeros((3, 4, 9), np.float32)
    placed = out[:, :, 2:5]
    placed[...] = rng.standard_normal(placed.shape)
    first = rng.standard_normal((3, 4, 2)).astype(np.float32)
    last = rng.standard_normal((3, 4, 4)).astype(np.float32)
    got = concat_values((first, placed, last), 2, out)
    assert got is out
    np.testing.assert_array_equal(out, np.concatenate((first, out[:, :, 2:5].copy(), last), axis=2))
    # an operand equal in value but elsewhere in memory is copied
    other = out[:, :, 2:5].copy() + 1
    concat_values((first, other, last), -1, out)
    np.testing.assert_array_equal(out[:, :, 2:5], other)
