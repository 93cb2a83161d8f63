"""The execution plan: flattened callees, buffers reused by liveness, in-place updates, frees.

The reference for every optimisation is the same plan built without it (`reuse_buffers=False`,
no buckets): results must be bitwise identical, since the kernels compute the same bits with
and without `out=`.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.dialects.levels import physical_groups
from hspmd.dialects.graph.activations import gelu_grad_values, gelu_values
from hspmd.dialects.graph.matmul import matmul_values
from hspmd.dialects.graph.norms import layer_norm_grad_values, layer_norm_values
from hspmd.dialects.graph.softmax import softmax_grad_values, softmax_values
from hspmd.runtime import numpy_ops
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.plan import PlanError, accepts_out, build_plan
from hspmd.runtime.worker import step_inputs

SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "data.batch_size=4"]


def _step_fn(physical, rank=0):
    for devices, module in physical_groups(physical):
        if rank in devices:
            return next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
                        and op.sym_name.data == "train_step")
    raise AssertionError(f"no group holds rank {rank}")


@pytest.fixture(scope="module")
def gpt():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(SMALL))
    compiled = compile_script(script, "[0]: dp=1", 1)
    return script, compiled


def _run(plan, script, compiled, steps, state=None):
    state = plan.initial_state(0) if state is None else state
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    names = {leaf.name for leaf in plan.inputs}
    batches = script.batches()
    outs = []
    for step in range(1, steps + 1):
        batch = {**next(batches), **step_inputs(step, config, names)}
        outs.append(plan.run(state, plan.local_batch(batch)))
    return state, outs


def test_reused_buffers_and_in_place_updates_give_the_bits_of_fresh_arrays(gpt):
    script, compiled = gpt
    comm = InProcessCommunicator.create_world(1)[0]
    fast = build_plan(_step_fn(compiled.physical), 0, comm)
    plain = build_plan(_step_fn(compiled.physical), 0, comm, reuse_buffers=False, bucket_bytes=None)
    s1, o1 = _run(fast, script, compiled, 3)
    s2, o2 = _run(plain, script, compiled, 3)
    assert set(s1) == set(s2)
    for name in s1:
        assert s1[name].tobytes() == s2[name].tobytes(), name
    assert [float(o["loss"]) for o in o1] == [float(o["loss"]) for o in o2]


def test_buffers_are_shared_by_values_that_do_not_live_at_once(gpt):
    script, compiled = gpt
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    outs = [kw["out"] for _, _, _, kw, _ in plan.steps if isinstance(kw.get("out"), np.ndarray)]
    total = sum(o.nbytes for o in outs)
    assert outs and plan.buffer_bytes < total / 2  # far fewer bytes than one buffer per value
    params = sum(int(np.prod(p.global_shape)) * 4 for p in plan.params)
    assert plan.peak_bytes >= plan.buffer_bytes + params


def test_callees_are_inlined_into_one_flat_list(gpt):
    script, compiled = gpt
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    fns = [fn for fn, *_ in plan.steps]
    assert all(getattr(fn, "__name__", "") != "call" for fn in fns)
    matmuls = sum(fn is matmul_values for fn in fns)
    assert matmuls >= 2 * 2 * 4  # every layer's matmuls appear, once per layer


def test_adam_updates_the_state_arrays_in_place(gpt):
    script, compiled = gpt
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    state = plan.initial_state(0)
    before = {k: v for k, v in state.items()}
    start = {k: v.copy() for k, v in state.items()}
    _run(plan, script, compiled, 1, state)
    weights = [k for k in state if k.endswith(".weight") and not k.startswith("opt.")]
    assert weights and all(state[k] is before[k] for k in weights)  # the same arrays, new values
    assert all(not np.array_equal(state[k], start[k]) for k in weights)
    assert all(state[f"opt.m.{k}"] is before[f"opt.m.{k}"] for k in weights)


def test_read_only_state_arrays_are_replaced_not_written(gpt):
    script, compiled = gpt
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    state = plan.initial_state(0)
    frozen = {}
    for k, v in state.items():
        v.setflags(write=False)
        frozen[k] = v
    ref = {k: v.copy() for k, v in state.items()}
    _run(plan, script, compiled, 1, state)
    assert all(np.array_equal(frozen[k], ref[k]) for k in frozen)  # the caller's arrays are untouched
    assert any(state[k] is not frozen[k] for k in state)


def test_outputs_survive_the_next_step(tmp_path):
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(SMALL))
    compiled = compile_script(script, "[0]: dp=1", 1, optimizer=False)  # outputs every gradient
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    _, outs = _run(plan, script, compiled, 2)
    first = {k: v.copy() for k, v in outs[0].items()}
    _, again = _run(plan, script, compiled, 1)
    assert set(first) == set(outs[0])
    for k in first:
        assert np.array_equal(outs[0][k], first[k]), k  # not overwritten by the later steps
        assert np.array_equal(again[0][k], first[k]), k


def test_kernels_without_out_still_run(gpt, monkeypatch):
    """A dialect's kernels that return fresh arrays (or views of operands) need no out= support."""
    from hspmd.runtime import plan as plan_mod

    script, compiled = gpt

    def fresh_maker(op, rank):
        fn = numpy_ops.kernel_for(op, rank)
        if op.name == "graph.add":  # an unknown kernel may return a view of an operand
            return lambda a, b: (a + b)[...]
        return (lambda *a: fn(*a)) if accepts_out(fn) else fn

    monkeypatch.setitem(plan_mod.KERNELS, "graph", fresh_maker)
    slow = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    monkeypatch.undo()
    fast = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    assert any(kw for *_, kw, _ in fast.steps) and any(kw for *_, kw, _ in slow.steps)  # optim still takes out=
    s1, _ = _run(slow, script, compiled, 2)
    s2, _ = _run(fast, script, compiled, 2)
    assert all(s1[k].tobytes() == s2[k].tobytes() for k in s1)


