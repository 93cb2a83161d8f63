"""`graph.literal`: a constant tensor given element by element (the PyTorch importer's rotary
tables, position ids, masks), added the "A new op" way in `dialects/graph/leaves.py`.

Its text keeps every bit (hexadecimal bytes, -inf and NaN included) and parses back; its kernel
makes the tensor, or at the physical level the rank's piece of it; N ranks under random layouts
of the values it meets give the one-device numbers; `check_facts` holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_ops_spmd import Leaves, layouts_for
from test_op_facts import check_facts
from test_spmd_property import _declined, check_outputs, compile_step, run_step

from hspmd.dialects import graph
from hspmd.dialects.context import module_text, parse_module
from hspmd.dialects.interfaces import KernelContext
from hspmd.frontend.tracing import Tracer
from hspmd.ir.layout import Layout
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.transforms.autodiff import Autodiff
from hspmd.transforms.util import PassError


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32"])
def test_the_text_keeps_every_bit(dtype):
    values = np.array([[1.5, -0.0, 3e-38, 7.0], [np.inf, -np.inf, np.nan, 2 ** 0.5]]).astype(dtype) \
        if dtype.startswith("float") else np.array([[0, -1, 2 ** 30, 5], [7, 8, 9, -(2 ** 31)]]).astype(dtype)
    t = Tracer()
    y = t.literal(values)
    t.output("y", y)
    op = y.value.owner
    assert isinstance(op, graph.LiteralOp) and y.shape == (2, 4) and y.dtype == dtype
    check_facts(op)
    again = next(o for o in parse_module(module_text(t.finish())).walk() if isinstance(o, graph.LiteralOp))
    got = again.values()
    assert got.dtype == values.dtype and got.tobytes() == values.tobytes()
    np.testing.assert_array_equal(kernel_for(again)(), values)


def test_a_literal_of_the_wrong_size_is_refused():
    from xdsl.dialects.builtin import TensorType, f32
    from xdsl.utils.exceptions import VerifyException

    op = graph.LiteralOp(np.zeros(3, np.float32), TensorType(f32, [3]))
    op.properties["data"] = type(op.data)("00" * 8)
    with pytest.raises(VerifyException, match="holds 8 bytes"):
        op.verify()


def test_each_rank_makes_its_piece():
    from hspmd.dialects.dist import with_layout
    from hspmd.ir.layout_text import parse_layout

    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = Tracer()
    op = t.literal(values).value.owner
    op.properties["global_type"] = with_layout(op.result.type, parse_layout("[0,1]: split(1)=2"))
    assert np.array_equal(op.numpy_kernel(KernelContext(rank=1))(), values[:, 3:])


@settings(max_examples=12, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_n_ranks_give_the_one_device_numbers(data, seed):
    """`loss = sum((x @ w) * L + L2)` with literals L, L2 under random layouts of x and w on 1-4
    in-process ranks: each rank's piece of the literals is the one its users need."""
    t = Tracer()
    leaves = Leaves(t, seed)
    rng = np.random.default_rng(seed)
    y = leaves.input("x", (4, 6)) @ leaves.param("w", (6, 4))
    y = y * t.literal(rng.standard_normal((4, 4)).astype(y.dtype)) + t.literal(np.arange(4).astype(y.dtype))
    t.output("loss", y.sum())
    t.output("y", y)
    logical = t.finish()
    Autodiff().apply(None, logical)
    shapes = {op.tensor_name.data: op.result.type.get_shape() for op in logical.walk()
              if op.name in ("graph.parameter", "graph.input")}
    n, layouts = data.draw(layouts_for(shapes))
    (ref,) = run_step(compile_step(logical, {leaf: Layout.replicated((0,)) for leaf in layouts}), 1, leaves.batch)
    try:
        physical = compile_step(logical, layouts)
    except (PassError, NotImplementedError) as err:
        if _declined(err) is None:
            raise
        assume(False)
    check_outputs(run_step(physical, n, leaves.batch), ref, f"literal on {n} ranks")
