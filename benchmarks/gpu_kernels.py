"""Fused kernels on a GPU: the kernel level's CUDA C as `cupy.RawKernel` vs CuPy op by op.

Two parts, both on the current CUDA device (needs CuPy and a GPU; says why and exits 2 when
either is missing):

1. Every fused kernel of GPT-tiny's one-device step (`examples/gpt.py`, the kernel level that
   `hspmd compile --emit kernels` writes) runs as RawKernels on random operands and is
   compared with the NumPy per-op reference on the CPU (largest relative difference printed).
2. The cases of `benchmarks/kernels_vs_numpy.py` (bias + GELU, layer norm, causal-size
   softmax, AdamW over 3M parameters), timed with CUDA events: the fused RawKernel against
   the same body run op by op with CuPy arrays (hspmd's NumPy kernels, dispatched to CuPy
   through NumPy's array protocols: what an unfused GPU program would launch), and against
   PyTorch eager CUDA where PyTorch is there.

    python benchmarks/gpu_kernels.py [--repeat N]

The last line is the largest fused ÷ op-by-op ratio (lower is better).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels_vs_numpy import CASES, _arguments, fused_case  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _gpu_time(fn, args, repeat: int) -> float:
    """Return the median milliseconds of `fn(*args)` on the GPU (CUDA events, after a warm-up)."""
    import cupy

    fn(*args)
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def _torch_case(name: str):
    """Return a PyTorch eager function of the case's (CUDA tensor) operands, or None."""
    import torch
    import torch.nn.functional as F

    if name.startswith("bias+gelu"):
        return lambda x, b: F.gelu(x + b, approximate="tanh")
    if name.startswith("layernorm"):
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    if name.startswith("softmax"):
        return lambda x: torch.softmax(x, dim=-1)
    if name.startswith("adamw"):
        def adamw(p, g, m, v, lr, bc1, bc2):
            torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(1.0, device=p.device)], lr=0.5,
                                beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                                maximize=False)
            return p
        return adamw
    return None


def gpt_kernels_match(rng) -> tuple[int, float]:
    """Run every fused kernel of GPT-tiny's step on the GPU; return (count, largest rel. diff)."""
    import cupy

    from hspmd.codegen import cupy_backend
    from hspmd.compiler import compile_script
    from hspmd.dialects.kernel import FusedOp
    from hspmd.dialects.levels import physical_groups
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.runtime import kernel_exec
    from hspmd.transforms.fuse_kernels import fuse_module

    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), parse_overrides([]))
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, group),) = physical_groups(compiled.physical)
    fused = group.clone()
    fuse_module(fused)
    worst, count, seen = 0.0, 0, set()
    for op in [o for o in fused.walk() if isinstance(o, FusedOp)]:
        if op.kernel.data in seen:
            continue
        seen.add(op.kernel.data)
        args = kernel_exec.sample_operands(op, rng)
        ref = _tuple(kernel_exec.numpy_call(op)(*args))
        got = _tuple(cupy_backend.kernel_for(op)(*[cupy.asarray(a) for a in args]))
        for r, g in zip(ref, got):
            g = cupy.asnumpy(g)
            scale = max(float(np.max(np.abs(r))), 1e-30)
            worst = max(worst, float(np.max(np.abs(g - r))) / scale)
        count += 1
    return count, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=50, help="timed runs per side (the median is kept)")
    args = p.parse_args(argv)

    from hspmd.codegen import cupy_backend

    ok, why = cupy_backend.gpu_status()
    if not ok:
        print(f"no GPU run: {why}", file=sys.stderr)
        return 2
    import cupy

    from hspmd.runtime.kernel_exec import fused_ops, numpy_call

    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}, CuPy {cupy.__version__}")
    rng = np.random.default_rng(0)
    n, worst = gpt_kernels_match(rng)
    print(f"GPT-tiny: {n} distinct fused kernels as RawKernels; largest |gpu - numpy| / max|numpy| {worst:.2e}")
    try:
        import torch

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    ratios = []
    print(f"{'case':24s} {'fused ms':>9s} {'per-op ms':>9s} {'torch ms':>9s} {'fused/per-op':>12s}")
    for name, text in CASES.items():
        (op,) = fused_ops(fused_case(text))
        host = _arguments(op, rng)
        data = [cupy.asarray(a) for a in host]
        fused = cupy_backend.kernel_for(op)
        chain = numpy_call(op)
        got = _tuple(fused(*data))
        ref = _tuple(numpy_call(op)(*host))
        diff = max(float(np.max(np.abs(cupy.asnumpy(g) - r))) for g, r in zip(got, ref))
        tf = _gpu_time(fused, data, args.repeat)
        try:
            tc = _gpu_time(chain, data, args.repeat)
        except Exception as err:  # a NumPy kernel CuPy cannot take: said, not hidden
            print(f"  {name}: op by op on CuPy failed ({type(err).__name__}: {err})")
            tc = float("nan")
        tt = float("nan")
        if has_torch and (tfn := _torch_case(name)) is not None:
            try:
                tdata = [torch.as_tensor(a, device="cuda") for a in host]
                tt = _gpu_time(tfn, tdata, args.repeat)
            except Exception as err:  # a PyTorch private op that changed: said, not hidden
                print(f"  {name}: PyTorch failed ({type(err).__name__}: {err})")
        ratios.append(tf / tc)
        print(f"{name:24s} {tf:9.3f} {tc:9.3f} {tt:9.3f} {tf / tc:12.3f}   max |fused - numpy| {diff:.1e}")
    measured = [r for r in ratios if not math.isnan(r)]  # nan: op by op could not run on CuPy
    print(f"ratio {max(measured) if measured else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
