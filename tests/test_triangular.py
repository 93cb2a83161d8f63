"""Causal attention's products on their non-zero blocks: the schedule's analysis finds the
triangular operands (`codegen/schedule/triangular.py`) and the runtime's block products
(`runtime/cpu/triangular_matmul.py`) give the full products' values, and their bits."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd as hs
from hspmd.codegen.schedule import build_schedule
from hspmd.compiler import annotate, run_passes, to_physical
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.tracing import Tracer
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.plan import build_plan
from hspmd.runtime.cpu.triangular_matmul import TILE, triangular_matmul

from conftest import assert_bits_or_close, numpy_sums_in_one_chain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _triangular(rng, shape, dtype, lower: bool) -> np.ndarray:
    x = rng.standard_normal(shape).astype(dtype)
    return np.tril(x) if lower else np.triu(x)


@settings(max_examples=60, deadline=None)
@given(triangle=st.sampled_from(["lhs-lower", "lhs-upper", "rhs-lower", "rhs-upper"]),
       lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), n=st.integers(1, 100), m=st.integers(1, 70),
       dtype=st.sampled_from([np.float32, np.float64]), transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_block_products_are_the_full_product(triangle, lead, n, m, dtype, transposed, seed):
    """Each triangle's block product equals `np.matmul` of the same operands to rounding (the
    dot product's error bound), for any size around and across the block size, batched or not,
    with transposed (strided) operands, into a result laid out by rows or by columns. Not always
    bit for bit: for some shapes (33 x 33 @ 33 x 2) OpenBLAS adds a block's terms with another
    kernel than the whole product's."""
    rng = np.random.default_rng(seed)
    side, lower = triangle.split("-")
    tri = _triangular(rng, (*lead, n, n), dtype, lower == "lower")
    other_shape = (*lead, n, m) if side == "lhs" else (*lead, m, n)
    other = rng.standard_normal(other_shape).astype(dtype)
    if transposed:  # the same values through a transposed view of a contiguous array
        other = np.ascontiguousarray(np.swapaxes(other, -1, -2)).swapaxes(-1, -2)
    a, b = (tri, other) if side == "lhs" else (other, tri)
    expect = np.matmul(a, b)
    bound = 2 * n * np.finfo(dtype).eps * np.matmul(np.abs(a), np.abs(b))
    got = triangular_matmul(triangle)(a, b)
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert np.all(np.abs(got - expect) <= bound)
    out = np.full_like(expect, np.nan)  # into a given out=, every entry written
    assert triangular_matmul(triangle)(a, b, out=out) is out
    assert np.all(np.abs(out - expect) <= bound)
    by_columns = np.full_like(np.swapaxes(expect, -1, -2), np.nan).swapaxes(-1, -2)  # as b^T a^T
    assert triangular_matmul(triangle)(a, b, out=by_columns) is by_columns
    assert np.all(np.abs(by_columns - expect) <= bound)


def test_unknown_triangle_is_refused():
    with pytest.raises(ValueError, match="unknown triangle 'middle'"):
        triangular_matmul("middle")


def _attention_program(t: int, masked_softmax: bool = True):
    """Return the physical step function of `sum(attention(q, k, v) * c)`, `t` positions."""
    tr = Tracer()
    shape = (2, 2, t, 8)
    q, k, v = (tr.parameter(name, shape, "normal:1.0", "float32") for name in ("q", "k", "v"))
    scores = hs.causal_mask((q @ k.transpose((0, 1, 3, 2))) * 0.35)
    att = hs.softmax(scores, -1) if masked_softmax else scores
    y = att @ v
    c = tr.input("c", shape, "float32")
    tr.output("loss", (y * c).sum())
    module = tr.finish()
    run_passes(module, "autodiff")
    annotate(module, "[0]: dp=1")
    to_physical(module)
    (_, group), = physical_groups(module)
    return next(o for o in group.walk() if o.name == "func.func" and o.sym_name.data == "train_step")


def _triangles(fn) -> list[str]:
    return sorted(s.triangle for s in build_schedule(fn, 0).steps if s.triangle)


def test_attention_products_with_a_triangular_operand_are_found():
    """Forward att @ v, and the backward's products with att^T, ds and ds's transpose; the
    scores and the probabilities' gradient dy @ v^T read only on and below the diagonal."""
    assert _triangles(_attention_program(40)) == ["lhs-lower", "lhs-lower", "lhs-upper", "out-lower", "out-lower",
                                                  "rhs-lower"]


def test_masked_scores_without_softmax_are_not_triangular():
    """causal_mask alone puts -inf above the diagonal (not zeros): att @ v stays a full product;
    the backward's mask gradient (0 above) still makes its products triangular."""
    found = _triangles(_attention_program(40, masked_softmax=False))
    assert "lhs-lower" in found  # the gradient's products (ds @ k)
    fwd = [s for s in build_schedule(_attention_program(40, masked_softmax=False), 0).steps
           if s.op is not None and s.op.name == "graph.matmul"]
    assert fwd[1].triangle == ""  # the forward's masked @ v


