"""Batches of small float32 products in one C++ call (`runtime/cpu/small_matmul.py`,
`runtime/cpu/native/small_matmul.cpp`): NumPy's values to the dot product's rounding bound for any
shape, triangle, stride and thread count; NumPy's bits on attention's shapes; the same bits on one
thread and two; NumPy's own products where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from hspmd.codegen import cpu_compile
from hspmd.runtime.cpu.native import library
from hspmd.runtime.cpu.small_matmul import TRIANGLE_CODES, SmallMatmul

from conftest import assert_bits_or_close, numpy_sums_in_one_chain

pytestmark = pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="needs a C++ compiler")


def _maker(threads: int) -> SmallMatmul:
    lib = library()
    assert lib is not None
    return SmallMatmul(lib.hs_small_matmul_f32, lambda: threads)


def _refuse(a, b, out=None):
    raise AssertionError("the C++ kernel should have taken these operands")


def _operands(rng, triangle: str, lead: tuple[int, ...], m: int, k: int, n: int):
    """Return (a, b, expected) for `triangle`: the triangular operand square, zeros where the
    triangle says; an "out-" product's expected result zero on the other side of its diagonal."""
    side, _, lower = triangle.partition("-")
    if side == "lhs":
        m = k
    elif side == "rhs":
        n = k
    elif side == "out":
        n = m
    a = rng.standard_normal((*lead, m, k)).astype(np.float32)
    b = rng.standard_normal((*lead, k, n)).astype(np.float32)
    cut = np.tril if lower == "lower" else np.triu
    if side == "lhs":
        a = cut(a)
    elif side == "rhs":
        b = cut(b)
    return a, b


@settings(max_examples=80, deadline=None)
@given(triangle=st.sampled_from(sorted(TRIANGLE_CODES)), lead=st.sampled_from([(1,), (3,), (2, 3), (5, 1)]),
       m=st.integers(1, 40), k=st.integers(0, 40), n=st.integers(1, 70), a_t=st.booleans(), b_t=st.booleans(),
       out_t=st.booleans(), a_gaps=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_products_are_numpy_products_to_rounding(triangle, lead, m, k, n, a_t, b_t, out_t, a_gaps, threads, seed):
    """Every element within the dot product's rounding bound of `np.matmul` (`2 k eps sum |a||b|`),
    for operands given transposed (strided views) or with no unit stride, results laid out by
    rows or by columns, on 1 to 3 threads; an "out-lower" ("out-upper") product right on and
    below (above) its diagonal, and 0 or its value elsewhere."""
    rng = np.random.default_rng(seed)
    a, b = _operands(rng, triangle, lead, m, k, n)
    if triangle.startswith("out-") and a.shape[-2] != b.shape[-1]:
        return
    if a_t:
        a = np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    if b_t:
        b = np.ascontiguousarray(b.swapaxes(-1, -2)).swapaxes(-1, -2)
    if a_gaps:  # no unit stride (every other row and column of a larger array): A is packed
        wide = np.zeros((*a.shape[:-2], 2 * a.shape[-2], 2 * a.shape[-1]), np.float32)
        wide[..., ::2, ::2] = a
        a = wide[..., ::2, ::2]
    expect = np.matmul(a.astype(np.float64), b.astype(np.float64))
    bound = 2 * max(a.shape[-1], 1) * np.finfo(np.float32).eps * np.matmul(np.abs(a), np.abs(b)).astype(np.float64)
    out = np.full(expect.shape, np.nan, np.float32)
    if out_t:
        out = np.full(expect.swapaxes(-1, -2).shape, np.nan, np.float32).swapaxes(-1, -2)
    kernel = _maker(threads).kernel(triangle, _refuse)
    assert kernel(a, b, out=out) is out
    err = np.abs(out - expect)
    if triangle.startswith("out-"):
        rows, cols = np.indices(out.shape[-2:])
        wanted = cols <= rows if triangle == "out-lower" else cols >= rows
        assert np.all(err[..., wanted] <= bound[..., wanted])
        other = out[..., ~wanted]
        assert np.all((other == 0) | (np.abs(other - expect[..., ~wanted]) <= bound[..., ~wanted]))
    else:
        assert np.all(err <= bound)


def _attention(rng):
    """q, k, v as GPT-tiny's attention sees them (views of one qkv product), the probabilities
    (lower triangular), the scores' gradient (lower) and the output's gradient."""
    qkv = rng.standard_normal((16, 128, 4, 192)).astype(np.float32)
    q, k, v = (qkv[..., i * 64:(i + 1) * 64].transpose(0, 2, 1, 3) for i in range(3))
    att = np.tril(rng.random((16, 4, 128, 128), dtype=np.float32))
    ds = np.tril(rng.standard_normal((16, 4, 128, 128)).astype(np.float32))
    dy = rng.standard_normal((16, 4, 128, 64)).astype(np.float32)
    return q, k, v, att, ds, dy


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_products_have_numpys_bits(threads):
    """The six products of causal attention's forward and backward, with their triangles and the
    k gradient written into a concat laid out by columns: the bits of `np.matmul` where OpenBLAS
    adds in one chain (`numpy_sums_in_one_chain`), else its values to rounding."""
    q, k, v, att, ds, dy = _attention(np.random.default_rng(0))
    maker = _maker(threads)
    with threadpool_limits(threads, user_api="blas"):
        exact = numpy_sums_in_one_chain()
    concat = np.empty((16, 128, 4, 192), np.float32)
    dk = concat[..., 64:128].transpose(0, 2, 3, 1)  # (16, 4, 64, 128), columns strided
    cases = [("out-lower", q, k.swapaxes(-1, -2), None), ("lhs-lower", att, v, None),
             ("out-lower", dy, v.swapaxes(-1, -2), None), ("lhs-upper", att.swapaxes(-1, -2), dy, None),
             ("lhs-lower", ds, k, None), ("rhs-lower", q.swapaxes(-1, -2), ds, dk)]
    for triangle, a, b, out in cases:
        with threadpool_limits(threads, user_api="blas"):
            expect = np.matmul(a, b)
        got = maker.kernel(triangle, _refuse)(a, b, out=out)
        if triangle == "out-lower":
            got, expect = np.tril(got), np.tril(expect)
        if exact:
            np.testing.assert_array_equal(got.view(np.int32), expect.view(np.int32), err_msg=triangle)
        else:
            np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5, err_msg=triangle)


