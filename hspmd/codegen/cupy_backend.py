"""The GPU side of a fused kernel: the same CUDA C source through `cupy.RawKernel`.

`gpu_status()` says whether CuPy and a GPU are there. `kernel_for(op)` returns a function of
CuPy arrays for a `kernel.fused` op: each launch is a RawKernel compiled (by CuPy's NVRTC,
cached by CuPy) from the source with `cuda_preamble.cuh` + `hs_common.cuh` in front; an
`elementwise` launch runs 256-thread blocks over a grid-stride loop, a `row` launch one block
per row (up to 65535 blocks, striding further) with a power-of-two block of about a quarter
of the row's columns (at least a warp, at most 1024 threads). `matmul(a, b)` is cuBLAS through `cupy.matmul`. Collectives
(NCCL) are not here.
"""

from __future__ import annotations

import functools

from hspmd.codegen.nvrtc_check import GPU_OPTIONS, gpu_text

ELEMENTWISE_BLOCK = 256
MAX_GRID = 65535


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """Return (usable, why not / which device): CuPy importable and a CUDA device present."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDA driver missing or broken: CuPy raises its own errors
        return False, f"no CUDA device ({type(err).__name__})"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def row_block(cols: int) -> int:
    """Return the threads per block of a row launch: a power of two in [32, 1024], at least a
    quarter of `cols` (each thread about 4 columns). Measured on an H100 against a block as wide
    as the row: softmax over 1024 columns 0.027 against 0.043 ms, over 128 columns 0.024 against
    0.029 ms, layer norm over 256 columns 0.030 against 0.035 ms (`benchmarks/RESULTS.md`)."""
    b = 32
    while 4 * b < cols and b < 1024:
        b *= 2
    return b


def launch_config(kind: str, n0: int, n1: int) -> tuple[int, int]:
    """Return (blocks, threads per block) of a launch."""
    if kind == "elementwise":
        return max(1, min(MAX_GRID, -(-n0 // ELEMENTWISE_BLOCK))), ELEMENTWISE_BLOCK
    return max(1, min(MAX_GRID, n0)), row_block(n1)


@functools.cache
def _raw_kernels(source: str, names: tuple[str, ...]):
    import cupy

    module = cupy.RawModule(code=gpu_text(source), options=GPU_OPTIONS)
    return tuple(module.get_function(n) for n in names)


def kernel_for(op):
    """Return a function of CuPy arrays computing `kernel.fused` op `op` on the current GPU."""
    import cupy
    import numpy as np

    from hspmd.ir.types import dtype_name

    launches = op.launch_list
    fns = _raw_kernels(op.source.data, tuple(name for _, name, _, _ in launches))
    in_dtypes = [np.dtype(dtype_name(v.type)) for v in op.inputs]
    outs = [(tuple(v.type.get_shape()), np.dtype(dtype_name(v.type))) for v in op.outputs]
    t = np.dtype("float64" if op.dtype.data == "f64" else "float32")  # scratch: the compute type (float for 16 bits)
    scratch = op.scratch_sizes
    configs = [launch_config(kind, n0, n1) for kind, _, n0, n1 in launches]

    def call(*args):
        arrays = [cupy.ascontiguousarray(cupy.asarray(a, dtype=dt)) for a, dt in zip(args, in_dtypes)]
        results = [cupy.empty(shape, dt) for shape, dt in outs]
        scr = [cupy.empty(n, t) for n in scratch]
        for fn, (_, _, n0, n1), (grid, block) in zip(fns, launches, configs):
            fn((grid,), (block,), (*arrays, *results, *scr, np.int64(n0), np.int64(n1)))
        return results[0] if len(results) == 1 else tuple(results)

    return call


def matmul(a, b):
    """`a @ b` on the GPU (cuBLAS); a batch of rows times a matrix is one 2-D product."""
    import cupy

    if b.ndim == 2 and a.ndim > 2:
        return cupy.matmul(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1])
    return cupy.matmul(a, b)
