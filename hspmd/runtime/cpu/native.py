"""The runtime's own C++ library (`runtime/cpu/native/`): its build, its loading, its parallel loop.

`parallel.cpp` (a parallel loop that never waits for a thread that has not started),
`small_matmul.cpp` (batches of small float32 products), `scatter.cpp` (rows added into a table
at indices, in order: the embedding's gradient), `reduce.cpp` (a gradient's sum of squares in
float64, for clipping) and `chain.cpp` (a chain of batched steps run by slices of its batch:
attention's products and softmax, `batch_chain.py`) are built by the host C++ compiler as one
library, cached on disk like the fused kernels' (`cpu_compile.build_native`), and loaded
once per process (`load()`). Where there is no compiler, or the build fails, there is none (its
users say so once): the plan keeps NumPy's products and the fused kernels run their chunks on
the calling thread.

`bind_parallel(kernels)` hands the parallel loop to a program's kernel library (`hs_set_parallel`),
whose launches then run in chunks on up to `omp_get_max_threads()` threads (`cuda_emu.h`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from hspmd.codegen import cpu_compile

HERE = Path(__file__).resolve().parent / "native"
#: the library's sources, one translation unit in this order
SOURCES = (HERE / "parallel.cpp", HERE / "small_matmul.cpp", HERE / "scatter.cpp", HERE / "reduce.cpp",
           HERE / "chain.cpp")


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """Return (the loaded native library, "") — built once per machine, cached on disk — or
    (None, why) where it cannot be built (no C++ compiler, a compile error)."""
    if cpu_compile.find_compiler() is None:
        return None, "no C++ compiler found ($CXX, g++, c++)"
    try:
        lib = ctypes.CDLL(str(cpu_compile.build_native(list(SOURCES))))
    except (cpu_compile.CompileError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, f"building the runtime's C++ library failed ({first})"
    fn = lib.hs_small_matmul_f32
    fn.restype = None
    fn.argtypes = ([ctypes.c_long] * 5 + [ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p]
                   + [ctypes.c_long] * 4 + [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int] * 2)
    scatter = lib.hs_scatter_add_rows
    scatter.restype = ctypes.c_long
    scatter.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                        ctypes.c_int, ctypes.c_int]
    sumsq = lib.hs_sum_squares
    sumsq.restype = ctypes.c_double
    sumsq.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    chain = lib.hs_chain_run
    chain.restype = ctypes.c_int
    chain.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    return lib, ""


def library() -> ctypes.CDLL | None:
    """Return the loaded native library, or None where it cannot be built (`load` says why)."""
    return load()[0]


def bind_parallel(kernels: cpu_compile.Library) -> bool:
    """Hand the native parallel loop to a loaded kernel library; return whether it took it (False:
    no native library, or a library built before kernels ran in chunks)."""
    lib = library()
    setter = getattr(kernels.dll, "hs_set_parallel", None)
    if lib is None or setter is None:
        return False
    setter.restype = None
    setter.argtypes = [ctypes.c_void_p]
    setter(ctypes.cast(lib.hs_parallel_for, ctypes.c_void_p))
    return True


_FLOATS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
_INDICES = {np.dtype(np.int32): 0, np.dtype(np.int64): 1}


def scatter_add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray) -> bool:
    """Add row i of `rows` into row `index[i]` of `out` in the order of i, in C++ (`scatter.cpp`:
    the bits of `np.add.at`); return False, adding nothing, where it does not apply (no library,
    other dtypes, arrays not C-contiguous). IndexError for an index outside `out`'s rows."""
    lib = library()
    if (lib is None or out.ndim != 2 or rows.ndim != 2 or index.ndim != 1 or out.dtype not in _FLOATS
            or rows.dtype != out.dtype or index.dtype not in _INDICES or rows.shape != (index.size, out.shape[1])
            or not (out.flags.c_contiguous and rows.flags.c_contiguous and index.flags.c_contiguous)
            or not out.flags.writeable):
        return False
    bad = lib.hs_scatter_add_rows(out.ctypes.data, out.shape[0], index.ctypes.data, index.size, rows.ctypes.data,
                                  out.shape[1], _FLOATS[out.dtype], _INDICES[index.dtype])
    if bad >= 0:
        raise IndexError(f"index {int(index[bad])} is out of bounds for axis 0 with size {out.shape[0]}")
    return True


def sum_squares(x: np.ndarray) -> float | None:
    """Return the sum of the squares of `x` (float32 or float64, C-contiguous) in float64, its
    additions in a fixed order (`reduce.cpp`), on the fused kernels' threads; None where it does
    not apply (no library, another dtype, not contiguous)."""
    lib = library()
    if lib is None or x.dtype not in _FLOATS or not x.flags.c_contiguous:
        return None
    return float(lib.hs_sum_squares(x.ctypes.data, x.size, _FLOATS[x.dtype], 0))