def test_recursive_callee_is_refused():
    from hspmd.dialects.context import parse_module

    text = """
builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0">} {
  func.func @train_step() {
    %0 = graph.constant {value = 1.0 : f64} : tensor<2xf32>
    %1 = func.call @f(%0) : (tensor<2xf32>) -> tensor<2xf32>
    graph.output "y", %1 : tensor<2xf32>
    func.return
  }
  func.func private @f(%0: tensor<2xf32>) -> tensor<2xf32> {
    %1 = func.call @f(%0) : (tensor<2xf32>) -> tensor<2xf32>
    func.return %1 : tensor<2xf32>
  }
}
"""
    module = parse_module(text, "<test>")
    fn = next(op for op in module.walk() if getattr(op, "sym_name", None) is not None
              and op.sym_name.data == "train_step")
    with pytest.raises(PlanError, match="calls itself"):
        build_plan(fn, 0, InProcessCommunicator.create_world(1)[0])


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["tanh", "none"]), st.integers(1, 4), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_kernels_give_the_same_bits_with_and_without_out(approximate, rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    cases = [
        (lambda out=None: gelu_values(x, approximate, out), 1),
        (lambda out=None: gelu_grad_values(x, dy, approximate, out), 1),
        (lambda out=None: layer_norm_values(x, w, b, 1e-5, out), 1),
        (lambda out=None: layer_norm_grad_values(x, w, dy, 1e-5, out), 3),
        (lambda out=None: softmax_values(x, -1, out), 1),
        (lambda out=None: softmax_grad_values(softmax_values(x, -1), dy, -1, out), 1),
        (lambda out=None: matmul_values(x[None], w[:, None] * w[None, :], out), 1),
    ]
    for fn, n in cases:
        ref = fn()
        ref = ref if n > 1 else (ref,)
        out = tuple(np.full_like(r, np.nan) for r in ref)
        got = fn(out if n > 1 else out[0])
        got = got if n > 1 else (got,)
        assert all(g is o for g, o in zip(got, out))
        assert all(g.tobytes() == r.tobytes() for g, r in zip(got, ref))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(2, 9), st.integers(0, 2**31 - 1))
