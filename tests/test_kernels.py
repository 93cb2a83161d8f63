"""Fused kernels on the CPU against NumPy per op: every kernel kind, f32 and f64, shapes drawn
by hypothesis; the row kernels also with blockDim > 1 (OpenMP teams, barriers, shuffles).

Each case is a function of `graph`/`optim` ops; `fuse-kernels` turns it into `kernel.fused`
ops; the compiled CPU kernel and the op's body run by hspmd's NumPy kernels must agree
within the documented tolerance (docs/kernels.md). Kernel sources do not depend on the row
count or length, so the shapes hypothesis draws reuse the compiled library cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.codegen.cpu_compile import find_compiler, load_library
from hspmd.dialects.context import parse_module
from hspmd.runtime.kernel_exec import build_program, cpu_call, fused_ops, numpy_call, program_library
from hspmd.transforms.fuse_kernels import fuse_module

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="needs a C++ compiler (the fallback is tested apart)")

TOL = {"f32": dict(rtol=3e-5, atol=3e-6), "f64": dict(rtol=1e-11, atol=1e-12)}
NP = {"f32": np.float32, "f64": np.float64}
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def T(shape, dt: str) -> str:
    """Return the IR tensor type of `shape` and element type `dt`."""
    return f"tensor<{'x'.join(map(str, shape))}{'x' if shape else ''}{dt}>"


def fuse(body: str) -> tuple:
    """Return (module, its kernel.fused ops) of a module holding function text `body`."""
    module = parse_module("builtin.module {\n" + body + "\n}")
    fuse_module(module)
    return module, fused_ops(module)


def compare(module, op, args, dtype: str, team: int = 1) -> None:
    lib = program_library(module) if team == 1 else load_library(build_program(module, team=True))
    assert lib is not None
    with np.errstate(all="ignore"):
        ref = numpy_call(op)(*args)
    got = cpu_call(op, lib, team)(*args)
    ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
    assert len(ref) == len(got)
    # absolute tolerance relative to the magnitudes in play (cancellation, FMA contraction)
    scale = max([1.0] + [_finite_max(a) for a in args if a.dtype.kind == "f"])
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        scale = max(scale, _finite_max(r))
        tol = TOL[dtype]
        np.testing.assert_allclose(g, r, rtol=tol["rtol"], atol=tol["atol"] * scale, equal_nan=True)


def _finite_max(a: np.ndarray) -> float:
    a = np.abs(a[np.isfinite(a)])
    return float(a.max()) if a.size else 0.0


shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
dtypes = st.sampled_from(["f32", "f64"])


# ----------------------------------------------------------------------------- elementwise


def chain_text(shape, dt: str) -> str:
    t = T(shape, dt)
    u = lambda name, x, attrs="": f"graph.{name} {x}{attrs} : ({t}) -> {t}"  # noqa: E731
    b = lambda name, x, y, attrs="": f"graph.{name} {x}, {y}{attrs} : ({t}, {t}) -> {t}"  # noqa: E731
    none, tanh = ' {approximate = "none"}', ' {approximate = "tanh"}'
    lines = [
        f"%1 = {u('tanh', '%x')}",
        f"%2 = {b('sub', '%1', '%y')}",
        f"%3 = {b('mul', '%2', '%y')}",
        f"%4 = {u('scale', '%3', ' {factor = 0.5 : f64}')}",
        f"%5 = {u('exp', '%4')}",
        f"%6 = {u('log', '%5')}",
        f"%7 = {u('sqrt', '%5')}",
        f"%8 = {u('rsqrt', '%5')}",
        f"%9 = {b('div', '%7', '%8')}",
        f"%10 = {u('relu', '%2')}",
        f"%11 = {b('relu_grad', '%2', '%9')}",
        f"%12 = {u('silu', '%3')}",
        f"%13 = {b('silu_grad', '%3', '%11')}",
        f"%14 = {u('gelu', '%4', none)}",
        f"%15 = {u('gelu', '%4', tanh)}",
        f"%16 = {b('gelu_grad', '%4', '%13', none)}",
        f"%17 = {b('gelu_grad', '%4', '%16', tanh)}",
        f"%18 = {b('tanh_grad', '%1', '%17')}",
        f"%19 = {u('pow', '%5', ' {exponent = 2.0 : f64}')}",
        f"%20 = {u('pow', '%5', ' {exponent = 3.0 : f64}')}",
        f"%21 = {u('pow', '%5', ' {exponent = 0.5 : f64}')}",
        f"%22 = {b('pow_grad', '%5', '%18', ' {exponent = 3.0 : f64}')}",
        f"%23 = {b('pow_grad', '%5', '%22', ' {exponent = 1.0 : f64}')}",
        f"%24 = {b('add', '%23', '%6')}",
        f"%25 = {u('tanh', '%24')}",
    ]
    outs = ["%10", "%12", "%14", "%15", "%19", "%20", "%21", "%25"]
    return (
        f"func.func @f(%x: {t}, %y: {t}) -> ({', '.join([t] * len(outs))}) {{\n  "
        + "\n  ".join(lines)
        + f"\n  func.return {', '.join(outs)} : {', '.join([t] * len(outs))}\n}}"
    )


@SETTINGS
@given(shape=shapes, dt=dtypes, seed=st.integers(0, 2**16))
def test_an_elementwise_chain_of_every_op_is_one_kernel_and_matches_numpy(shape, dt, seed):
    module, ops = fuse(chain_text(shape, dt))
    assert len(ops) == 1 and len(ops[0].outputs) == 8
    assert not [o for o in module.walk() if o.name.startswith("graph.") and o.parent_op() is not ops[0]]
    rng = np.random.default_rng(seed)
    args = [(rng.standard_normal(shape) * 3).astype(NP[dt]) for _ in range(2)]
    compare(module, ops[0], args, dt)


def test_special_values_propagate_like_numpy():
    module, (op,) = fuse(chain_text((12,), "f32"))
    x = np.array([0, -0.0, 1e-30, -1e-30, 50, -50, 90, -110, np.inf, -np.inf, np.nan, 3], np.float32)
    compare(module, op, [x, x[::-1].copy()], "f32")


BCASTS = [
    # (input shape, dims, result shape)
    ((7,), (1,), (5, 7)),
    ((6, 7), (1, 2), (3, 6, 7)),
    ((1, 7), (0, 1), (4, 7)),
    ((5,), (0,), (5, 3)),
    ((), (), (4, 3)),
    ((4, 1), (0, 2), (4, 3, 2)),
]


@pytest.mark.parametrize("src,dims,dst", BCASTS)
def test_broadcast_operands_are_read_in_place(src, dims, dst):
    d = "f32"
    text = f"""func.func @f(%x: {T(dst, d)}, %b: {T(src, d)}) -> {T(dst, d)} {{
  %bb = graph.broadcast %b {{dims = array<i64{': ' if dims else ''}{', '.join(map(str, dims))}>}} : ({T(src, d)}) -> {T(dst, d)}
  %s = graph.add %x, %bb : ({T(dst, d)}, {T(dst, d)}) -> {T(dst, d)}
  %g = graph.gelu %s {{approximate = "tanh"}} : ({T(dst, d)}) -> {T(dst, d)}
  func.return %g : {T(dst, d)}
}}"""
    module, (op,) = fuse(text)
    assert [o.name for o in op.body.block.ops] == ["graph.broadcast", "graph.add", "graph.gelu", "kernel.yield"]
    assert not any(o.name == "graph.broadcast" for o in module.walk() if o.parent_op() is not op)
    rng = np.random.default_rng(1)
    compare(module, op, [rng.standard_normal(dst).astype(np.float32), rng.standard_normal(src).astype(np.float32)], d)


@SETTINGS
@given(b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 20), dt=dtypes)
def test_attention_scores_scale_mask_softmax_and_back(b, h, t, dt):
    s = T((b, h, t, t), dt)
    text = f"""func.func @f(%x: {s}, %dy: {s}) -> ({s}, {s}) {{
  %1 = graph.scale %x {{factor = 0.35355339059327373 : f64}} : ({s}) -> {s}
  %2 = graph.causal_mask %1 {{value = 0xFFF0000000000000 : f64}} : ({s}) -> {s}
  %3 = graph.softmax %2 {{dim = 3 : i64}} : ({s}) -> {s}
  %4 = graph.softmax_grad %3, %dy {{dim = 3 : i64}} : ({s}, {s}) -> {s}
  %5 = graph.causal_mask %4 {{value = 0.0 : f64}} : ({s}) -> {s}
  %6 = graph.scale %5 {{factor = 0.35355339059327373 : f64}} : ({s}) -> {s}
  func.return %3, %6 : {s}, {s}
}}"""
    module, ops = fuse(text)
    # scale + mask + softmax (the chain is the softmax kernel's prologue), softmax grad, mask + scale
    assert len(ops) == 3
    assert [o.name for o in ops[0].body.block.ops] == ["graph.scale", "graph.causal_mask", "graph.softmax", "kernel.yield"]
    rng = np.random.default_rng(t)
    x, dy = (rng.standard_normal((b, h, t, t)).astype(NP[dt]) for _ in range(2))
    env = {"x": x, "dy": dy}
    # run the fused program in order, checking each kernel on the values NumPy gives it
    values = {a: env[n] for a, n in zip(module.body.block.ops.first.body.block.args, ("x", "dy"))}
    for op in ops:
        args = [values[v] for v in op.inputs]
        compare(module, op, args, dt)
        res = numpy_call(op)(*args)
        for r, v in zip(res if isinstance(res, tuple) else (res,), op.outputs):
            values[v] = r


def test_adam_adamw_sgd_and_clip_scaling_match_the_optimizer_kernels():
    t, s = T((33, 5), "f32"), T((), "f64")
    text = f"""func.func @f(%p: {t}, %g: {t}, %m: {t}, %v: {t}, %lr: {s}, %bc1: {s}, %bc2: {s}, %c: {s}, %buf: {t}) -> ({t}, {t}, {t}, {t}, {t}, {t}, {t}, {t}) {{
  %g1 = optim.mul_scalar %g, %c : ({t}, {s}) -> {t}
  %p1, %m1, %v1 = optim.adam %p, %g1, %m, %v, %lr, %bc1, %bc2 {{beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-08 : f64, weight_decay = 0.1 : f64, decoupled = true}} : ({t}, {t}, {t}, {t}, {s}, {s}, {s}) -> ({t}, {t}, {t})
  %p2, %m2, %v2 = optim.adam %p, %g, %m, %v, %lr, %bc1, %bc2 {{beta1 = 0.8 : f64, beta2 = 0.99 : f64, eps = 1.0e-06 : f64, weight_decay = 0.01 : f64, decoupled = false}} : ({t}, {t}, {t}, {t}, {s}, {s}, {s}) -> ({t}, {t}, {t})
  %p3, %b3 = optim.sgd %p, %g, %buf, %lr {{momentum = 0.9 : f64, weight_decay = 0.01 : f64, nesterov = true}} : ({t}, {t}, {t}, {s}) -> ({t}, {t})
  func.return %p1, %m1, %v1, %p2, %m2, %v2, %p3, %b3 : {t}, {t}, {t}, {t}, {t}, {t}, {t}, {t}
}}"""
    module, ops = fuse(text)
    assert [o.kernel.data.split("_", 1)[1] for o in ops] == ["mul_scalar_adam", "adam", "sgd"]
    rng = np.random.default_rng(2)
    p, g, m, buf = (rng.standard_normal((33, 5)).astype(np.float32) for _ in range(4))
    v = np.abs(rng.standard_normal((33, 5))).astype(np.float32)
    env = dict(p=p, g=g, m=m, v=v, buf=buf, lr=np.array(1e-2), bc1=np.array(0.19), bc2=np.array(0.0199),
               c=np.array(0.7))
    names = ("p", "g", "m", "v", "lr", "bc1", "bc2", "c", "buf")
    args_of = dict(zip(module.body.block.ops.first.body.block.args, names))
    for op in ops:
        compare(module, op, [env[args_of[a]] for a in op.inputs], "f32")


# ----------------------------------------------------------------------------- rows

ROWS = {
    "softmax": ("graph.softmax %x {dim = LAST : i64} : (X) -> X", "X"),
    "softmax_grad": ("graph.softmax_grad %x, %dy {dim = LAST : i64} : (X, X) -> X", "X"),
    "layer_norm": ("graph.layer_norm %x, %w, %b {eps = 1.0e-05 : f64} : (X, W, W) -> X", "X"),
    "layer_norm_grad": ("graph.layer_norm_grad %x, %w, %dy {eps = 1.0e-05 : f64} : (X, W, X) -> (X, W, W)", "X, W, W"),
    "rms_norm": ("graph.rms_norm %x, %w {eps = 1.0e-06 : f64} : (X, W) -> X", "X"),
    "rms_norm_grad": ("graph.rms_norm_grad %x, %w, %dy {eps = 1.0e-06 : f64} : (X, W, X) -> (X, W)", "X, W"),
    "xent": ("graph.softmax_cross_entropy %x, %lab : (X, L) -> R", "R"),
    "xent_ignore": ("graph.softmax_cross_entropy %x, %lab {ignore_index = -100 : i64} : (X, L) -> R", "R"),
    "xent_grad": ("graph.softmax_cross_entropy_grad %x, %lab, %dl : (X, L, R) -> X", "X"),
    "xent_grad_ignore": ("graph.softmax_cross_entropy_grad %x, %lab, %dl {ignore_index = -100 : i64} : (X, L, R) -> X", "X"),
}


def row_case(kind: str, shape, dt: str, label_type: str = "i32", prologue: bool = False):
    """Return (module, the op, its arguments) of row op `kind` on `shape`; with `prologue`,
    its first operand is computed by a chain (tanh, then an added broadcast row) first."""
    op_text, result = ROWS[kind]
    names = [n for n in ("x", "dy", "w", "b", "lab", "dl") if f"%{n}" in op_text]
    if prologue:
        op_text = op_text.replace("%x", "%px", 1)
    X, W, R, L = T(shape, dt), T(shape[-1:], dt), T(shape[:-1], dt), T(shape[:-1], label_type)
    sub = lambda s: s.replace("LAST", str(len(shape) - 1)).replace("X", X).replace("W", W).replace("R", R).replace("L", L)  # noqa: E731
    types = {"x": X, "dy": X, "w": W, "b": W, "lab": L, "dl": R}
    res = sub(result)
    nres = res.count("tensor<")
    outs = ", ".join(f"%r#{i}" for i in range(nres)) if nres > 1 else "%r"
    chain = ""
    if prologue:
        names.append("pb")
        types["pb"] = W
        chain = (f"  %t = graph.tanh %x : ({X}) -> {X}\n"
                 f"  %bb = graph.broadcast %pb {{dims = array<i64: {len(shape) - 1}>}} : ({W}) -> {X}\n"
                 f"  %px = graph.add %t, %bb : ({X}, {X}) -> {X}\n")
    text = (f"func.func @f({', '.join(f'%{n}: {types[n]}' for n in names)}) -> ({res}) {{\n{chain}"
            f"  %r{':' + str(nres) if nres > 1 else ''} = {sub(op_text)}\n  func.return {outs} : {res}\n}}")
    module, ops = fuse(text)
    assert len(ops) == 1, text
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    args = []
    for n in names:
        s = shape[-1:] if n in ("w", "b", "pb") else shape[:-1] if n in ("lab", "dl") else shape
        if n == "lab":
            lab = rng.integers(0, shape[-1], s)
            if kind.endswith("ignore"):
                lab = np.where(rng.random(s) < 0.3, -100, lab)
            args.append(lab.astype(np.int32 if label_type == "i32" else np.int64))
        else:
            a = rng.standard_normal(s) * 2
            args.append((np.exp(a) / np.exp(a).sum(-1, keepdims=True) if n == "x" and "softmax_grad" in kind
                         else a).astype(NP[dt]))
    fn_args = list(module.body.block.ops.first.body.block.args)
    return module, ops[0], [args[fn_args.index(v)] for v in ops[0].inputs]


@SETTINGS
@given(kind=st.sampled_from(sorted(ROWS)), lead=st.lists(st.integers(1, 9), max_size=2),
       cols=st.integers(1, 70), dt=dtypes)
def test_row_kernels_match_numpy(kind, lead, cols, dt):
    module, op, args = row_case(kind, (*lead, cols), dt)
    compare(module, op, args, dt)


@pytest.mark.parametrize("team", [1, 8])
@pytest.mark.parametrize("kind", ["softmax", "layer_norm", "rms_norm", "xent", "xent_ignore", "xent_grad"])
def test_a_chain_feeding_a_row_kernel_becomes_its_prologue(kind, team):
    module, op, args = row_case(kind, (5, 3, 37), "f64", "i64", prologue=True)
    names = [o.name for o in op.body.block.ops]
    assert sorted(names[:3]) == ["graph.add", "graph.broadcast", "graph.tanh"] and len(names) == 5
    assert "_x(" in op.source.data  # the row kernel reads its operand through the prologue
    compare(module, op, args, "f64", team=team)


@pytest.mark.parametrize("team", [4, 40])
@pytest.mark.parametrize("kind", sorted(ROWS))
def test_row_kernels_with_many_threads_per_block(kind, team):
    """blockDim > 1: a team of OpenMP threads per block, with barriers, shared memory and
    emulated warp shuffles (40 threads: a full warp and a partial one)."""
    module, op, args = row_case(kind, (3, 2, 67), "f64", "i64")
    compare(module, op, args, "f64", team=team)


def test_elementwise_rows_with_many_threads_per_block():
    module, (op,) = fuse(f"""func.func @f(%x: {T((6, 50), 'f32')}, %b: {T((50,), 'f32')}) -> {T((6, 50), 'f32')} {{
  %bb = graph.broadcast %b {{dims = array<i64: 1>}} : ({T((50,), 'f32')}) -> {T((6, 50), 'f32')}
  %s = graph.mul %x, %bb : ({T((6, 50), 'f32')}, {T((6, 50), 'f32')}) -> {T((6, 50), 'f32')}
  func.return %s : {T((6, 50), 'f32')}
}}""")
    rng = np.random.default_rng(3)
    compare(module, op, [rng.standard_normal((6, 50)).astype(np.float32), rng.standard_normal(50).astype(np.float32)],
            "f32", team=33)


def test_out_arrays_are_filled_and_may_alias_an_elementwise_operand():
    module, ops = fuse(chain_text((9,), "f64"))
    (op,) = ops
    lib = program_library(module)
    call = cpu_call(op, lib)
    assert call.accepts_out and call.inplace_safe
    x, y = np.linspace(-2, 2, 9), np.linspace(1, 3, 9)
    want = call(x, y)
    outs = tuple(np.empty(9) for _ in want)
    got = call(x, y, out=outs)
    assert all(g is o for g, o in zip(got, outs))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    x2 = x.copy()
    got = call(x2, y, out=(x2, *outs[1:]))  # the first result written over the operand itself
    np.testing.assert_array_equal(x2, want[0])


def test_loading_kernels_sets_a_passive_wait_policy_and_leaves_omp_dynamic_alone():
    """Loading a kernel library defaults OMP_WAIT_POLICY to passive and does not touch
    OMP_DYNAMIC: OMP_DYNAMIC=true in the environment made a PyTorch loaded later in the same
    process run its operators on fewer threads (docs/kernels.md). Explicit settings stay."""
    script = (
        "import os, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "from tests.test_kernels import chain_text, fuse\n"
        "from hspmd.runtime.kernel_exec import program_library\n"
        "module, _ = fuse(chain_text((9,), 'f64'))\n"
        "assert program_library(module) is not None\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('OMP_DYNAMIC'))\n"
    )
    root = Path(__file__).resolve().parents[1]
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_DYNAMIC")}
    for extra, want in (({}, "passive None"), ({"OMP_WAIT_POLICY": "active", "OMP_DYNAMIC": "false"}, "active false")):
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, env={**base, **extra}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.splitlines()[-1] == want


def test_pointers_are_reused_only_for_the_same_arrays():
    """A call reuses the pointers of the arrays it was given last time only for the very same
    objects: new arrays in their place (or the old ones freed and their memory reused), other
    values in the same arrays and other scalars all give the results of a fresh call."""
    module, ops = fuse(chain_text((9,), "f64"))
    (op,) = ops
    call = cpu_call(op, program_library(module))
    fresh = cpu_call(op, program_library(module))
    x, y = np.linspace(-2, 2, 9), np.linspace(1, 3, 9)
    outs = tuple(np.empty(9) for _ in fresh(x, y))
    for step in range(4):
        if step == 1:
            x[:] = x[::-1]  # the same array, other values
        elif step == 2:
            x = np.linspace(0, 1, 9)  # another array; the old one is freed
        elif step == 3:
            outs = tuple(np.empty(9) for _ in outs)
        got = call(x, y, out=outs)
        for g, w in zip(got, fresh(x, y)):
            np.testing.assert_array_equal(g, w)


def test_a_wrong_operand_shape_is_a_clear_error():
    module, (op,) = fuse(chain_text((9,), "f64"))
    call = cpu_call(op, program_library(module))
    with pytest.raises(ValueError, match="compiled for"):
        call(np.zeros(8), np.zeros(9))
    with pytest.raises(ValueError, match="team=True"):
        cpu_call(op, program_library(module), team=4)


@pytest.mark.parametrize("kind", ["xent", "xent_grad"])
def test_a_label_out_of_range_gives_nan_rows_where_numpy_raises(kind):
    module, op, args = row_case(kind, (3, 5), "f32")
    labels = next(a for a in args if a.dtype.kind == "i")
    labels[1] = 5
    got = cpu_call(op, program_library(module))(*args)
    assert np.isnan(got[1]).all() and np.isfinite(np.delete(got, 1, axis=0)).all()
    with pytest.raises(IndexError):
        numpy_call(op)(*args)
