"""Flash-style fused attention on the GPU runtime, without a GPU.

The kernels of `graph.flash_attention` and `graph.flash_attention_grad` (CUDA C built for the
CPU under `cuda_emu.h`, in the serial block emulation and with blocks of several emulated
threads) against their NumPy reference (float64) and against attention written out in NumPy
(the CPU's ops: scores, mask, softmax, the counter-based dropout, the product with v); the
`flash-attention` pass on the GPU programs of GPT (with dropout) and LLaMA: the chains it
replaces, the residuals that leave and join the scans, the CPU backend's losses on the emulated
device and the arena it saves; NVRTC compiles the kernels for sm_80 and sm_90.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from conftest import EXAMPLES, train_plan, train_step
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, bf16, f16, f32, i64
from xdsl.ir import Block, Region

from hspmd.codegen import cpu_compile
from hspmd.compiler import compile_script
from hspmd.dialects import kernel
from hspmd.dialects.graph.attention import FlashAttentionGradOp, FlashAttentionOp, tiles
from hspmd.dialects.graph.positions import dropout_key, dropout_uniform
from hspmd.frontend.script import load_script
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.kernel_exec import build_program, cpu_call, numpy_call
from hspmd.runtime.plan import build_plan
from hspmd.transforms.flash_attention import flash_attention_module

needs_compiler = pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="no C++ compiler")


def flash_module(lead, t, d, *, causal, rate, kt, seed=7, salt=3, heads_inside=False, dtype=f32):
    """Return a module of one function running the forward and the backward kernels (after
    `device-kernels`), and the two kernel.fused ops; `heads_inside`: the backward reads o as
    [B, T, H, D]; `dtype`: the element type of q, k, v, o, do (and dq, dk, dv), lse float32."""
    from hspmd.transforms.device_kernels import device_module

    qt = TensorType(dtype, [*lead, t, d])
    kty = TensorType(dtype, [*lead, d, t] if kt else [*lead, t, d])
    ot = TensorType(dtype, [lead[0], t, lead[1], d]) if heads_inside else qt
    types = [qt, kty, qt, ot, qt, TensorType(f32, [*lead, t])] + ([TensorType(i64, [])] if rate else [])
    block = Block(arg_types=types)
    q, k, v, o, do, lse, *step = block.args
    kw = {"scale": 1 / np.sqrt(d), "causal": causal, "k_transposed": kt, "rate": rate, "seed": seed, "salt": salt}
    fwd = FlashAttentionOp(q, k, v, step[0] if step else None, **kw)
    bwd = FlashAttentionGradOp(q, k, v, o, do, lse, step[0] if step else None, o_heads_inside=heads_inside, **kw)
    block.add_ops([fwd, bwd, func.ReturnOp(*fwd.results, *bwd.results)] if not heads_inside else
                  [bwd, func.ReturnOp(*bwd.results)])
    results = [*fwd.results, *bwd.results] if not heads_inside else list(bwd.results)
    if heads_inside:
        fwd.erase()
    fn = func.FuncOp("f", (types, [r.type for r in results]), Region(block))
    module = ModuleOp([fn])
    device_module(module)
    module.verify()
    return module, [op for op in module.walk() if isinstance(op, kernel.FusedOp)]


def written_out(q, k, v, do, *, causal, rate, step, seed=7, salt=3):
    """Attention as the CPU computes it op by op (float64): o and the gradients of q, k, v."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    t, d = q.shape[-2:]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if causal:
        s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    drop = np.ones_like(p)
    if rate:  # graph.dropout of the probabilities: its counters, the tensor's own indices
        index = np.arange(p.size, dtype=np.uint64).reshape(p.shape)
        drop = (dropout_uniform(dropout_key(seed, salt, step), index) >= rate) / (1 - rate)
    o = (p * drop) @ v
    dpd = do @ np.swapaxes(v, -1, -2)
    dv = np.swapaxes(p * drop, -1, -2) @ do
    dp = dpd * drop
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    return o, s, ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


CASES = [  # lead dims, T, D, causal, rate, k transposed
    ((2, 3), 37, 16, True, 0.0, False),
    ((2, 3), 37, 16, True, 0.1, False),
    ((1, 2), 70, 32, False, 0.0, True),
    ((1, 2), 70, 32, False, 0.2, False),
    ((2, 1), 83, 64, True, 0.1, True),
    ((1, 2), 64, 64, True, 0.0, False),
    ((1, 1), 40, 128, True, 0.1, False),
]


