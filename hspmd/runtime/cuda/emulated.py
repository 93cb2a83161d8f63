"""A device emulated on the CPU: host memory as device memory, the kernels' CPU build, NumPy GEMMs.

It implements `Device` so that the whole CUDA plan runs in CI, on machines without a GPU: the
plan's pointers, offsets, strides, launch extents and GEMM arguments are the ones a GPU gets,
and a wrong one shows up as wrong numbers (or a crash) here first. Device memory is host memory
(one NumPy buffer per allocation, its address the pointer); a kernel launch calls the launcher
of the program's CPU build (`codegen/cpu_compile.py`: the same CUDA C under `cuda_emu.h`, a
launch in chunks on the runtime's threads); a GEMM runs `gemm.numpy_gemm` on views of the
memory with cuBLAS's leading dimensions and strides. The side stream's work (a bucket's sum) is
queued and runs when the plan's stream joins it (or at a download), so a step that reads what
the side stream writes before joining it reads wrong numbers here. `team` > 1 runs row launches with that
many emulated threads per block (real barriers and warp shuffles: the GPU algorithm as written).

`capture` checks what CUDA's stream capture checks of the side stream, and refuses (a
`CaptureError` naming CUDA's error) where a GPU's capture would fail: a fork of the side stream
not joined back before the capture ends (`cudaErrorStreamCaptureUnjoined`: a graph split
between a bucket's start and its wait), a join of a side stream forked outside the capture (a
wait on an event recorded outside it), work queued on a side stream not in the capture, or a
call that runs between graphs (host-staged) inside one. The captured calls then run in order.

It is a test device: `hspmd run --device cuda` never falls back to it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from xdsl.ir import Operation

from hspmd.codegen import cpu_compile
from hspmd.runtime.cpu import native
from hspmd.runtime.cuda.device import ALIGN, CaptureError, Call, Device, DeviceError, KernelSet
from hspmd.runtime.cuda.gemm import Gemm, numpy_gemm
from hspmd.runtime.kernel_exec import build_program


class EmulatedDevice(Device):
    """The CPU as a device (see the module docstring)."""

    name = "an emulated GPU (host memory, the kernels built for the CPU)"

    def __init__(self, team: int = 1) -> None:
        self.team = team
        self._blocks: list[np.ndarray] = []  # the memory handed out, kept alive with the device
        self._side: list = []  # the side stream's work, run when the plan's stream joins it

    def prepare_fork(self) -> Call:
        return _role(lambda: None, "fork")

    def prepare_on_side(self, work) -> Call:
        side = self._side
        return _role(lambda: side.append(work), "work")

    def prepare_join(self) -> Call:
        return _role(lambda: self._run_side(), "join")

    def capture(self, calls: Sequence[Call]) -> Call:
        """Check `calls` as CUDA's stream capture checks the side stream (see the module
        docstring: CaptureError where a GPU's capture fails), then return them run in order."""
        calls = list(calls)
        forked = unjoined = False  # the side stream is in this capture / has work (or a fork) not joined back
        for i, call in enumerate(calls):
            role = getattr(call, "emulated_role", None)
            if getattr(call, "uncaptured", False):
                raise CaptureError(f"call {i} of {len(calls)} runs between graphs (a host call) but is in a capture")
            if role == "fork":
                forked = unjoined = True
            elif role == "work" and not forked:
                raise CaptureError(f"call {i} of {len(calls)} queues work on the side stream, which was forked "
                                   "outside this capture: it would run once, at the capture, not at each replay")
            elif role == "work":
                unjoined = True
            elif role == "join" and not forked:
                raise CaptureError(f"cudaErrorStreamCaptureIsolation: call {i} of {len(calls)} joins the side stream, "
                                   "forked outside this capture (a wait on an event recorded outside it)")
            elif role == "join":
                unjoined = False
        if unjoined:
            raise CaptureError("cudaErrorStreamCaptureUnjoined: the side stream forked in this capture is not "
                               f"joined back before its end ({len(calls)} calls: a graph split between a fork and its join)")
        return super().capture(calls)

    def _run_side(self) -> None:
        """Run the side stream's work queued so far (late, as a GPU may: a step that reads a
        bucket's sums before joining the side stream reads them unsummed here)."""
        work, self._side[:] = list(self._side), []
        for w in work:
            w(0)

    def synchronize(self) -> None:
        self._run_side()

    def alloc(self, nbytes: int) -> int:
        block = np.zeros(max(int(nbytes), 1) + ALIGN, np.uint8)
        self._blocks.append(block)
        base = block.ctypes.data
        return base + (-base) % ALIGN

    def _memory(self, ptr: int, nbytes: int) -> np.ndarray:
        """Return the bytes [ptr, ptr + nbytes) as a writeable uint8 array (checked to be ours)."""
        for block in self._blocks:
            start = block.ctypes.data
            if start <= ptr and ptr + nbytes <= start + block.nbytes:
                return block[ptr - start: ptr - start + nbytes]
        raise DeviceError(f"[{ptr:#x}, {ptr + nbytes:#x}) is not memory of this device")

    def _array(self, ptr: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        return self._memory(ptr, n * dtype.itemsize).view(dtype).reshape(tuple(shape))

    def upload(self, ptr: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        np.copyto(self._memory(ptr, array.nbytes), array.reshape(-1).view(np.uint8))

    def download(self, ptr: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        self._run_side()
        return self._array(ptr, shape, dtype).copy()

    def kernels(self, module: Operation, rank: int = 0) -> KernelSet:
        try:
            lib = cpu_compile.load_library(build_program(module, team=self.team > 1, rank=rank))
        except (cpu_compile.CompileError, OSError) as err:
            raise DeviceError(f"the emulated device cannot build the program's kernels: {err}") from None
        native.bind_parallel(lib)
        return KernelSet({"": lib})

    def prepare_launch(self, kernels: KernelSet, function: str, kind: str, n0: int, n1: int,
                       ptrs: Sequence[int]) -> Call:
        fn = kernels[""].function(function)  # type: ignore[attr-defined]
        args = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
        team = self.team

        def launch() -> None:
            fn(args, n0, n1, team)

        return launch

    def prepare_gemm(self, gemm: Gemm, a: int, b: int, c: int) -> Call:
        def extent(ld_rows: int, stride: int, rows: int, cols: int) -> int:
            return (gemm.batch - 1) * stride + (cols - 1) * ld_rows + rows

        ra, ca = (gemm.k, gemm.m) if gemm.transa else (gemm.m, gemm.k)
        rb, cb = (gemm.n, gemm.k) if gemm.transb else (gemm.k, gemm.n)
        arr_a = self._array(a, (extent(gemm.lda, gemm.stride_a, ra, ca),), gemm.dtype)
        arr_b = self._array(b, (extent(gemm.ldb, gemm.stride_b, rb, cb),), gemm.dtype)
        arr_c = self._array(c, (extent(gemm.ldc, gemm.stride_c, gemm.m, gemm.n),), gemm.dtype)
        return lambda: numpy_gemm(gemm, arr_a, arr_b, arr_c)

    def prepare_copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> Call:
        def rows(ptr: int, pitch: int) -> np.ndarray:
            span = self._memory(ptr, (height - 1) * pitch + width) if height else self._memory(ptr, 0)
            return np.lib.stride_tricks.as_strided(span, (height, width), (pitch, 1), writeable=True)

        to, frm = rows(dst, dpitch), rows(src, spitch)
        return lambda: np.copyto(to, frm)

    def prepare_copy(self, dst: int, src: int, nbytes: int) -> Call:
        to, frm = self._memory(dst, nbytes), self._memory(src, nbytes)
        return lambda: np.copyto(to, frm)


def _role(call: Call, role: str) -> Call:
    """Mark `call` as the emulated device's fork, side-stream work or join (what `capture` checks)."""
    call.emulated_role = role  # type: ignore[attr-defined]
    return call
