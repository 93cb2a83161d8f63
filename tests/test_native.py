"""The runtime's own C++ library (`runtime/native.py`): the gradient's sum of squares in float64
(clipping) within float64's rounding of NumPy's, its order of additions fixed whatever the
threads; NumPy's kernel where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from hspmd.codegen import cpu_compile
from hspmd.runtime import native

pytestmark = pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="needs a C++ compiler")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 20000), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_sum_squares_is_numpys_to_float64_rounding(n, dtype, seed):
    """Within `n` float64 epsilons (relative) of the sum NumPy computes, for sizes across the
    4096-value blocks and both float types."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(dtype)
    flat = x.astype(np.float64)
    expect = float(np.dot(flat, flat))
    got = native.sum_squares(x)
    assert got is not None
    assert abs(got - expect) <= max(n, 1) * np.finfo(np.float64).eps * expect


def test_sum_squares_bits_do_not_depend_on_threads():
    x = np.random.default_rng(1).standard_normal((4, 1024, 256)).astype(np.float32)
    assert native.library() is not None  # loaded (with its OpenMP runtime) before the limits
    sums = []
    for threads in (1, 2, 3):
        with threadpool_limits(threads, user_api="openmp"):
            sums.append(native.sum_squares(x))
    assert sums[0] == sums[1] == sums[2]


def test_sum_squares_leaves_other_arrays_to_numpy():
    x = np.ones((8, 8), np.float32)
    assert native.sum_squares(x.T[::2]) is None  # not contiguous
    assert native.sum_squares(x.astype(np.float16)) is None


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple), cols=st.integers(1, 300),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_row_sums_round_the_float64_sum_once(lead, cols, dtype, seed):
    """The sums over the leading dims are the float64 sums rounded once to the dtype (within one
    unit in the last place, plus float64's own rounding for float64 data), and a column's sum is
    the same whichever columns are summed with it (tensor parallelism splits the columns)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, cols)) * 10.0 ** rng.integers(-3, 4, size=(*lead, 1))).astype(dtype)
    got = native.row_sums(x)
    assert got is not None and got.dtype == x.dtype and got.shape == (cols,)
    exact = x.astype(np.float64).reshape(-1, cols).sum(axis=0)
    scale = np.abs(x.astype(np.float64)).reshape(-1, cols).sum(axis=0)
    tol = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64) + x.size * np.finfo(np.float64).eps * scale
    assert np.all(np.abs(got.astype(np.float64) - exact) <= tol)
    half = cols // 2
    if half:
        left = native.row_sums(np.ascontiguousarray(x[..., :half]))
        np.testing.assert_array_equal(left, got[:half])


def test_leading_sum_writes_into_out_and_falls_back_to_numpy():
    from hspmd.runtime.numpy_ops import leading_sum

    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    out = np.empty(4, np.float32)
    assert leading_sum(x, out=out) is out
    np.testing.assert_array_equal(out, x.sum(axis=(0, 1)))
    np.testing.assert_array_equal(leading_sum(x[..., ::2]), x[..., ::2].sum(axis=(0, 1)))  # strided: NumPy's
