"""cuBLAS through its C API (ctypes), on a handle, stream and workspace of our own.

CuPy's matmul and its `cublas` wrapper refuse to run while a stream is being captured into a
CUDA graph; cuBLAS itself captures fine when called with a handle bound to the capturing
stream and a workspace set on it (measured on an H100: `../shared/gpu/README.md`). So the GPU
plan calls cuBLAS directly: `Cublas(stream)` makes the handle, binds it to the plan's stream,
gives it a workspace, and `gemm(...)` issues one (strided batched) GEMM with cuBLAS's
column-major conventions (`gemm.Gemm`). Host pointer mode: alpha and beta are read when the
call is made (captured: when the graph is made), so they stay constants of the call.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy as np

from hspmd.runtime.cuda.gemm import Gemm

#: bytes of the workspace cuBLAS gets (it needs one to run inside a captured graph)
WORKSPACE_BYTES = 32 << 20
_OP = {False: 0, True: 1}  # CUBLAS_OP_N, CUBLAS_OP_T
#: cudaDataType of the operands of cublasGemmEx: CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F
_DATA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0}
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT = 68, 77, -1


def _pathfinder_cublas() -> str | None:
    """Return the path of the libcublas `cuda.pathfinder` loads (a dependency of CuPy 14 and of
    cuda-bindings: the CUDA wheels of the environment, CUDA 13's `nvidia/cu13/lib` among them, then
    the toolkit), or None where it is not installed or finds none."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return None
    try:
        return load_nvidia_dynamic_lib("cublas").abs_path or None
    except Exception:  # noqa: BLE001 - DynamicLibNotFoundError and the like: the other places are tried
        return None


def library_candidates() -> list[str]:
    """Return where libcublas is looked for, in order: `cuda.pathfinder`'s, the toolkit's
    (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`), an nvidia wheel's on `sys.path` (CUDA 13's
    `nvidia/cu13/lib`, CUDA 12's `nvidia/cublas/lib`), then the bare names the loader resolves."""
    candidates = [path for path in [_pathfinder_cublas()] if path]
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if base:
            candidates += sorted(glob.glob(os.path.join(base, "lib64", "libcublas.so*")))
    for site in sys.path:
        for wheel in (("cu13", "lib"), ("cublas", "lib")):
            candidates += sorted(glob.glob(os.path.join(site or ".", "nvidia", *wheel, "libcublas.so*")))
    candidates += ["libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"]
    return list(dict.fromkeys(candidates))


def find_library() -> str:
    """Return the path (or name) of the first libcublas of `library_candidates` that loads."""
    for name in library_candidates():
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise OSError("libcublas not found (cuda.pathfinder, the CUDA toolkit's lib64, an nvidia cuBLAS wheel)")


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""


class Cublas:
    """A cuBLAS handle bound to `stream` (a `cudaStream_t` as an integer) with a workspace at
    `workspace` (`WORKSPACE_BYTES`, device memory the caller keeps alive)."""

    def __init__(self, stream: int, workspace: int) -> None:
        self.lib = ctypes.CDLL(find_library())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(workspace),
                                                   ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed with cuBLAS status {status}")

    def gemm_call(self, g: Gemm, a: int, b: int, c: int):
        """Return the call issuing GEMM `g` on A at `a`, B at `b`, C at `c` (on the handle's stream):
        cublasSgemm/Dgemm for float32 and float64, cublasGemmEx (tensor cores, float32
        accumulation) for bfloat16, float16 and TF32."""
        if g.tf32 or g.dtype.name in ("bfloat16", "float16"):
            return self._gemm_ex_call(g, a, b, c)
        if g.dtype == np.float32:
            scalar, single, batched = ctypes.c_float, self.lib.cublasSgemm_v2, self.lib.cublasSgemmStridedBatched
        elif g.dtype == np.float64:
            scalar, single, batched = ctypes.c_double, self.lib.cublasDgemm_v2, self.lib.cublasDgemmStridedBatched
        else:
            raise CublasError(f"no GEMM for {g.dtype} yet (float32 and float64)")
        alpha, beta = scalar(1.0), scalar(0.0)
        head = (self.handle, _OP[g.transa], _OP[g.transb], g.m, g.n, g.k, ctypes.byref(alpha))
        if g.batch == 1:
            args = (*head, ctypes.c_void_p(a), g.lda, ctypes.c_void_p(b), g.ldb, ctypes.byref(beta), ctypes.c_void_p(c),
                    g.ldc)
            fn = single
        else:
            args = (*head, ctypes.c_void_p(a), g.lda, ctypes.c_longlong(g.stride_a), ctypes.c_void_p(b), g.ldb,
                    ctypes.c_longlong(g.stride_b), ctypes.byref(beta), ctypes.c_void_p(c), g.ldc,
                    ctypes.c_longlong(g.stride_c), g.batch)
            fn = batched
        keep = (alpha, beta)  # alive as long as the call

        def call() -> None:
            status = fn(*args)
            if status != 0:
                raise CublasError(f"GEMM {g} failed with cuBLAS status {status}")
            _ = keep

        return call

    def _gemm_ex_call(self, g: Gemm, a: int, b: int, c: int):
        """The call of `g` through cublasGemmEx / cublasGemmStridedBatchedEx, computing in float32
        (on TF32 tensor cores for a float32 `g.tf32`)."""
        kind = _DATA_TYPE.get(g.dtype.name)
        if kind is None:
            raise CublasError(f"no GEMM for {g.dtype} on tensor cores")
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if g.tf32 else CUBLAS_COMPUTE_32F
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        head = (self.handle, _OP[g.transa], _OP[g.transb], g.m, g.n, g.k, ctypes.byref(alpha))
        if g.batch == 1:
            args = (*head, ctypes.c_void_p(a), kind, g.lda, ctypes.c_void_p(b), kind, g.ldb, ctypes.byref(beta),
                    ctypes.c_void_p(c), kind, g.ldc, compute, CUBLAS_GEMM_DEFAULT)
            fn = self.lib.cublasGemmEx
        else:
            args = (*head, ctypes.c_void_p(a), kind, g.lda, ctypes.c_longlong(g.stride_a), ctypes.c_void_p(b), kind,
                    g.ldb, ctypes.c_longlong(g.stride_b), ctypes.byref(beta), ctypes.c_void_p(c), kind, g.ldc,
                    ctypes.c_longlong(g.stride_c), g.batch, compute, CUBLAS_GEMM_DEFAULT)
            fn = self.lib.cublasGemmStridedBatchedEx
        keep = (alpha, beta)

        def call() -> None:
            status = fn(*args)
            if status != 0:
                raise CublasError(f"GEMM {g} failed with cuBLAS status {status}")
            _ = keep

        return call
