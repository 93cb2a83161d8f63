"""Precision on the GPU path: bfloat16 and float16 kernels and GEMMs, TF32 products.

On a GPU a 16-bit float is stored as such (`codegen/hs_float16.cuh`: `hs_bf16`, `hs_half`) and
computed in float: its conversions must round as ml_dtypes and NumPy do (to nearest even, NaN
quiet, overflow to infinity), which is checked here over every 16-bit pattern and the float32
edge cases; its elementwise chains are fused by `device-kernels` with each op's result rounded
where it is computed, so a chain gives the CPU's per-op NumPy numbers; its products are GEMMs
that accumulate in float32. Whole GPT, LLaMA and MoE steps in bfloat16 and float16 on the
emulated device follow the CPU backend's losses. `tf32=true` runs float32 products on TF32
tensor cores (emulated: operands rounded to 10 mantissa bits).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from conftest import EXAMPLES, run_cli, train_plan, train_step

import hspmd as hs
from hspmd.codegen import cpu_compile
from hspmd.codegen.nvrtc_check import check_module, nvrtc_status
from hspmd.compiler import compile_script
from hspmd.dialects.kernel import FusedOp
from hspmd.frontend.script import ScriptError, load_script, tf32
from hspmd.frontend.tracing import Tracer
from hspmd.runtime import kernel_exec
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.gemm import Gemm, numpy_gemm, round_to_tf32
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.plan import build_plan
from hspmd.transforms.device_kernels import device_module

pytestmark = pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="no C++ compiler: kernels cannot be built")

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16, "data.batch_size": 8}


def _device_kernels(build) -> list[FusedOp]:
    """Trace `build(tracer)`, run `device-kernels` on it, return its kernels."""
    t = Tracer()
    build(t)
    module = t.finish()
    device_module(module)
    return [op for op in module.walk() if isinstance(op, FusedOp)]


def _float32_edge_cases() -> np.ndarray:
    """float32 values around every rounding decision of bf16 and f16: ties, overflow, subnormals."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0, 2**16, dtype=np.uint32) << 16 | 0x8000,  # exact bf16 ties
        (np.arange(0, 2**16, dtype=np.uint32) << 16) | 0x7FFF,
        (np.arange(0, 2**16, dtype=np.uint32) << 16) | 0x8001,
    ])
    values = bits.view(np.float32)
    f16_ties = (np.arange(0, 2**16, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32) + 0x1000)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 65536.0, 1e-8, 2.0**-24,
                        2.0**-25, 3 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25, 3.4e38, 1e-40], np.float32)
    return np.concatenate([values, f16_ties.view(np.float32), special, -special])


@pytest.mark.parametrize("name, dtype", [("bfloat16", BF16), ("float16", np.dtype(np.float16))])
def test_conversions_round_as_numpy_over_every_pattern(name, dtype):
    """float32 -> 16 bits rounds to nearest even as ml_dtypes / NumPy (NaN stays NaN), and every
    one of the 65536 16-bit patterns reads back as the float NumPy gives."""
    x = _float32_edge_cases()
    (down,) = _device_kernels(lambda t: t.output("y", hs.cast(t.input("x", x.shape, "float32"), name)))
    got = kernel_exec.kernel_for(down)(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype)
    assert got.dtype == dtype
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got.astype(np.float32)) & np.isnan(x))
    assert same.all(), x[~same][:8]
    patterns = np.arange(2**16, dtype=np.uint16).view(dtype)
    (up,) = _device_kernels(lambda t: t.output("y", hs.cast(t.input("x", patterns.shape, name), "float32")))
    back = kernel_exec.kernel_for(up)(patterns)
    np.testing.assert_array_equal(back.view(np.uint32), patterns.astype(np.float32).view(np.uint32))