def test_bits_do_not_depend_on_threads_or_batch():
    """One product's bits are the same on 1 and 2 threads and inside a batch or alone."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((6, 33, 47)).astype(np.float32)
    b = rng.standard_normal((6, 47, 29)).astype(np.float32)
    one, two = (_maker(t).kernel("", _refuse)(a, b) for t in (1, 2))
    np.testing.assert_array_equal(one, two)
    alone = _maker(1).kernel("", _refuse)(a[2:3], b[2:3])
    np.testing.assert_array_equal(alone[0], one[2])


def test_other_operands_go_to_the_fallback():
    """float64, broadcast batches and 2-D operands are NumPy's (the fallback's)."""
    calls = []

    def fallback(a, b, out=None):
        calls.append(a.dtype)
        return np.matmul(a, b, out=out)

    kernel = _maker(2).kernel("", fallback)
    x = np.ones((2, 3, 4))
    np.testing.assert_array_equal(kernel(x, np.ones((2, 4, 5))), np.full((2, 3, 5), 4.0))
    kernel(np.ones((2, 3, 4), np.float32), np.ones((1, 4, 5), np.float32))
    kernel(np.ones((3, 4), np.float32), np.ones((4, 5), np.float32))
    assert len(calls) == 3


def test_unknown_triangle_is_refused():
    with pytest.raises(ValueError, match="unknown triangle 'middle'"):
        _maker(1).kernel("middle", np.matmul)


def test_gpt_tiny_attention_shapes_train_with_numpys_bits():
    """GPT-tiny's attention (4 heads of 64, 128 positions; one layer, 4 sequences here): 2 AdamW
    steps with the C++ products give the parameters of NumPy's products bit for bit where OpenBLAS
    adds in one chain (`numpy_sums_in_one_chain`), to rounding elsewhere."""
    import os

    from hspmd.compiler import compile_script
    from hspmd.dialects.levels import physical_groups
    from hspmd.frontend.script import load_script
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.kernel_exec import select_program
    from hspmd.runtime.plan import build_plan
    from hspmd.runtime.worker import step_inputs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = {"model.layers": 1, "model.d_model": 256, "model.heads": 4, "model.seq_len": 128,
              "data.batch_size": 4, "model.vocab_size": 256, "model.dropout": 0.0}
    script = load_script(os.path.join(root, "examples", "gpt.py"), config)
    compiled = compile_script(script, "[0]: dp=1", 1)
    (_, physical), = physical_groups(compiled.physical)
    (_, fused), = compiled.kernel_groups()
    module = select_program(physical, fused, "cpu")
    fn = next(o for o in module.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
    (comm,) = InProcessCommunicator.create_world(1)
    plans = [build_plan(fn, 0, comm, small_matmul=on) for on in (True, False)]
    exact = numpy_sums_in_one_chain()
    states = [p.initial_state(0) for p in plans]
    run_config = {**script.config, "lr_schedule": compiled.lr_schedule}
    names = {leaf.name for leaf in plans[0].inputs}
    batches = script.batches()
    for n in (1, 2):
        batch = {**next(batches), **step_inputs(n, run_config, names)}
        losses = [float(p.run(s, p.local_batch(batch))["loss"]) for p, s in zip(plans, states)]
        assert_bits_or_close(losses[0], losses[1], exact)
    for name in states[1]:
        assert_bits_or_close(states[0][name], states[1][name], exact, err_msg=name)
