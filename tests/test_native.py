"""The runtime's own C++ library (`runtime/cpu/native.py`): the gradient's sum of squares in float64
(clipping) within float64's rounding of NumPy's, its order of additions fixed whatever the
threads; NumPy's kernel where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from hspmd.codegen import cpu_compile
from hspmd.runtime.cpu import native

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
