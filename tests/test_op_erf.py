"""`graph.erf`, the worked example of a new op (docs/architecture.md, "A new op").

The op, its sharding rule, gradient, NumPy kernel, CUDA C and `hs.erf` are one class and one
function in `hspmd/dialects/graph/activations.py`; these are its tests, each through the same
machinery as every other op's: values against SciPy, the gradient against finite differences
(float64 and float32), N ranks against one device under random layouts, and the fused CUDA C
kernel (built for the CPU under `cuda_emu.h`, checked by NVRTC where it is installed) against
the NumPy kernel. `tests/test_op_facts.py` lists it with its facts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import special
from test_ops_grad import check_case, small
from test_ops_spmd import Leaves, layouts_for
from test_op_facts import check_facts
from test_spmd_property import _declined, check_outputs, compile_step, run_step

import hspmd as hs
from hspmd.codegen import cpu_compile
from hspmd.codegen.nvrtc_check import check_module, nvrtc_status
from hspmd.dialects import graph
from hspmd.dialects.graph.activations import erf_series, erf_values
from hspmd.dialects.kernel import FusedOp
from hspmd.frontend.tracing import TraceError, Tracer
from hspmd.ir.layout import Layout
from hspmd.runtime import kernel_exec
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.transforms.autodiff import Autodiff
from hspmd.transforms.fuse_kernels import fuse_module
from hspmd.transforms.util import PassError


def test_hs_erf_emits_graph_erf_and_refuses_integers():
    t = Tracer()
    y = hs.erf(t.input("x", (2, 3), "float32"))
    assert isinstance(y.value.owner, graph.ErfOp) and y.shape == (2, 3) and y.dtype == "float32"
    check_facts(y.value.owner)
    with pytest.raises(TraceError, match="erf: needs a float tensor, got int64"):
        hs.erf(t.input("ids", (2,), "int64"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_numpy_kernel_is_scipys_erf(dtype):
    x = np.linspace(-6, 6, 97).astype(dtype)
    t = Tracer()
    op = hs.erf(t.input("x", x.shape, np.dtype(dtype).name)).value.owner
    got = kernel_for(op)(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, special.erf(x).astype(dtype))
    np.testing.assert_allclose(erf_series(x.astype(np.float64)), [math.erf(v) for v in x.astype(np.float64)],
                               rtol=0, atol=2e-15)


def _erf_case(b, draw):
    return hs.erf(b.param("x", tuple(draw(st.lists(small, min_size=1, max_size=3))), "normal:1.0"))


@settings(max_examples=10, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))
def test_the_gradient_matches_finite_differences(data, dtype, seed):
    check_case(_erf_case, data.draw, dtype, seed)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_n_ranks_give_the_one_device_numbers(data, seed):
    """`loss = sum(erf(x @ w) * c)` and its gradients under random layouts of x, w and c on
    1-4 in-process ranks equal one device's (the elementwise rule lets any split through)."""
    t = Tracer()
    leaves = Leaves(t, seed)
    y = hs.erf(leaves.input("x", (4, 6)) @ leaves.param("w", (6, 4)))
    t.output("loss", (y * leaves.input("c", y.shape)).sum())
    t.output("y", y)
    logical = t.finish()
    Autodiff().apply(None, logical)
    shapes = {op.tensor_name.data: op.result.type.get_shape() for op in logical.walk()
              if op.name in ("graph.parameter", "graph.input")}
    n, layouts = data.draw(layouts_for(shapes))
    (ref,) = run_step(compile_step(logical, {leaf: Layout.replicated((0,)) for leaf in layouts}), 1, leaves.batch)
    try:
        physical = compile_step(logical, layouts)
    except (PassError, NotImplementedError) as err:  # layouts the compiler declines, as for every op
        if _declined(err) is None:
            raise
        assume(False)
    check_outputs(run_step(physical, n, leaves.batch), ref, f"erf on {n} ranks")


def test_erf_and_its_gradient_fuse_into_one_kernel_that_matches_numpy():
    """graph.erf and the elementwise ops of its gradient become one CUDA C kernel each way; built
    for the CPU it gives the NumPy kernels' numbers, and NVRTC accepts its source."""
    if cpu_compile.find_compiler() is None:
        pytest.skip("no C++ compiler: the fused kernel cannot be built here")
    t = Tracer()
    x = t.parameter("x", (4, 8), "normal:1.0")
    t.output("loss", (hs.erf(x) * t.input("c", (4, 8), "float32")).sum())
    module = t.finish()
    Autodiff().apply(None, module)
    fuse_module(module)
    kernels = [op for op in module.walk() if isinstance(op, FusedOp)]
    forward = [k for k in kernels if any(isinstance(o, graph.ErfOp) for o in k.body.block.ops)]
    assert len(forward) == 1 and "hs_erf(" in forward[0].source.data
    rng = np.random.default_rng(0)
    for op in kernels:
        args = [rng.standard_normal(v.type.get_shape()).astype(np.float32) for v in op.inputs]
        got, want = kernel_exec.kernel_for(op)(*args), kernel_exec.numpy_call(op)(*args)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=op.kernel.data)
    if nvrtc_status()[0]:
        assert all(size > 0 for size in check_module(module).values())


def test_a_float64_erf_is_exact_to_the_last_bits_of_erf_values():
    x = np.random.default_rng(1).standard_normal(1000)
    np.testing.assert_array_equal(erf_values(x), special.erf(x))