@needs_compiler
@pytest.mark.parametrize("lead,t,d,causal,rate,kt", CASES)
def test_the_kernels_give_attention_written_out(lead, t, d, causal, rate, kt):
    """Forward output, logsumexp and the three gradients, within float32 rounding of float64 NumPy."""
    rng = np.random.default_rng(t * d)
    q, k, v, do = (rng.standard_normal((*lead, t, d)).astype(np.float32) for _ in range(4))
    step = 5
    module, (fwd, bwd) = flash_module(lead, t, d, causal=causal, rate=rate, kt=kt)
    lib = cpu_compile.load_library(build_program(module))
    kin = np.ascontiguousarray(np.swapaxes(k, -1, -2)) if kt else k
    steps = [np.array(step, np.int64)] if rate else []
    o, lse = cpu_call(fwd, lib)(q, kin, v, *steps)
    dq, dk, dv = cpu_call(bwd, lib)(q, kin, v, o, do, lse, *steps)
    ro, s, rdq, rdk, rdv = written_out(q, k, v, do, causal=causal, rate=rate, step=step)
    m = s.max(-1)
    rlse = m + np.log(np.exp(s - m[..., None]).sum(-1))
    for name, got, want in (("o", o, ro), ("lse", lse, rlse), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert got.shape == want.shape and np.isfinite(got).all(), name
        assert _rel(got, want) < 2e-6, (name, _rel(got, want))
    # the ops' NumPy kernels (the reference the GPU tests use) say the same
    ref = numpy_call(fwd)(q, kin, v, *steps)
    np.testing.assert_allclose(ref[0], ro, rtol=1e-5, atol=1e-6)
    ref = numpy_call(bwd)(q, kin, v, o, do, lse, *steps)
    np.testing.assert_allclose(ref[1], rdk, rtol=1e-5, atol=1e-6)
    # deterministic: no atomics, sums in a fixed order
    again = cpu_call(bwd, lib)(q, kin, v, o, do, lse, *steps)
    assert all(np.array_equal(a, b) for a, b in zip(again, (dq, dk, dv)))


@needs_compiler
@pytest.mark.parametrize("d,rate,dtype", [(16, 0.1, "f32"), (32, 0.1, "bf16")])
def test_blocks_of_several_threads_give_the_same_numbers(d, rate, dtype):
    """The GPU's algorithm as written: barriers between the tiles, threads striding over them."""
    lead, t = (1, 2), 45
    rng = np.random.default_rng(d)
    npdt, ir_type = (SIXTEEN[dtype][0], IR_TYPES[dtype]) if dtype != "f32" else (np.float32, f32)
    q, k, v, do = (rng.standard_normal((*lead, t, d)).astype(npdt) for _ in range(4))
    module, (fwd, bwd) = flash_module(lead, t, d, causal=True, rate=rate, kt=False, dtype=ir_type)
    lib = cpu_compile.load_library(build_program(module, team=True))
    steps = [np.array(3, np.int64)] if rate else []
    one = cpu_call(fwd, lib)(q, k, v, *steps)
    four = cpu_call(fwd, lib, team=4)(q, k, v, *steps)
    for a, b in zip(one, four):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6, atol=1e-7)
    g1 = cpu_call(bwd, lib)(q, k, v, one[0], do, one[1], *steps)
    g4 = cpu_call(bwd, lib, team=4)(q, k, v, one[0], do, one[1], *steps)
    for a, b in zip(g1, g4):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6, atol=1e-7)


@needs_compiler
@pytest.mark.parametrize("heads_inside,dtype", [(False, "f32"), (True, "f32"), (True, "bf16"), (False, "f16")])
def test_the_kernels_follow_their_ops_numpy_kernels(heads_inside, dtype):
    """What tests/test_gpu_cuda.py checks of every kernel of a device program: the ops' NumPy
    kernels on the operands the ops sample (the backward's o and lse the forward's; o also as
    [B, T, H, D])."""
    from hspmd.runtime.kernel_exec import sample_operands

    ir_type, tol = (IR_TYPES[dtype], 2 * SIXTEEN[dtype][1]) if dtype != "f32" else (f32, 2e-5)
    module, ops = flash_module((2, 3), 21, 16, causal=True, rate=0.1, kt=True, heads_inside=heads_inside, dtype=ir_type)
    lib = cpu_compile.load_library(build_program(module))
    rng = np.random.default_rng(0)
    for op in ops:
        args = sample_operands(op, rng)
        for got, want in zip(cpu_call(op, lib)(*args), numpy_call(op)(*args)):
            assert got.dtype == want.dtype, op.kernel.data
            got, want = got.astype(np.float64), want.astype(np.float64)
            assert _rel(got, want) < tol, (op.kernel.data, _rel(got, want))