def test_scores_read_above_the_diagonal_are_computed_in_full():
    """Scores that a consumer also reads unmasked are not "out-lower"; masked only, they are."""
    def scores_program(unmasked_use: bool):
        tr = Tracer()
        q, k = (tr.parameter(name, (2, 16, 8), "normal:1.0", "float32") for name in ("q", "k"))
        s = q @ k.transpose((0, 2, 1))
        c = tr.input("c", (2, 16, 16), "float32")
        loss = (hs.softmax(hs.causal_mask(s * 0.5), -1) * c).sum()
        tr.output("loss", loss + (s * c).sum() if unmasked_use else loss)
        module = tr.finish()
        annotate(module, "[0]: dp=1")
        to_physical(module)
        (_, group), = physical_groups(module)
        fn = next(o for o in group.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
        return [s.triangle for s in build_schedule(fn, 0).steps if s.op is not None and s.op.name == "graph.matmul"]

    assert scores_program(False) == ["out-lower"]
    assert scores_program(True) == [""]


@pytest.mark.parametrize("t", [40, 100])
@pytest.mark.parametrize("small", [True, False])
def test_attention_step_has_the_full_products_bits(t, small):
    """The step's loss and gradients with block products (and batches by halves) are those of
    full products, bit for bit: with the C++ kernel of `small_matmul` (whose triangles skip exact
    zeros of one chain of additions, for any shape), and with NumPy's products where OpenBLAS adds
    in one chain too (`numpy_sums_in_one_chain`; to rounding elsewhere)."""
    fn = _attention_program(t)
    (comm,) = InProcessCommunicator.create_world(1)
    plans = [build_plan(fn, 0, comm, triangular=on, split_batches=on, small_matmul=small) for on in (True, False)]
    state = plans[0].initial_state(3)
    batch = {"c": np.random.default_rng(4).standard_normal((2, 2, t, 8)).astype(np.float32)}
    outs = [p.run(dict(state), p.local_batch(batch)) for p in plans]
    assert set(outs[0]) >= {"loss", "grad:q", "grad:k", "grad:v"}
    exact = small or numpy_sums_in_one_chain()
    for name in outs[1]:
        assert_bits_or_close(outs[0][name], outs[1][name], exact, err_msg=name)


@pytest.mark.parametrize("small", [True, False])
def test_gpt_training_is_bit_identical_with_block_products(small):
    """examples/gpt.py (2 layers, 64 positions), fused kernels: 4 triangular products a layer (and
    2 read only below the diagonal), and 3 AdamW steps give the same parameters, bit for bit, as
    with full products in one call each; with `small_matmul`'s products, and with NumPy's where
    OpenBLAS adds in one chain (to rounding elsewhere)."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script
    from hspmd.runtime.kernel_exec import select_program
    from hspmd.runtime.worker import step_inputs

    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), {"model.d_model": 64, "data.batch_size": 4})
    compiled = compile_script(script, "[0]: dp=1", 1)
    (_, physical), = physical_groups(compiled.physical)
    (_, fused), = compiled.kernel_groups()
    module = select_program(physical, fused, "cpu")
    fn = next(o for o in module.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
    assert script.config["model"]["seq_len"] > TILE
    assert _triangles(fn) == ["lhs-lower"] * 4 + ["lhs-upper"] * 2 + ["out-lower"] * 4 + ["rhs-lower"] * 2
    (comm,) = InProcessCommunicator.create_world(1)
    plans = [build_plan(fn, 0, comm, triangular=on, split_batches=on, small_matmul=small) for on in (True, False)]
    exact = small or numpy_sums_in_one_chain()
    states = [p.initial_state(0) for p in plans]
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    names = {leaf.name for leaf in plans[0].inputs}
    batches = script.batches()
    for n in range(1, 4):
        batch = next(batches)
        losses = [float(p.run(s, p.local_batch({**batch, **step_inputs(n, config, names)}))["loss"])
                  for p, s in zip(plans, states)]
        assert_bits_or_close(losses[0], losses[1], exact)
    for name in states[1]:
        assert_bits_or_close(states[0][name], states[1][name], exact, err_msg=name)


@pytest.mark.parametrize("small", [True, False])
def test_tensor_parallel_ranks_use_block_products_with_the_same_bits(small):
    """tp=2 on two in-process ranks (each holds half the heads): every rank's causal products are
    found on its local shapes, and 2 steps give the bits of full products on both ranks (to
    rounding with NumPy's products where OpenBLAS does not add in one chain)."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.worker import step_inputs

    overrides = ["model.layers=1", "model.d_model=32", "model.heads=4", "model.seq_len=48", "data.batch_size=2"]
    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), parse_overrides(overrides))
    compiled = compile_script(script, "[0,1]: tp=2", 2)

    def fn_of(rank):
        (_, module), = physical_groups(compiled.physical)
        return next(o for o in module.walk() if o.name == "func.func" and o.sym_name.data == "train_step")

    def train(on: bool):
        def body(comm):
            fn = fn_of(comm.rank)
            found = _triangles(fn) if on else []
            plan = build_plan(fn, comm.rank, comm, triangular=on, split_batches=on, small_matmul=small)
            state = plan.initial_state(0)
            config = {**script.config, "lr_schedule": compiled.lr_schedule}
            names = {leaf.name for leaf in plan.inputs}
            batches = script.batches()
            losses = [float(plan.run(state, plan.local_batch({**next(batches), **step_inputs(n, config, names)}))["loss"])
                      for n in (1, 2)]
            return found, losses, state

        return run_spmd(2, body, timeout=300)

    blocks, full = train(True), train(False)
    exact = small or numpy_sums_in_one_chain()
    for (found, l1, s1), (_, l2, s2) in zip(blocks, full):
        assert found == ["lhs-lower", "lhs-lower", "lhs-upper", "out-lower", "out-lower", "rhs-lower"]
        assert_bits_or_close(l1, l2, exact)
        for name in s1:
            assert_bits_or_close(s1[name], s2[name], exact, err_msg=name)
