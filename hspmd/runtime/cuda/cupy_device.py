"""A CUDA GPU through CuPy: device memory, the program's kernels as RawModules, cuBLAS, CUDA graphs.

Everything runs on one non-blocking stream of the plan's own: kernel launches (each kernel
compiled once per program by CuPy's NVRTC, from the same CUDA C the CPU build tests, with
`cuda_preamble.cuh` and `hs_common.cuh` in front; launch shapes as `codegen/cupy_backend.py`
chooses them), GEMMs through cuBLAS's C API on a handle bound to that stream (`cublas.py`),
copies. Uploads go through pinned host buffers (one per destination, made once, with an event
after its last copy), so the next batch's copy is queued behind the running step without
waiting for it; a batch the data feed made in `host_buffer` memory (page-locked already) is
copied from where it lies. A traced step times its calls with CUDA events. `capture` records a run of a
step's calls into one CUDA graph (`Stream.begin_capture`/`end_capture`) and replays it; where
the capture fails it raises `CaptureError` with CUDA's reason, the capture ended, and the plan
counts and says it (`DevicePlan.capture_failures`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from xdsl.ir import Operation

from hspmd.codegen.cupy_backend import gpu_status, launch_config
from hspmd.codegen.nvrtc_check import GPU_OPTIONS, gpu_text
from hspmd.dialects import kernel
from hspmd.runtime.cuda.cublas import WORKSPACE_BYTES, Cublas
from hspmd.runtime.cuda.device import ALIGN, CaptureError, Call, Device, DeviceError, KernelSet
from hspmd.runtime.cuda.gemm import Gemm


class CupyDevice(Device):
    """CUDA device `index` (after `CUDA_VISIBLE_DEVICES`) through CuPy (see the module docstring)."""

    def __init__(self, index: int = 0) -> None:
        ok, why = gpu_status()
        if not ok:
            raise DeviceError(f"no usable GPU: {why}")
        import cupy

        self.cupy = cupy
        self.index = index
        cupy.cuda.Device(index).use()
        props = cupy.cuda.runtime.getDeviceProperties(index)
        name = props["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.side = cupy.cuda.Stream(non_blocking=True)  # collectives overlapping the plan's stream
        self._memory: list = []  # the allocations, alive with the device
        self._pinned: dict[tuple[int, int], tuple[np.ndarray, object]] = {}  # buffer, event after its copy
        self._host: dict[int, tuple[object, int]] = {}  # `host_buffer`s by address: memory, bytes
        self._events: dict[int, list] = {}  # a traced step's CUDA events, by the number of calls
        self.cublas = Cublas(self.stream.ptr, self.alloc(WORKSPACE_BYTES))

    def alloc(self, nbytes: int) -> int:
        mem = self.cupy.cuda.alloc(max(int(nbytes), 1) + ALIGN)
        self._memory.append(mem)
        self.cupy.cuda.runtime.memsetAsync(mem.ptr, 0, max(int(nbytes), 1) + ALIGN, self.stream.ptr)
        return mem.ptr + (-mem.ptr) % ALIGN

    def host_buffer(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        buffer = np.frombuffer(mem, np.uint8, int(nbytes))
        self._host[buffer.ctypes.data] = (mem, int(nbytes))
        return buffer

    def upload(self, ptr: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        rt = self.cupy.cuda.runtime
        host = self._host.get(array.ctypes.data)
        if host is not None and array.nbytes <= host[1]:  # page-locked already: the DMA reads it directly
            rt.memcpyAsync(ptr, array.ctypes.data, array.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
            return
        key = (ptr, array.nbytes)
        known = self._pinned.get(key)
        if known is None:
            mem = self.cupy.cuda.alloc_pinned_memory(max(array.nbytes, 1))
            known = self._pinned[key] = (np.frombuffer(mem, np.uint8, array.nbytes), self.cupy.cuda.Event())
        else:
            known[1].synchronize()  # the previous copy from this buffer has finished (not the work after it)
        staging, copied = known
        np.copyto(staging, array.reshape(-1).view(np.uint8))
        rt.memcpyAsync(ptr, staging.ctypes.data, array.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
        copied.record(self.stream)

    def download(self, ptr: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        out = np.empty(tuple(shape), np.dtype(dtype))
        self.stream.synchronize()
        rt = self.cupy.cuda.runtime
        rt.memcpy(out.ctypes.data, ptr, out.nbytes, rt.memcpyDeviceToHost)
        return out

    def kernels(self, module: Operation, rank: int = 0) -> KernelSet:
        functions: dict[str, object] = {}
        seen: set[str] = set()
        for op in module.walk():
            if not isinstance(op, kernel.FusedOp) or op.kernel.data in seen:
                continue
            seen.add(op.kernel.data)
            raw = self.cupy.RawModule(code=gpu_text(op.source_for(rank)), options=GPU_OPTIONS)
            for _, fname, _, _ in op.launch_list:
                functions[fname] = raw.get_function(fname)
        return KernelSet(functions)

    def prepare_launch(self, kernels: KernelSet, function: str, kind: str, n0: int, n1: int,
                       ptrs: Sequence[int]) -> Call:
        fn = kernels[function]
        grid, block = launch_config(kind, n0, n1)
        args = (*(np.uint64(p) for p in ptrs), np.int64(n0), np.int64(n1))
        stream = self.stream

        def launch() -> None:
            fn((grid,), (block,), args, stream=stream)  # type: ignore[operator]

        return launch

    def prepare_gemm(self, gemm: Gemm, a: int, b: int, c: int) -> Call:
        return self.cublas.gemm_call(gemm, a, b, c)

    def prepare_copy(self, dst: int, src: int, nbytes: int) -> Call:
        rt, stream = self.cupy.cuda.runtime, self.stream.ptr

        def copy() -> None:
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream)

        return copy

    def prepare_fork(self) -> Call:
        return self._ordering(self.stream, self.side)

    def prepare_join(self) -> Call:
        return self._ordering(self.side, self.stream)

    def _ordering(self, first, then) -> Call:
        """Return the call making stream `then` wait for the work queued on `first` so far (an
        event of its own, so that a graph capture records the dependency as an edge)."""
        event = self.cupy.cuda.Event(disable_timing=True)

        def order() -> None:
            event.record(first)
            then.wait_event(event)

        return order

    def prepare_on_side(self, work) -> Call:
        side = self.side.ptr
        return lambda: work(side)

    def prepare_copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> Call:
        rt, stream = self.cupy.cuda.runtime, self.stream.ptr

        def copy() -> None:
            rt.memcpy2DAsync(dst, dpitch, src, spitch, width, height, rt.memcpyDeviceToDevice, stream)

        return copy

    def capture(self, calls: Sequence[Call]) -> Call:
        calls = list(calls)
        stream = self.stream
        self.stream.synchronize()
        try:
            stream.begin_capture()
        except Exception as err:  # noqa: BLE001 - CUDARuntimeError and the like: say why
            raise CaptureError(f"the capture did not begin ({type(err).__name__}: {err})") from None
        failed: Exception | None = None
        try:
            for call in calls:
                call()
        except Exception as err:  # noqa: BLE001 - a call refused under capture
            failed = err
        try:
            graph = stream.end_capture()  # always: a failed capture must still end it
        except Exception as err:  # noqa: BLE001 - cudaErrorStreamCaptureUnjoined, ...Invalidated, ...
            failed = failed or err
        if failed is not None:
            raise CaptureError(f"{type(failed).__name__}: {failed}")

        def replay() -> None:
            graph.launch(stream)

        return replay

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.side.synchronize()

    def time_calls(self, calls: Sequence[Call], clock) -> list[tuple[float, float]]:
        """A CUDA event recorded before the first call and after each one, on the plan's stream;
        the calls run back to back and each one's times are its events' (read after the last),
        placed on `clock` from when the first event was recorded on an idle stream."""
        cuda = self.cupy.cuda
        events = self._events.get(len(calls))
        if events is None:
            events = self._events[len(calls)] = [cuda.Event() for _ in range(len(calls) + 1)]
        self.stream.synchronize()
        t0 = clock()
        events[0].record(self.stream)
        for call, event in zip(calls, events[1:]):
            call()
            event.record(self.stream)
        events[-1].synchronize()
        at = [0.0] + [cuda.get_elapsed_time(events[0], e) / 1e3 for e in events[1:]]
        return [(t0 + at[i], t0 + at[i + 1]) for i in range(len(calls))]