def test_a_bfloat16_chain_is_one_kernel_with_the_per_op_numbers():
    """gelu(x * w + b) in bfloat16 is one device kernel, each op rounded where it is computed: the
    bits of NumPy's op-by-op result (each op's value stored as bfloat16 between the ops)."""
    shape = (64, 96)
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(shape).astype(BF16) for _ in range(3))

    def build(t):
        x, w, bias = (t.input(n, shape, "bfloat16") for n in "xwb")
        t.output("y", hs.gelu(x * w + bias))

    kernels = _device_kernels(build)
    assert len(kernels) == 1 and kernels[0].source.data.count("hs_round_bf16") == 3
    got = kernel_exec.kernel_for(kernels[0])(a, b, c)
    want = kernel_exec.numpy_call(kernels[0])(a, b, c).astype(BF16)  # (NumPy's gelu of bf16 gives float32)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    if nvrtc_status()[0]:
        module = kernels[0].parent_op()
        while module.parent_op() is not None:
            module = module.parent_op()
        assert all(size > 0 for size in check_module(module).values())


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_a_16_bit_gemm_accumulates_in_float32(dtype):
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((3, 40, 24)).astype(dtype), rng.standard_normal((3, 24, 16)).astype(dtype)
    g = Gemm(False, False, 16, 40, 24, 16, 24, 16, 24 * 16, 40 * 24, 40 * 16, 3, 1, 0, dtype)
    c = np.zeros(3 * 40 * 16, dtype)
    numpy_gemm(g, y.reshape(-1), x.reshape(-1), c)
    want = (x.astype(np.float32) @ y.astype(np.float32)).astype(dtype)
    np.testing.assert_allclose(c.reshape(3, 40, 16).astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_tf32_rounds_operands_to_ten_mantissa_bits():
    x = np.array([1.0, 1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 2**-12, -(1.0 + 2**-11), np.inf, np.nan, 3.4e38], np.float32)
    r = round_to_tf32(x)
    np.testing.assert_array_equal(r[:5], [1.0, 1.0 + 2**-10, 1.0 + 2**-10, 1.0, -(1.0 + 2**-10)])
    assert np.isinf(r[5]) and np.isnan(r[6]) and np.isfinite(r[7])
    assert (r.view(np.uint32)[:5] & 0x1FFF == 0).all()


def _losses(script_name, overrides, steps=3, device=False, tf32_on=False):
    script = load_script(os.path.join(EXAMPLES, script_name), overrides)
    compiled = compile_script(script, "[0]: dp=1", 1)
    (comm,) = InProcessCommunicator.create_world(1)
    if device:
        ((_, module),) = compiled.device_groups()
        fn = train_step(module)
        plan = build_device_plan(fn, 0, EmulatedDevice(), tf32=tf32_on)
    else:
        ((_, module),) = compiled.kernel_groups()
        fn = train_step(module)
        plan = build_plan(fn, 0, comm)
    return np.array(train_plan(plan, script, compiled, steps)[0])


@pytest.mark.parametrize("script_name, overrides, precision", [
    ("gpt.py", {**SMALL, "model.dropout": 0.1}, "bfloat16"),
    ("llama.py", {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16}, "bfloat16"),
    ("moe.py", {}, "bfloat16"),
    ("gpt.py", SMALL, "float16"),
])
def test_16_bit_steps_on_the_emulated_gpu_follow_the_cpu(script_name, overrides, precision):
    """A 16-bit run as a CUDA plan gives the CPU backend's losses to within the format's rounding
    (the GPU's GEMMs round once, NumPy's per-op products too, but fused chains and float32
    accumulation in the reductions differ in the last bf16 bits), and float32's losses to within
    the precision's own error."""
    cfg = {**overrides, "precision": precision}
    cpu = _losses(script_name, cfg)
    gpu = _losses(script_name, cfg, device=True)
    full = _losses(script_name, overrides)
    assert np.isfinite(gpu).all()
    np.testing.assert_allclose(gpu, cpu, rtol=2e-3)
    np.testing.assert_allclose(gpu, full, rtol=2e-2)


@pytest.mark.skipif(not nvrtc_status()[0], reason="NVRTC is not installed")
@pytest.mark.parametrize("script_name, precision", [("gpt.py", "bfloat16"), ("llama.py", "float16")])
def test_nvrtc_compiles_every_16_bit_kernel_for_sm80_and_sm90(script_name, precision):
    script = load_script(os.path.join(EXAMPLES, script_name), {"precision": precision, "model.layers": 2})
    ((_, module),) = compile_script(script, "[0]: dp=1", 1).device_groups()
    assert "hs_bf16" in str(module) or "hs_half" in str(module)
    assert all(size > 0 for size in check_module(module).values())


def test_tf32_products_change_the_losses_by_tf32_rounding_only():
    fp32 = _losses("gpt.py", SMALL, device=True)
    tf = _losses("gpt.py", SMALL, device=True, tf32_on=True)
    assert not np.array_equal(fp32, tf)  # the operands were rounded
    np.testing.assert_allclose(tf, fp32, rtol=1e-3)


def test_the_tf32_key_takes_true_or_false_only():
    assert tf32({}) is False and tf32({"tf32": "true"}) is True and tf32({"tf32": False}) is False
    with pytest.raises(ScriptError, match="config tf32='maybe': expected true or false"):
        tf32({"tf32": "maybe"})
    r = run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "mlp.py"), "--steps", "1", "--set", "tf32=maybe")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["hspmd: error: config tf32='maybe': expected true or false"]