SIXTEEN = {"bf16": (ml_dtypes.bfloat16, 2.0**-8), "f16": (np.float16, 2.0**-11)}  # NumPy type, unit roundoff x 2
IR_TYPES = {"bf16": bf16, "f16": f16}


@needs_compiler
@pytest.mark.parametrize("dtype", sorted(SIXTEEN))
@pytest.mark.parametrize("lead,t,d,causal,rate,kt", CASES[1:5] + CASES[6:])
def test_the_16bit_kernels_give_attention_written_out(dtype, lead, t, d, causal, rate, kt):
    """q, k, v, do in bfloat16 (float16): o, dq, dk, dv (stored in it) within one rounding to it
    of attention in float64 of those inputs, the logsumexp (float32) within float32's."""
    npdt, eps = SIXTEEN[dtype]
    rng = np.random.default_rng(t * d)
    q, k, v, do = (rng.standard_normal((*lead, t, d)).astype(npdt) for _ in range(4))
    module, (fwd, bwd) = flash_module(lead, t, d, causal=causal, rate=rate, kt=kt, dtype=IR_TYPES[dtype])
    assert "hs_bf16" in fwd.source.data if dtype == "bf16" else "hs_half" in fwd.source.data
    lib = cpu_compile.load_library(build_program(module))
    kin = np.ascontiguousarray(np.swapaxes(k, -1, -2)) if kt else k
    steps = [np.array(5, np.int64)] if rate else []
    o, lse = cpu_call(fwd, lib)(q, kin, v, *steps)
    dq, dk, dv = cpu_call(bwd, lib)(q, kin, v, o, do, lse, *steps)
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == npdt and lse.dtype == np.float32
    ro, s, rdq, rdk, rdv = written_out(q, k, v, do, causal=causal, rate=rate, step=5)
    m = s.max(-1)
    assert _rel(lse, m + np.log(np.exp(s - m[..., None]).sum(-1))) < 2e-6
    for name, got, want in (("o", o, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        got = got.astype(np.float64)
        assert np.isfinite(got).all() and _rel(got, want) < 2 * eps, (name, _rel(got, want))
    # the ops' NumPy kernels take and give the 16-bit type too
    ref = numpy_call(bwd)(q, kin, v, o, do, lse, *steps)
    assert ref[1].dtype == npdt and _rel(ref[1].astype(np.float64), rdk) < 2 * eps


def test_the_tiles_fit_in_static_shared_memory():
    for d in (1, 16, 32, 64, 65, 96, 128):
        tiles(d)  # asserts the bytes of each kernel's tiles


def test_a_head_dim_over_128_has_no_flash_kernel():
    from hspmd.dialects.cuda_c import EmitError

    qt = TensorType(f32, [1, 1, 8, 160])
    block = Block(arg_types=[qt, qt, qt])
    op = FlashAttentionOp(*block.args, None, scale=0.1, causal=True)
    with pytest.raises(EmitError, match="head dim 160"):
        op.cuda_kernel("k")


def test_nvrtc_compiles_the_kernels_for_sm80_and_sm90():
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    ok, why = nvrtc_status()
    if not ok:
        pytest.skip(f"NVRTC is not available here: {why}")
    for d, rate, kt, dtype in ((128, 0.1, True, f32), (64, 0.0, False, f32), (128, 0.1, False, bf16), (64, 0.1, True, f16)):
        module, _ = flash_module((2, 2), 40, d, causal=True, rate=rate, kt=kt, dtype=dtype)
        sizes = check_module(module, ("sm_80", "sm_90"))
        assert set(sizes) == {"sm_80", "sm_90"} and all(n > 0 for n in sizes.values())


# ----------------------------------------------------------------------------- the pass on real programs

SMALL = {"model.layers": 2, "model.d_model": 32, "model.seq_len": 20, "data.batch_size": 4}
MODELS = {  # (script, overrides), and how many attentions the program has
    "gpt-dropout": ("gpt.py", {**SMALL, "model.dropout": 0.1}),
    "gpt-one-layer": ("gpt.py", {**SMALL, "model.layers": 1, "model.dropout": 0.1}),  # calls, not scans
    "llama": ("llama.py", {"model.layers": 2, "model.d_model": 32, "model.seq_len": 20, "data.batch_size": 4}),
    "moe": ("moe.py", {"model.seq_len": 20, "data.batch_size": 4}),
    # precision=bfloat16 (float16): the softmax and its gradient in float32 between casts
    "gpt-bf16": ("gpt.py", {**SMALL, "model.dropout": 0.1, "precision": "bfloat16"}),
    "gpt-f16": ("gpt.py", {**SMALL, "precision": "float16"}),
    "llama-bf16": ("llama.py", {"model.layers": 2, "model.d_model": 32, "model.seq_len": 20, "data.batch_size": 4,
                                "precision": "bfloat16"}),
}
ATTENTIONS = {"gpt-dropout": 1, "gpt-one-layer": 1, "llama": 1, "moe": 2, "gpt-bf16": 1, "gpt-f16": 1, "llama-bf16": 1}
FLOAT32_MODELS = ["gpt-dropout", "gpt-one-layer", "llama", "moe"]


@pytest.fixture(scope="module")
def programs():
    """Per model: (script, compiled, CPU kernel level, device program unfused, device program fused)."""
    from hspmd.compiler import device_level

    out = {}
    for name, (script_name, overrides) in MODELS.items():
        script = load_script(os.path.join(EXAMPLES, script_name), overrides)
        compiled = compile_script(script, "[0]: dp=1", 1)
        ((_, fused),) = compiled.kernel_groups()
        ((_, plain),) = device_level(compiled.kernel_groups(), flash=False)
        ((_, flash),) = device_level(compiled.kernel_groups(), flash=True)
        out[name] = (script, compiled, fused, plain, flash)
    return out


def _ops(module, name):
    return [op for op in module.walk() if op.name == name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_pass_replaces_attention_forward_and_backward(programs, name):
    *_, plain, flash = programs[name]
    flash.verify()
    n = ATTENTIONS[name]
    assert len(_ops(flash, "graph.flash_attention")) == n and len(_ops(flash, "graph.flash_attention_grad")) == n
    # no product or kernel of [.., T, T] is left: the scores are never written
    t = MODELS[name][1]["model.seq_len"]
    square = [op for op in flash.walk() if op.name in ("graph.matmul", "kernel.fused") and op.parent_op().name == "func.func"
              and any(tuple(r.type.get_shape()[-2:]) == (t, t) for r in op.results)]
    assert not square
    assert [op for op in plain.walk() if op.name == "graph.matmul" and tuple(op.results[0].type.get_shape()[-2:]) == (t, t)]
    # the residuals: the probabilities leave the layers' scans or calls, the logsumexp joins them
    callers = [op for op in train_step(flash).walk() if op.name in ("graph.scan", "func.call")
               and op.callee.root_reference.data.endswith("_fwd")]
    shapes = [tuple(r.type.get_shape()) for op in callers for r in op.results]
    assert callers and not [s for s in shapes if s[-2:] == (t, t)]
    b = MODELS[name][1]["data.batch_size"]
    assert [s for s in shapes if s[-3:] == (b, 4, t)], shapes  # lse [(layers,) B, H, T]
    # the kernels store the program's type: 16-bit q, k, v, o and gradients, a float32 logsumexp
    want = {"bfloat16": "bf16", "float16": "f16"}.get(MODELS[name][1].get("precision", ""), "f32")
    for op in _ops(flash, "graph.flash_attention"):
        assert [str(x.type.element_type) for x in (op.q, op.k, op.v, op.o, op.lse)] == [want] * 4 + ["f32"]
    for op in _ops(flash, "graph.flash_attention_grad"):
        assert {str(x.type.element_type) for x in (op.q, op.k, op.v, op.o, op.do, *op.results)} == {want}


def test_running_the_pass_twice_changes_nothing(programs):
    *_, flash = programs["gpt-dropout"]
    again = flash.clone()
    assert flash_attention_module(again) == 0
    assert str(again) == str(flash)


@needs_compiler
@pytest.mark.parametrize("name", ["gpt-dropout", "gpt-one-layer", "llama"])  # MoE's attention: as GPT's of one layer
def test_the_emulated_gpu_gives_the_cpu_backends_losses(programs, name):
    script, compiled, fused, _, flash = programs[name]
    (comm,) = InProcessCommunicator.create_world(1)
    ref, ref_params = train_plan(build_plan(train_step(fused), 0, comm), script, compiled, 3)
    got, params = train_plan(build_device_plan(train_step(flash), 0, EmulatedDevice()), script, compiled, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-5, err_msg=k)


@needs_compiler
def test_the_arena_shrinks(programs):
    """GPT with dropout: the arena without the [B, H, T, T] scores, probabilities and their gradients."""
    *_, plain, flash = programs["gpt-dropout"]
    before = build_device_plan(train_step(plain), 0, EmulatedDevice()).peak_bytes
    after = build_device_plan(train_step(flash), 0, EmulatedDevice()).peak_bytes
    b, h, t, d = SMALL["data.batch_size"], 4, SMALL["model.seq_len"], SMALL["model.d_model"] // 4
    square = b * h * t * t * 4  # one [B, H, T, T] float32 array
    added = b * h * t * (d + 1) * 4  # o and the logsumexp of one layer
    # the residuals p and pd of both layers leave, o and the logsumexp join
    assert after <= before - 2 * (2 * square - added), (before, after)


def test_a_head_dim_over_128_stays_on_the_unfused_path():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), {"model.layers": 1, "model.heads": 1, "model.d_model": 160,
                                                          "model.seq_len": 8, "data.batch_size": 2})
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, device),) = compiled.device_groups()
    assert not _ops(device, "graph.flash_attention") and not _ops(device, "graph.flash_attention_grad")
    assert [op for op in device.walk() if op.name == "graph.matmul" and tuple(op.results[0].type.get_shape()[-2:]) == (8, 8)]


