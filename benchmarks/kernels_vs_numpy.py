"""Fused CPU kernels vs NumPy per op, on GPT-tiny sizes (fused time / NumPy time; lower is better).

Each case is a small function of `graph`/`optim` ops, fused by `fuse-kernels` into one
`kernel.fused`; the same op then runs (a) as the compiled CPU kernel and (b) as its body, op
by op, with hspmd's NumPy kernels — what the runtime does with and without fusion. The
fused kernel writes into preallocated result arrays (`out=`, as the execution plan passes
them); the NumPy kernels allocate their results and temporaries, as they do in a plan.

    python benchmarks/kernels_vs_numpy.py [--repeat N] [--threads T]

The fused kernels run on T OpenMP threads (default: every core, OMP_DYNAMIC off, so the
machine's load average does not shrink the team as it does by default at run time); the
NumPy kernels are single-threaded ufuncs, as in a plan.

Cases: bias + GELU (tanh) on tokens 2048 x d_ff 1024; layer norm on 2048 x 256; causal
attention softmax on 16*4*128 rows x 128; AdamW over 3M parameters. The last line is the
largest of the ratios (the target is <= 0.33 for each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

CASES = {
    "bias+gelu 2048x1024": """
func.func @f(%x: tensor<2048x1024xf32>, %b: tensor<1024xf32>) -> tensor<2048x1024xf32> {
  %bb = graph.broadcast %b {dims = array<i64: 1>} : (tensor<1024xf32>) -> tensor<2048x1024xf32>
  %h = graph.add %x, %bb : (tensor<2048x1024xf32>, tensor<2048x1024xf32>) -> tensor<2048x1024xf32>
  %y = graph.gelu %h {approximate = "tanh"} : (tensor<2048x1024xf32>) -> tensor<2048x1024xf32>
  func.return %y : tensor<2048x1024xf32>
}""",
    "layernorm 2048x256": """
func.func @f(%x: tensor<2048x256xf32>, %w: tensor<256xf32>, %b: tensor<256xf32>) -> tensor<2048x256xf32> {
  %y = graph.layer_norm %x, %w, %b {eps = 1.0e-05 : f64} : (tensor<2048x256xf32>, tensor<256xf32>, tensor<256xf32>) -> tensor<2048x256xf32>
  func.return %y : tensor<2048x256xf32>
}""",
    "softmax 8192x128": """
func.func @f(%x: tensor<16x4x128x128xf32>) -> tensor<16x4x128x128xf32> {
  %y = graph.softmax %x {dim = 3 : i64} : (tensor<16x4x128x128xf32>) -> tensor<16x4x128x128xf32>
  func.return %y : tensor<16x4x128x128xf32>
}""",
    "adamw 3.1M params": """
func.func @f(%p: tensor<1536x2048xf32>, %g: tensor<1536x2048xf32>, %m: tensor<1536x2048xf32>, %v: tensor<1536x2048xf32>,
             %lr: tensor<f64>, %bc1: tensor<f64>, %bc2: tensor<f64>) -> (tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<1536x2048xf32>) {
  %p1, %m1, %v1 = optim.adam %p, %g, %m, %v, %lr, %bc1, %bc2 {beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-08 : f64, weight_decay = 0.1 : f64, decoupled = true} : (tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<f64>, tensor<f64>, tensor<f64>) -> (tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<1536x2048xf32>)
  func.return %p1, %m1, %v1 : tensor<1536x2048xf32>, tensor<1536x2048xf32>, tensor<1536x2048xf32>
}""",
}


def _arguments(op, rng: np.random.Generator) -> list[np.ndarray]:
    args = []
    for v in op.inputs:
        shape = tuple(v.type.get_shape())
        dtype = "float32" if str(v.type.element_type) == "f32" else "float64"
        if shape == ():
            args.append(np.array(0.5, dtype))
        else:
            a = rng.standard_normal(shape).astype(dtype)
            args.append(np.abs(a) if len(args) == 3 else a)  # Adam's second moment is >= 0
    return args


def fused_case(text: str):
    """Return the module of case `text` (one function), fused by `fuse-kernels`."""
    from hspmd.dialects.context import parse_module
    from hspmd.transforms.fuse_kernels import fuse_module

    module = parse_module("builtin.module {" + text + "\n}")
    fuse_module(module)
    return module


def _best_pair(f, g, args, repeat: int) -> tuple[float, float]:
    """Return the best times of `f` and `g`, run alternately (so both see the same machine)."""
    f(*args), g(*args)  # warm up (page faults, thread start)
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for k, fn in enumerate((f, g)):
            t = time.perf_counter()
            fn(*args)
            best[k] = min(best[k], time.perf_counter() - t)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=40, help="timed runs per side, alternating (the best is kept)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OpenMP threads of the fused kernels")
    args = p.parse_args(argv)
    # read by libgomp when the first kernel library loads, below
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_DYNAMIC"] = "false"

    from hspmd.codegen.cpu_compile import find_compiler
    from hspmd.runtime.kernel_exec import cpu_call, fused_ops, numpy_call, program_library

    if find_compiler() is None:
        print("no C++ compiler: nothing to compare", file=sys.stderr)
        return 1
    modules = {name: fused_case(text) for name, text in CASES.items()}
    # one library per case, as per program at run time (compiled once, then cached)
    t = time.perf_counter()
    libs = {name: program_library(m) for name, m in modules.items()}
    print(f"compile (or cache hit) of {len(libs)} libraries: {time.perf_counter() - t:.2f} s; "
          f"fused kernels on {args.threads} thread(s)")
    rng = np.random.default_rng(0)
    ratios = []
    print(f"{'case':24s} {'fused ms':>9s} {'numpy ms':>9s} {'ratio':>6s}  max |diff|")
    for name, module in modules.items():
        (op,) = fused_ops(module)
        data = _arguments(op, rng)
        fused, ref = cpu_call(op, libs[name]), numpy_call(op)
        a, b = fused(*data), ref(*data)
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
        # the fused kernel writes into preallocated results, as the execution plan gives them
        # (out=); the per-op NumPy kernels allocate their results and temporaries as they do
        outs = tuple(np.empty_like(x) for x in a)
        into = lambda *xs: fused(*xs, out=outs)  # noqa: E731
        tf, tn = _best_pair(into, ref, data, args.repeat)
        ratios.append(tf / tn)
        print(f"{name:24s} {tf * 1e3:9.3f} {tn * 1e3:9.3f} {tf / tn:6.3f}  {diff:.2e}")
    print(f"ratio {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
