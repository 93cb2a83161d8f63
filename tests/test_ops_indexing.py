"""The ops the PyTorch importer translates Core ATen into: indexing with tensors (`graph.take`,
`take_along` and their scatter-add transposes), `graph.topk`, `graph.cumsum`, the elementary
functions, comparisons and `graph.select` (`dialects/graph/indexing.py`, `elementary.py`).

Each is checked as every op is: its NumPy kernel against PyTorch, its gradient against finite
differences (float64 and float32, hypothesis-drawn shapes and values), N ranks under random
layouts against one device, and its CUDA C (built for the CPU) against its NumPy kernel in a
whole training step. `tests/test_op_facts.py` lists them with their facts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_op_facts import check_facts
from test_ops_grad import check_case, small
from test_ops_spmd import Leaves, layouts_for
from test_spmd_property import _declined, check_outputs, compile_step, run_step

import hspmd as hs
from hspmd.frontend.tracing import TraceError, Tracer
from hspmd.ir.layout import Layout
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.transforms.autodiff import Autodiff
from hspmd.transforms.util import PassError

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")


def _ids(b, name, shape, high, rng):
    return b.input(name, shape, rng.integers(-high, high, size=shape).astype(np.int64), "int64")


# ----------------------------------------------------------------------------- gradients


def take_case(b, draw):
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    idx = _ids(b, "idx", tuple(draw(st.lists(small, min_size=1, max_size=2))), shape[d], rng)
    return hs.take(b.param("x", shape), idx, d)


def take_grad_case(b, draw):
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    n, rows, cols = draw(small), draw(small), draw(small)
    idx = _ids(b, "idx", (rows,), n, rng)
    return hs.take_grad(idx, b.param("dy", (cols, rows)), n, 1)


def take_along_case(b, draw):
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    shape = (draw(small), draw(small) + 1)
    idx = _ids(b, "idx", (shape[0], draw(small)), shape[1], rng)
    return hs.take_along(b.param("x", shape), idx, 1)


def take_along_grad_case(b, draw):
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    rows, k, n = draw(small), draw(small), draw(small) + 1
    idx = _ids(b, "idx", (k, rows), n, rng)
    return hs.take_along_grad(idx, b.param("dy", (k, rows)), n, 0)


def topk_case(b, draw):
    shape = (draw(small), draw(small) + 2)
    return hs.topk(b.param("x", shape), draw(st.integers(1, shape[1])))[0]


def cumsum_case(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    return hs.cumsum(b.param("x", shape), draw(st.integers(0, len(shape) - 1)))


def select_case(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    m = b.param("m", shape)
    mask = hs.compare(m, m * 0.0, "gt", b.dtype)
    return hs.where(mask, b.param("a", shape), b.param("b", shape))


def extremum_case(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    f = draw(st.sampled_from([hs.maximum, hs.minimum, hs.atan2]))
    return f(b.param("a", shape), b.param("b", shape))


#: elementary functions and the map that brings a normal sample into their domain
UNARY = {"sin": None, "cos": None, "tan": lambda x: hs.tanh(x), "asin": lambda x: hs.tanh(x) * 0.9,
         "acos": lambda x: hs.tanh(x) * 0.9, "atan": None, "sinh": None, "cosh": None, "asinh": None,
         "acosh": lambda x: x * x + 1.5, "atanh": lambda x: hs.tanh(x) * 0.9, "abs": None,
         "log1p": lambda x: x * x, "expm1": None, "log2": lambda x: x * x + 0.5, "log10": lambda x: x * x + 0.5}


def unary_case(b, draw):
    name = draw(st.sampled_from(sorted(UNARY)))
    x = b.param("x", tuple(draw(st.lists(small, min_size=1, max_size=2))))
    into = UNARY[name]
    return getattr(hs, name)(into(x) if into else x)


@pytest.mark.parametrize("case", [take_case, take_grad_case, take_along_case, take_along_grad_case, topk_case,
                                  cumsum_case, select_case, extremum_case, unary_case])
@settings(max_examples=6, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))
def test_the_gradient_matches_finite_differences(case, data, dtype, seed):
    check_case(case, data.draw, dtype, seed)


# ----------------------------------------------------------------------------- values against PyTorch


def _kernel(y, *args):
    return kernel_for(y.value.owner)(*args)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), ties=st.booleans())
def test_the_kernels_give_pytorchs_values(seed, ties):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    if ties:
        x = np.round(x)  # equal values: the lower index comes first, as a stable sort
    t = Tracer()
    tx = t.input("x", x.shape, "float32")
    idx = rng.integers(-7, 7, size=(2, 4))
    ti = t.input("i", idx.shape, "int64")
    np.testing.assert_array_equal(_kernel(hs.take(tx, ti, 1), x, idx), torch.as_tensor(x)[:, torch.as_tensor(idx)])
    along = rng.integers(0, 7, size=(3, 5))
    got = _kernel(hs.take_along(tx, t.input("a", along.shape, "int64"), 1), x, along)
    np.testing.assert_array_equal(got, torch.gather(torch.as_tensor(x), 1, torch.as_tensor(along)))
    values, indices = kernel_for(hs.topk(tx, 3)[0].value.owner)(x)
    want = torch.sort(torch.as_tensor(x), dim=1, descending=True, stable=True)
    np.testing.assert_array_equal(values, want.values[:, :3])
    np.testing.assert_array_equal(indices, want.indices[:, :3])
    np.testing.assert_allclose(_kernel(hs.cumsum(tx, 1), x), torch.cumsum(torch.as_tensor(x), 1), rtol=1e-5, atol=1e-6)
    for p, f in (("lt", torch.lt), ("ge", torch.ge), ("eq", torch.eq), ("ne", torch.ne)):
        got = _kernel(hs.compare(tx, t.constant(0.0, x.shape), p), x, np.zeros_like(x))
        np.testing.assert_array_equal(got, f(torch.as_tensor(x), 0).float())
    dy = rng.standard_normal((3, 2, 4)).astype(np.float32)
    got = _kernel(hs.take_grad(ti, t.input("dy", dy.shape, "float32"), 7, 1), idx, dy)
    rows, cols = torch.arange(3)[:, None, None], torch.as_tensor(idx % 7)[None]
    want = torch.zeros(3, 7).index_put((rows, cols), torch.as_tensor(dy), accumulate=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_ops_refuse_what_they_cannot_take():
    t = Tracer()
    x = t.input("x", (3, 4), "float32")
    with pytest.raises(TraceError, match="take: indices must be integers"):
        hs.take(x, x, 0)
    with pytest.raises(TraceError, match="topk: k=5 must be in 1..4"):
        hs.topk(x, 5)
    with pytest.raises(TraceError, match="take_along: x \\[3, 4\\] and indices \\[2, 2\\] must agree"):
        hs.take_along(x, t.input("i", (2, 2), "int64"), 1)
    with pytest.raises(TraceError, match="compare: predicate 'bigger'"):
        hs.compare(x, x, "bigger")


def test_the_facts_hold_on_each_new_op():
    t = Tracer()
    x, i = t.input("x", (3, 4), "float32"), t.input("i", (3, 2), "int64")
    made = [hs.take(x, i, 1), hs.take_grad(i, t.input("g", (3, 3, 2), "float32"), 4, 1),
            hs.take_along(x, i, 1), hs.take_along_grad(i, t.input("h", (3, 2), "float32"), 4, 1),
            hs.topk(x, 2)[0], hs.cumsum(x, 0), hs.where(hs.compare(x, x, "eq"), x, x), hs.maximum(x, x),
            hs.atan2(x, x), *(getattr(hs, n)(x) for n in UNARY), hs.floor(x), hs.sign(x), hs.round(x)]
    for y in made:
        check_facts(y.value.owner)


# ----------------------------------------------------------------------------- N ranks


@settings(max_examples=12, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_n_ranks_give_the_one_device_numbers(data, seed):
    """`take`, `take_along`, `topk`, `cumsum` and `select` of `x @ w` under random layouts of x, w
    and c on 1-4 in-process ranks equal one device (an indexed dim stays whole: the rules say so)."""
    t = Tracer()
    leaves = Leaves(t, seed)
    h = leaves.input("x", (4, 6)) @ leaves.param("w", (6, 4))  # [4, 4]
    idx = leaves.input("idx", (4, 3), np.random.default_rng(seed).integers(0, 4, size=(4, 3)), "int64")
    y = hs.take_along(h, idx, 1) + hs.take(h, idx, 1).sum([1]) + hs.topk(h, 3)[0]
    y = y + hs.cumsum(hs.where(hs.compare(y, y * 0.0, "gt"), y, y * 0.5), 0)
    t.output("loss", (y * leaves.input("c", y.shape)).sum())
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
    check_outputs(run_step(physical, n, leaves.batch), ref, f"indexing on {n} ranks")


# ----------------------------------------------------------------------------- CUDA C


SCRIPT = '''
import numpy as np
import hspmd as hs

config = {"seed": 0, "steps": 3, "lr": 0.01}


class Net(hs.nn.Module):
    def __init__(self):
        self.w = hs.nn.Linear(6, 8)

    def forward(self, x, idx):
        h = self.w(x)                                     # [4, 8]
        v, i = hs.topk(h, 3)
        g = hs.take_along(h, i, 1) + hs.take(h, idx, 1).sum([1]).reshape((4, 1)) + v
        g = g + hs.slice(hs.take_along_grad(i, v, 8, 1), 1, 0, 3)
        s = hs.sin(g) + hs.cos(g) + hs.atan(g) + hs.abs(g) + hs.log1p(g * g) + hs.expm1(hs.tanh(g)) + hs.tanh(g)
        s = s + hs.where(hs.compare(g, g * 0.0, "gt"), hs.maximum(g, s), hs.minimum(g, s))
        s = s + hs.cumsum(s, 1) + hs.floor(s) * 0.0
        r = hs.take_grad(i.reshape((12,)), s.reshape((12,)), 8, 0)
        return s.mean() + (r * r).mean() * 0.01


def model(config):
    return Net()


def loss(model, batch):
    return model(batch["x"], batch["idx"])


def batches(config):
    rng = np.random.default_rng(0)
    while True:
        yield {"x": rng.standard_normal((4, 6)).astype(np.float32), "idx": rng.integers(0, 8, size=(3,))}
'''


def test_the_device_kernels_give_the_cpu_levels_numbers(tmp_path):
    """A step using every new op: its device program (each op's CUDA C built for the CPU, and
    run on the emulated device) gives the CPU level's losses and parameters."""
    from conftest import train_plan, train_step

    from hspmd.codegen import cpu_compile
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.cuda.emulated import EmulatedDevice
    from hspmd.runtime.cuda.plan import build_device_plan
    from hspmd.runtime.plan import build_plan

    if cpu_compile.find_compiler() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    path = tmp_path / "ops.py"
    path.write_text(SCRIPT)
    script = load_script(str(path), {})
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, fused),) = compiled.kernel_groups()
    ((_, device),) = compiled.device_groups()
    (comm,) = InProcessCommunicator.create_world(1)
    ref, ref_params = train_plan(build_plan(train_step(fused), 0, comm), script, compiled, 3)
    got, params = train_plan(build_plan(train_step(device), 0, comm), script, compiled, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    emulated, _ = train_plan(build_device_plan(train_step(device), 0, EmulatedDevice()), script, compiled, 3)
    np.testing.assert_allclose(emulated, ref, rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert math.isfinite(ref[-1])