def test_in_place_kernels_match_the_textbook_formulas(rows, cols, seed):
    """The in-place kernels evaluate the same operations in the same order as the plain formulas."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    c, k = math.sqrt(2 / math.pi), 0.044715  # Python floats: no float64 upcast
    t = np.tanh(c * (x + k * (x * x * x)))
    assert gelu_values(x, "tanh").tobytes() == (0.5 * x * (1 + t)).tobytes()
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)
    assert gelu_grad_values(x, dy, "tanh").tobytes() == (dy * d).tobytes()
    xc = x - x.mean(-1, keepdims=True)
    ln = xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5) * w + b
    assert layer_norm_values(x, w, b, 1e-5).tobytes() == ln.tobytes()
    rstd = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5)
    xhat, g = xc * rstd, dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    got = layer_norm_grad_values(x, w, dy, 1e-5)
    assert [a.tobytes() for a in got] == [dx.tobytes(), (dy * xhat).sum(0).tobytes(), dy.sum(0).tobytes()]
    e = np.exp(x - x.max(-1, keepdims=True))
    sm = e / e.sum(-1, keepdims=True)
    assert softmax_values(x, -1).tobytes() == sm.tobytes()
    assert softmax_grad_values(sm, dy, -1).tobytes() == (sm * (dy - (dy * sm).sum(-1, keepdims=True))).tobytes()


def test_rows_by_blocks_on_threads_give_the_bits_of_one_call(monkeypatch):
    """Large row-wise kernels run by blocks of rows on threads: the same bits as one call."""
    from hspmd.runtime.cpu import rows as rows_mod

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(SMALL))
    compiled = compile_script(script, "[0]: dp=1", 1)
    comm = InProcessCommunicator.create_world(1)[0]
    single = build_plan(_step_fn(compiled.physical), 0, comm, threads=1)  # too small to be cut
    monkeypatch.setattr(rows_mod, "ROW_PARALLEL_BYTES", 1024)  # the small model's activations qualify
    monkeypatch.setattr(rows_mod, "ROW_BLOCK_ELEMENTS", 100)  # several blocks per thread
    threaded = build_plan(_step_fn(compiled.physical), 0, comm, threads=3)
    wrapped = [fn for fn, *_ in threaded.steps if hasattr(fn, "rows_of")]
    assert len(wrapped) > 10 and not any(hasattr(fn, "rows_of") for fn, *_ in single.steps)
    s1, o1 = _run(threaded, script, compiled, 2)
    s2, o2 = _run(single, script, compiled, 2)
    assert all(s1[k].tobytes() == s2[k].tobytes() for k in s1)
    assert [float(o["loss"]) for o in o1] == [float(o["loss"]) for o in o2]


def test_layer_norm_grad_into_strided_and_transposed_arrays():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5, 40)).astype(np.float32)
    dy = rng.standard_normal((6, 5, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    ref = layer_norm_grad_values(x, w, dy, 1e-5)
    xt, dyt = (np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2) for a in (x, dy))  # strided views
    got = layer_norm_grad_values(xt, w, dyt, 1e-5)
    strided = np.empty((5, 6, 40), np.float32).transpose(1, 0, 2)
    into = layer_norm_grad_values(x, w, dy, 1e-5, (strided, np.empty(40, np.float32), np.empty(40, np.float32)))
    assert into[0] is strided
    assert all(np.array_equal(a, c) for a, c in zip(ref, into))
    assert np.array_equal(ref[0], got[0])  # the sums over rows may add in another order for strided inputs
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(ref[1:], got[1:]))


def test_an_elementwise_chain_shares_one_buffer(gpt):
    """scale -> causal mask -> softmax of the attention scores write over one buffer."""
    script, compiled = gpt
    plan = build_plan(_step_fn(compiled.physical), 0, InProcessCommunicator.create_world(1)[0])
    made_by = {}
    shared = 0
    for fn, ins, outs, kw, _ in plan.steps:
        out = kw.get("out")
        if isinstance(out, np.ndarray) and ins and ins[0] in made_by:
            prev = made_by[ins[0]]
            shared += prev.ctypes.data == out.ctypes.data and prev.shape == out.shape
        if isinstance(out, np.ndarray) and len(outs) == 1:
            made_by[outs[0]] = out
    assert shared >= 3 * 2  # per layer: the bias add after a matmul, scale -> mask -> softmax, ...


@pytest.mark.parametrize("example, overrides, strategy, n", [
    ("gpt.py", SMALL, "[0,1]: tp=2", 2),
    ("llama.py", [], "[0]: dp=1", 1),
    ("mlp.py", [], "[0,1]: dp=2", 2),
])
def test_the_schedules_kernel_facts_agree_with_the_runtime_kernels(example, overrides, strategy, n):
    """The schedule decides out= buffers and in-place writes from static facts of each op
    (`kernel_facts`); every runtime kernel, per op and fused, must be what those facts say."""
    from hspmd.codegen import cpu_compile
    from hspmd.codegen.schedule.kernel_facts import out_facts
    from hspmd.runtime.plan import KERNELS, inplace_safe

    script = load_script(os.path.join(EXAMPLES, example), parse_overrides(overrides))
    compiled = compile_script(script, strategy, n)
    modules = [m for _, m in physical_groups(compiled.physical)]
    if cpu_compile.find_compiler() is not None:  # fused kernels run compiled (else NumPy per op)
        modules += [m for _, m in compiled.kernel_groups()]
    checked = set()
    leaves = {"graph.parameter", "graph.input", "graph.output", "graph.assign", "graph.constant", "kernel.yield",
              "graph.scan"}  # a scan is laid out by the schedule (its callee's ops are checked)
    for module in modules:
        for op in module.walk():
            if (op.dialect_name() not in KERNELS or op.name in leaves or op.parent_op() is None
                    or op.parent_op().name == "kernel.fused"):
                continue
            kernel = KERNELS[op.dialect_name()](op, 0)
            facts = out_facts(op)
            got = (accepts_out(kernel), inplace_safe(kernel), isinstance(kernel, np.ufunc))
            assert got == (facts.takes_out, facts.inplace_safe, facts.overwrites == "any"), op.name
            checked.add(op.name)
    assert len(checked) > 10