def test_run_device_cuda_bfloat16_on_the_emulated_gpu(tmp_path):
    env = {**os.environ, "HSPMD_EMULATE_GPU": "1"}
    log = tmp_path / "a.jsonl"
    r = run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "gpt.py"), "--device", "cuda", "--steps", "2",
                "--set", "precision=bfloat16", "--set", "tf32=true", "--log", str(log), env=env)
    assert r.returncode == 0, r.stderr
    assert "TF32" in r.stdout and len(log.read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- on a real GPU (marked gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_cublas_16_bit_products_on_the_gpu(gpu, dtype):
    """cublasGemmStridedBatchedEx on 16-bit operands, float32 accumulation: within one rounding
    of the operands' float32 product (the GPU's order of the sums differs from NumPy's)."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((3, 40, 24)).astype(dtype), rng.standard_normal((3, 24, 16)).astype(dtype)
    g = Gemm(False, False, 16, 40, 24, 16, 24, 16, 24 * 16, 40 * 24, 40 * 16, 3, 1, 0, dtype)
    pa, pb, pc = gpu.alloc(y.nbytes), gpu.alloc(x.nbytes), gpu.alloc(3 * 40 * 16 * 2)
    gpu.upload(pa, y)
    gpu.upload(pb, x)
    gpu.prepare_gemm(g, pa, pb, pc)()
    got = gpu.download(pc, (3, 40, 16), dtype).astype(np.float32)
    want = (x.astype(np.float32) @ y.astype(np.float32)).astype(dtype).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_bfloat16_and_tf32_steps_on_the_gpu(gpu):
    """GPT in bfloat16 on the GPU follows the CPU's bfloat16 losses; TF32 products follow float32's."""
    cfg = {**SMALL, "precision": "bfloat16"}
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), cfg)
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, module),) = compiled.device_groups()
    fn = train_step(module)
    got = np.array(train_plan(build_device_plan(fn, 0, gpu), script, compiled, 3)[0])
    np.testing.assert_allclose(got, _losses("gpt.py", cfg), rtol=2e-3)
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), SMALL)
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, module),) = compiled.device_groups()
    fn = train_step(module)
    got = np.array(train_plan(build_device_plan(fn, 0, gpu, tf32=True), script, compiled, 3)[0])
    np.testing.assert_allclose(got, _losses("gpt.py", SMALL), rtol=2e-3)
