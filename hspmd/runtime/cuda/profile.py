"""A GPU rank's compute rates for the device profile (`hspmd profile -n 1 --device cuda`).

The same three rates as a CPU rank's (`runtime/profiler.py`), measured on the rank's device
through the plan's own device interface, so that the cost model prices a GPU rank's step as
its plan runs it:

* **matmul**: the plan's GEMMs (cuBLAS through its C API, float32, TF32 off) at the CPU's
  shapes, where a GPU is far from its peak, and at larger ones (1024^3 to 4096^3), where it
  reaches it; a stack of products is one strided-batched GEMM, as attention's are;
* **elementwise**: the device kernel of `graph.exp` over 16 Mi float32 (8 bytes moved per
  element), made by `device-kernels` as a GPU run makes it;
* **fused**: the device's softmax row kernel (what `fuse-kernels` emits for `graph.softmax`)
  over rows of 256 of 16 Mi float32.

Each rate is timed as a batch of calls between two synchronisations (a GPU queues its work:
one call's time is its share of the batch), the median of 5 windows. The emulated device
(`HSPMD_EMULATE_GPU=1`, tests only) measures the same way, at its own (CPU) rates.
"""

from __future__ import annotations

import time

import numpy as np

from hspmd.ir.device_profile import MatmulPoint, RankRates
from hspmd.runtime.cuda.device import Call, Device
from hspmd.runtime.cuda.gemm import Gemm

#: (m, k, n), or (p, m, k, n) for a stack of p products: the CPU profile's shapes and larger ones
GPU_MATMUL_SHAPES = ((64, 64, 32, 64), (64, 64, 64), (128, 256, 256), (256, 512, 512), (512, 512, 1024),
                     (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096))
#: the elements of the elementwise and row-kernel test arrays, and the rows' length
GPU_ELEMENTWISE_SIZE = 1 << 24
ROW = 256


def _rowmajor_gemm(m: int, k: int, n: int, batch: int) -> Gemm:
    """The GEMM of row-major `C[m, n] = X[m, k] Y[k, n]`, `batch` times (A is Y, B is X)."""
    return Gemm(False, False, n, m, k, n, k, n, k * n, m * k, m * n, batch, 1, 0, np.dtype(np.float32))


def _timed_calls(device: Device, call: Call, seconds: float, windows: int = 5) -> float:
    """Return the seconds of one `call`: batches of calls between synchronisations, the batch
    grown until it lasts about `seconds / windows`, the median window's mean."""
    call()
    device.synchronize()
    per_window = seconds / windows
    batch, means = 1, []
    while len(means) < windows:
        start = time.perf_counter()
        for _ in range(batch):
            call()
        device.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed < per_window / 4 and batch < 1 << 16:  # too short to time: more calls a window
            batch *= 4
            continue
        means.append(elapsed / batch)
    return sorted(means)[len(means) // 2]


def _kernel_calls(device: Device, size: int) -> tuple[Call, Call, int]:
    """Return (the exp kernel's call, the softmax kernel's call, bytes each moves) on arrays of
    `size` float32 elements in `device`'s memory, made as a GPU program makes them."""
    from xdsl.dialects.builtin import ModuleOp, TensorType, f32
    from xdsl.ir import Block

    from hspmd.codegen.emit_cuda import emit_elementwise, emit_row
    from hspmd.dialects import graph, kernel

    typ = TensorType(f32, [size // ROW, ROW])
    block = Block(arg_types=[typ])
    x = block.args[0]
    e, s = graph.ExpOp(x), graph.SoftmaxOp(x, 1)
    block.add_ops([e, s])
    made = []
    for name, op, code in (("hs_profile_exp", e, emit_elementwise("hs_profile_exp", [e], [x], [e.result], "f32",
                                                                  (size // ROW, ROW))),
                           ("hs_profile_softmax", s, emit_row("hs_profile_softmax", s))):
        region, body = kernel.make_body([typ])  # the kernel op as `fuse-kernels` makes one
        inner = op.clone(value_mapper={x: body.args[0]})
        body.add_ops([inner, kernel.YieldOp(inner.results[0])])
        made.append(kernel.FusedOp([x], [typ], name, "f32", code.source, code.launches, code.scratch, region))
    module = ModuleOp(made)
    fused = [op for op in module.walk() if isinstance(op, kernel.FusedOp)]
    kernels = device.kernels(module)
    src = device.alloc(size * 4)
    device.upload(src, np.random.default_rng(0).standard_normal(size, dtype=np.float32))
    dst = device.alloc(size * 4)
    calls = []
    for op in fused:
        ((kind, fname, n0, n1),) = op.launch_list
        calls.append(device.prepare_launch(kernels, fname, kind, n0, n1, [src, dst]))
    by_kind = {("softmax" if any(o.name == "graph.softmax" for o in op.body.block.ops) else "exp"): c
               for op, c in zip(fused, calls)}
    return by_kind["exp"], by_kind["softmax"], 2 * size * 4


def device_rates(device: Device, seconds_per_point: float = 0.15,
                 shapes=GPU_MATMUL_SHAPES, size: int = GPU_ELEMENTWISE_SIZE) -> RankRates:
    """Return the compute rates of `device` (see the module docstring)."""
    rng = np.random.default_rng(0)
    points = []
    for shape in shapes:
        *stack, m, k, n = shape
        batch = stack[0] if stack else 1
        g = _rowmajor_gemm(m, k, n, batch)
        a, b, c = device.alloc(batch * k * n * 4), device.alloc(batch * m * k * 4), device.alloc(batch * m * n * 4)
        device.upload(a, rng.standard_normal(batch * k * n, dtype=np.float32))
        device.upload(b, rng.standard_normal(batch * m * k, dtype=np.float32))
        seconds = _timed_calls(device, device.prepare_gemm(g, a, b, c), seconds_per_point)
        flops = 2.0 * m * k * n
        points.append(MatmulPoint(flops, flops * batch / seconds / 1e9, tuple(shape)))
    exp_call, softmax_call, moved = _kernel_calls(device, size)
    t_exp = _timed_calls(device, exp_call, seconds_per_point)
    t_rows = _timed_calls(device, softmax_call, seconds_per_point)
    return RankRates(tuple(points), moved / t_exp, moved / t_rows)


def describe(rates: RankRates) -> str:
    """Return one line of a GPU rank's rates (its best matmul rate, the kernels' bandwidths)."""
    best = max(rates.matmul, key=lambda p: p.gflops)
    fused = f", fused {rates.fused_bps / 1e9:.0f} GB/s" if rates.fused_bps else ""
    return (f"matmul up to {best.gflops:.0f} GFLOP/s (at {'x'.join(map(str, best.shape))}), "
            f"elementwise {rates.elementwise_bps / 1e9:.0f} GB/s{fused}")


__all__ = ["GPU_MATMUL_SHAPES", "describe", "device_rates"]