def test_set_flash_attention_false_turns_the_pass_off():
    name, overrides = MODELS["llama"]
    off_script = load_script(os.path.join(EXAMPLES, name), {**overrides, "flash_attention": "false"})
    ((_, off),) = compile_script(off_script, "[0]: dp=1", 1).device_groups()
    ((_, on),) = compile_script(load_script(os.path.join(EXAMPLES, name), overrides), "[0]: dp=1", 1).device_groups()
    assert not _ops(off, "graph.flash_attention") and len(_ops(on, "graph.flash_attention")) == 1


# ----------------------------------------------------------------------------- on a GPU (marked gpu: skip here)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,t,d,causal,rate,kt", CASES + [((4, 8), 256, 64, True, 0.1, False)])
def test_the_kernels_on_a_gpu_give_attention_written_out(gpu, lead, t, d, causal, rate, kt):
    import cupy

    from hspmd.codegen.cupy_backend import kernel_for

    rng = np.random.default_rng(t * d)
    q, k, v, do = (rng.standard_normal((*lead, t, d)).astype(np.float32) for _ in range(4))
    _, (fwd, bwd) = flash_module(lead, t, d, causal=causal, rate=rate, kt=kt)
    kin = np.ascontiguousarray(np.swapaxes(k, -1, -2)) if kt else k
    steps = [np.array(5, np.int64)] if rate else []
    o, lse = kernel_for(fwd)(q, kin, v, *steps)
    dq, dk, dv = kernel_for(bwd)(q, kin, v, o, do, lse, *steps)
    ro, s, rdq, rdk, rdv = written_out(q, k, v, do, causal=causal, rate=rate, step=5)
    m = s.max(-1)
    rlse = m + np.log(np.exp(s - m[..., None]).sum(-1))
    for name, got, want in (("o", o, ro), ("lse", lse, rlse), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert _rel(cupy.asnumpy(got), want) < 1e-5, name
    again = kernel_for(bwd)(q, kin, v, o, do, lse, *steps)
    assert all(cupy.array_equal(a, b) for a, b in zip(again, (dq, dk, dv)))  # no atomics: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("name", FLOAT32_MODELS)
def test_a_gpu_step_with_flash_attention_gives_the_cpu_backends_losses(gpu, programs, name):
    script, compiled, fused, _, flash = programs[name]
    (comm,) = InProcessCommunicator.create_world(1)
    ref, _ = train_plan(build_plan(train_step(fused), 0, comm), script, compiled, 3)
    got, _ = train_plan(build_device_plan(train_step(flash), 0, gpu), script, compiled, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


# ----------------------------------------------------------------------------- the pass on written IR


def _attention_ir(causal: bool, rate: float, b: int = 3, t: int = 9, d: int = 8, bwd_drop: str = "",
                  dtype: str = "f32") -> str:
    """Attention forward and backward in one function, as autodiff writes it, with inputs and
    outputs; in a 16-bit `dtype` as a precision=bfloat16 (float16) program has it: the scores,
    their scale and mask in 16 bits, cast to float32 for the softmax and its gradient and back."""
    ty = f"tensor<{b}x{t}x{d}x{dtype}>"
    ss, kt = f"tensor<{b}x{t}x{t}x{dtype}>", f"tensor<{b}x{d}x{t}x{dtype}>"
    ss32 = f"tensor<{b}x{t}x{t}xf32>"
    wide = dtype != "f32"
    perm = "{perm = array<i64: 0, 2, 1>}"
    scale = repr(1 / float(np.sqrt(d)))
    drop = f"{{rate = {rate!r} : f64, seed = 5 : i64, salt = 2 : i64}}"
    whole = '#dist.layout<"[0]: dup=1">'
    lines = [f'%{x} = graph.input "{x}" {{global_type = {ty[:-1]}, {whole}>}} : {ty}' for x in ("q", "k", "v", "do")]
    lines += [f'%{x} = graph.input "{x}" {{global_type = tensor<i64, {whole}>}} : tensor<i64>' for x in ("step", "step2")]
    lines += [f"%kt = graph.transpose %k {perm} : ({ty}) -> {kt}",
              f"%s = graph.matmul %q, %kt : ({ty}, {kt}) -> {ss}",
              f"%ss = graph.scale %s {{factor = {scale} : f64}} : ({ss}) -> {ss}"]
    x = "ss"
    if causal:
        lines.append(f"%m = graph.causal_mask %ss {{value = 0xFFF0000000000000 : f64}} : ({ss}) -> {ss}")
        x = "m"
    if wide:  # the softmax computes in float32
        lines.append(f"%sf = graph.cast %{x} : ({ss}) -> {ss32}")
        x = "sf"
    lines.append(f"%p = graph.softmax %{x} {{dim = 2 : i64}} : ({ss32 if wide else ss}) -> {ss32 if wide else ss}")
    p16 = "p"
    if wide:
        lines.append(f"%p16 = graph.cast %p : ({ss32}) -> {ss}")
        p16 = "p16"
    pd, dp = ("pd", "dp") if rate else (p16, "dpd")
    if rate:
        lines.append(f"%pd = graph.dropout %{p16}, %step {drop} : ({ss}, tensor<i64>) -> {ss}")
    lines += [f"%o = graph.matmul %{pd}, %v : ({ss}, {ty}) -> {ty}",
              f"%vt = graph.transpose %v {perm} : ({ty}) -> {kt}",
              f"%dpd = graph.matmul %do, %vt : ({ty}, {kt}) -> {ss}",
              f"%pt = graph.transpose %{pd} {perm} : ({ss}) -> {ss}",
              f"%dv = graph.matmul %pt, %do : ({ss}, {ty}) -> {ty}"]
    if rate:  # `bwd_drop`: the backward's dropout is another one (another step, another salt)
        step2 = "%step2" if bwd_drop == "step" else "%step"
        drop2 = drop.replace("salt = 2", "salt = 3") if bwd_drop == "salt" else drop
        lines.append(f"%dp = graph.dropout %dpd, {step2} {drop2} : ({ss}, tensor<i64>) -> {ss}")
    if wide:
        lines.append(f"%dpf = graph.cast %{dp} : ({ss}) -> {ss32}")
        dp = "dpf"
    sg = ss32 if wide else ss
    lines.append(f"%{'dsf' if wide else 'ds'} = graph.softmax_grad %p, %{dp} {{dim = 2 : i64}} : ({sg}, {sg}) -> {sg}")
    if wide:
        lines.append(f"%ds = graph.cast %dsf : ({ss32}) -> {ss}")
    if causal:
        lines.append(f"%dm = graph.causal_mask %ds {{value = 0.000000e+00 : f64}} : ({ss}) -> {ss}")
    lines += [f"%dsc = graph.scale %{'dm' if causal else 'ds'} {{factor = {scale} : f64}} : ({ss}) -> {ss}",
              f"%ktt = graph.transpose %kt {perm} : ({kt}) -> {ty}",
              f"%dq = graph.matmul %dsc, %ktt : ({ss}, {ty}) -> {ty}",
              f"%qt = graph.transpose %q {perm} : ({ty}) -> {kt}",
              f"%dkt = graph.matmul %qt, %dsc : ({kt}, {ss}) -> {kt}",
              f"%dk = graph.transpose %dkt {perm} : ({kt}) -> {ty}"]
    lines += [f'graph.output "{x}", %{x} : {ty}' for x in ("o", "dq", "dk", "dv")]
    body = "\n    ".join(lines)
    return f"builtin.module {{\n  func.func @train_step() {{\n    {body}\n    func.return\n  }}\n}}\n"


@needs_compiler
@pytest.mark.parametrize("causal,rate", [(True, 0.0), (False, 0.0), (False, 0.25), (True, 0.25)])
def test_the_pass_keeps_the_programs_numbers(causal, rate):
    """Causal or not (an encoder's attention: the kernels with the mask off), with dropout or
    not: the program with the fused kernels gives the unfused program's values, on the CPU plan
    and on the emulated device."""
    from hspmd.compiler import run_passes
    from hspmd.dialects.context import parse_module

    plain = parse_module(_attention_ir(causal, rate))
    run_passes(plain, "fuse-kernels,device-kernels")
    flash = plain.clone()
    assert flash_attention_module(flash) == 1
    (op,) = _ops(flash, "graph.flash_attention")
    assert op.causal.value.data == int(causal) and op.rate.value.data == rate
    assert not [o for o in flash.walk() if o.name == "graph.matmul"]
    rng = np.random.default_rng(1)
    inputs = {x: rng.standard_normal((3, 9, 8)).astype(np.float32) for x in ("q", "k", "v", "do")}
    inputs["step"] = inputs["step2"] = np.array(4, np.int64)
    (comm,) = InProcessCommunicator.create_world(1)
    want = build_plan(train_step(plain), 0, comm).run({}, inputs)
    for plan in (build_plan(train_step(flash), 0, comm), build_device_plan(train_step(flash), 0, EmulatedDevice())):
        got = plan.run({}, inputs)
        for name in ("o", "dq", "dk", "dv"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("other", ["step", "salt"])
def test_a_backward_with_another_dropout_stays_unfused(other):
    from hspmd.compiler import run_passes
    from hspmd.dialects.context import parse_module

    module = parse_module(_attention_ir(True, 0.25, bwd_drop=other))
    run_passes(module, "fuse-kernels,device-kernels")
    assert flash_attention_module(module) == 0
    assert [o for o in module.walk() if o.name == "graph.matmul"]


@needs_compiler
@pytest.mark.parametrize("dtype", sorted(SIXTEEN))
@pytest.mark.parametrize("causal,rate", [(True, 0.0), (False, 0.25), (True, 0.25)])
def test_the_pass_keeps_a_16bit_programs_numbers(dtype, causal, rate):
    """A bfloat16 (float16) attention as a precision=bfloat16 program writes it: the fused
    kernels give the unfused chain's values within the 16-bit type's rounding, on the CPU plan
    and on the emulated device, and they are no further from attention in float64 (of the same
    16-bit inputs) than the chain, which rounds the scores, the probabilities and their
    gradients to 16 bits on the way; the fused kernels round once, where they store."""
    _check_16bit_program(dtype, causal, rate, (3, 21, 16), EmulatedDevice())


def _check_16bit_program(dtype, causal, rate, btd, device):
    """The checks of `test_the_pass_keeps_a_16bit_programs_numbers`, the device plans on `device`."""
    from hspmd.compiler import run_passes
    from hspmd.dialects.context import parse_module

    npdt, eps = SIXTEEN[dtype]
    b, t, d = btd
    plain = parse_module(_attention_ir(causal, rate, b, t, d, dtype=dtype))
    run_passes(plain, "fuse-kernels,device-kernels")
    flash = plain.clone()
    assert flash_attention_module(flash) == 1
    (op,) = _ops(flash, "graph.flash_attention")
    assert str(op.o.type.element_type) == dtype and str(op.lse.type.element_type) == "f32"
    assert not [o for o in flash.walk() if o.name == "graph.matmul"]
    rng = np.random.default_rng(2)
    inputs = {x: rng.standard_normal((b, t, d)).astype(npdt) for x in ("q", "k", "v", "do")}
    inputs["step"] = inputs["step2"] = np.array(4, np.int64)
    exact = dict(zip(("o", "s", "dq", "dk", "dv"), written_out(*(inputs[x] for x in ("q", "k", "v", "do")),
                                                              causal=causal, rate=rate, step=4, seed=5, salt=2)))
    (comm,) = InProcessCommunicator.create_world(1)
    chains = [build_plan(train_step(plain), 0, comm).run({}, inputs),
              build_device_plan(train_step(plain), 0, device).run({}, inputs)]
    for plan in (build_plan(train_step(flash), 0, comm), build_device_plan(train_step(flash), 0, device)):
        got = plan.run({}, inputs)
        for name in ("o", "dq", "dk", "dv"):
            g = np.asarray(got[name])
            assert g.dtype == npdt and np.isfinite(g.astype(np.float32)).all(), name
            g = g.astype(np.float64)
            for chain in chains:
                c = np.asarray(chain[name]).astype(np.float64)
                assert _rel(g, c) < 3 * eps, (name, _rel(g, c))
                assert _rel(g, exact[name]) <= max(_rel(c, exact[name]), 2 * eps), (name, _rel(g, exact[name]), _rel(c, exact[name]))
            assert _rel(g, exact[name]) < 2 * eps, (name, _rel(g, exact[name]))


@needs_compiler
@pytest.mark.parametrize("name", ["gpt-bf16", "gpt-f16", "llama-bf16"])
def test_a_16bit_emulated_run_gives_the_unfused_runs_losses(programs, name):
    """precision=bfloat16 (float16) on the emulated GPU: three steps with flash attention give the
    losses of the run with `flash_attention=false` and of the CPU backend (whose chain rounds the
    scores, probabilities and their gradients to 16 bits), and the gradients, as Adam's first
    moments hold them, within a few roundings of the 16-bit type (the two unfused runs are as
    far apart: cuBLAS-like GEMMs against NumPy's). The weights themselves are not compared:
    after three Adam steps from zero a bias whose gradient is rounding noise (k's, which the
    softmax does not see) is that noise's sign."""
    _check_16bit_run(programs[name], EmulatedDevice())


def _check_16bit_run(program, device):
    """The checks of `test_a_16bit_emulated_run_gives_the_unfused_runs_losses` on `device`."""
    script, compiled, fused, plain, flash = program
    eps = SIXTEEN["bf16" if script.config["precision"] == "bfloat16" else "f16"][1]
    (comm,) = InProcessCommunicator.create_world(1)
    cpu, cpu_state = train_plan(build_plan(train_step(fused), 0, comm), script, compiled, 3)
    off, off_state = train_plan(build_device_plan(train_step(plain), 0, device), script, compiled, 3)
    got, state = train_plan(build_device_plan(train_step(flash), 0, device), script, compiled, 3)
    for ref in (off, cpu):
        np.testing.assert_allclose(got, ref, rtol=eps / 8)
    moments = [k for k in state if k.startswith("opt.m.")]
    assert moments and any(".attn." in k for k in moments)
    for k in moments:
        for ref in (off_state, cpu_state):
            assert _rel(state[k].astype(np.float64), ref[k].astype(np.float64)) < 8 * eps, k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(SIXTEEN))
@pytest.mark.parametrize("causal,rate,btd", [(True, 0.1, (32, 256, 64)), (False, 0.0, (8, 130, 128))])
def test_the_16bit_kernels_on_a_gpu_keep_the_programs_numbers(gpu, dtype, causal, rate, btd):
    """`test_the_pass_keeps_a_16bit_programs_numbers` with the device plans on a GPU (its GEMMs
    for the unfused chain, NVRTC's build of the fused kernels), at the sizes of a real layer."""
    _check_16bit_program(dtype, causal, rate, btd, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt-bf16", "gpt-f16", "llama-bf16"])
def test_a_16bit_gpu_run_gives_the_unfused_runs_losses(gpu, programs, name):
    _check_16bit_run(programs[name], gpu)
