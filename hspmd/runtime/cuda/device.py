"""The one narrow interface between the GPU plan and a device, and arrays in device memory.

A `Device` allocates memory, copies to, from and within it, makes the kernels of a device
program, and prepares the calls a step makes: a kernel launch, a GEMM with cuBLAS's
conventions (`gemm.Gemm`), a copy, and work on a side stream forked from and joined to the
plan's stream by events (a gradient bucket's sum overlapping the backward). A prepared call
takes no argument (every pointer is fixed when the plan is built), so a step is a list of calls,
which `capture` may turn into one CUDA graph. `EmulatedDevice` and `CupyDevice` implement it; nothing else in the plan knows which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from xdsl.ir import Operation

from hspmd.runtime.cuda.gemm import Gemm

#: a prepared call of a step: every argument fixed
Call = Callable[[], None]
#: device memory is handed out in multiples of this many bytes (cuBLAS and vector loads like it)
ALIGN = 256


class DeviceError(Exception):
    """A device is missing, or refused what the plan asked of it."""


class CaptureError(DeviceError):
    """A run of calls could not be captured as one CUDA graph (the message says why)."""


class Device(ABC):
    """A device the GPU plan runs on (see the module docstring). Pointers are integers."""

    #: what the device is, in a few words (`nvidia H100 80GB HBM3`, `emulated on the CPU`)
    name: str = ""

    @abstractmethod
    def alloc(self, nbytes: int) -> int:
        """Return a pointer to `nbytes` of device memory, aligned to `ALIGN`, alive as long as the device."""

    @abstractmethod
    def upload(self, ptr: int, array: np.ndarray) -> None:
        """Copy a host array into device memory at `ptr`."""

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Return `nbytes` of host memory (uint8) that `upload` copies from directly: page-locked
        under CUDA, so that the copy is a DMA queued on the plan's stream with no staging copy
        first (the data feed makes batches into these, `runtime/cuda/staging.py`). The caller
        keeps a buffer unchanged until the step after the one its upload was queued in has run.
        Here: ordinary memory."""
        return np.empty(max(int(nbytes), 1), np.uint8)[:nbytes]

    @abstractmethod
    def download(self, ptr: int, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        """Return a host copy of the array of `shape` and `dtype` at `ptr` (after the work queued so far)."""

    @abstractmethod
    def kernels(self, module: Operation, rank: int = 0) -> KernelSet:
        """Return the kernels of every `kernel.fused` op of device program `module` as `rank`
        runs them (`kernel.FusedOp.source_for`), made once."""

    @abstractmethod
    def prepare_launch(self, kernels: KernelSet, function: str, kind: str, n0: int, n1: int,
                       ptrs: Sequence[int]) -> Call:
        """Return the call launching `function` of `kernels` (`kind` "elementwise" or "row") over
        `n0` items or rows of `n1` columns, with pointer arguments `ptrs`."""

    @abstractmethod
    def prepare_gemm(self, gemm: Gemm, a: int, b: int, c: int) -> Call:
        """Return the call computing `gemm` with A at `a`, B at `b` and C at `c`."""

    @abstractmethod
    def prepare_copy(self, dst: int, src: int, nbytes: int) -> Call:
        """Return the call copying `nbytes` from `src` to `dst` in device memory."""

    def prepare_fork(self) -> Call:
        """Return the call making the side stream wait for the work queued on the plan's stream so
        far (a CUDA event recorded there, waited for on the side stream). Here: nothing to wait for."""
        return lambda: None

    def prepare_on_side(self, work: Callable[[int], None]) -> Call:
        """Return the call queuing `work(stream)` on the side stream (a collective overlapping
        the plan's stream: a gradient bucket's sum). Here: at once, one stream."""
        return lambda: work(0)

    def prepare_join(self) -> Call:
        """Return the call making the plan's stream wait for the work queued on the side stream
        so far. Here: nothing to wait for."""
        return lambda: None

    def prepare_copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> Call:
        """Return the call copying `height` rows of `width` bytes from `src` (rows `spitch` bytes
        apart) to `dst` (rows `dpitch` bytes apart), as `cudaMemcpy2DAsync` does. Here: a copy
        per row; a device does it in one call."""
        rows = [self.prepare_copy(dst + r * dpitch, src + r * spitch, width) for r in range(height)]

        def copy() -> None:
            for row in rows:
                row()

        return copy

    def capture(self, calls: Sequence[Call]) -> Call:
        """Return one call running `calls` in order: a CUDA graph of them, where the device has
        graphs; CaptureError where they cannot be captured (the stream is left as it was)."""
        calls = list(calls)

        def run() -> None:
            for call in calls:
                call()

        return run

    def synchronize(self) -> None:
        """Wait until every call queued so far has finished."""

    def time_calls(self, calls: Sequence[Call], clock: Callable[[], float]) -> list[tuple[float, float]]:
        """Run `calls` in order and return when each started and ended, on `clock`'s scale (a
        traced step). Here: each call synchronised and timed on the host; a GPU records an event
        between calls instead (`CupyDevice`), so the calls run back to back as in a step."""
        out = []
        for call in calls:
            start = clock()
            call()
            self.synchronize()
            out.append((start, clock()))
        return out


class KernelSet:
    """The made kernels of one device program, by function name (what `Device.kernels` returns)."""

    def __init__(self, functions: dict[str, object]) -> None:
        self.functions = functions

    def __getitem__(self, name: str) -> object:
        return self.functions[name]


@dataclass(frozen=True)
class DeviceArray:
    """An array in a device's memory: a pointer, a shape and a dtype (contiguous, row-major).

    It stands for a parameter's value in a GPU run's state: `np.asarray(a)` (and `a.copy()`)
    copies it to the host, `a[i]` is its i-th entry along the leading dim (a stacked layer's
    value), so checkpoints and gathers that read state arrays read device arrays alike.
    """

    device: Device
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Return the bytes the array spans."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d device array")
        return self.shape[0]

    def __getitem__(self, index: int) -> DeviceArray:
        if not isinstance(index, (int, np.integer)) or not self.shape:
            raise TypeError("a device array is indexed by one integer along its leading dim")
        i = int(index) + (self.shape[0] if index < 0 else 0)
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"index {index} out of range for a leading dim of {self.shape[0]}")
        inner = self.shape[1:]
        return DeviceArray(self.device, self.ptr + i * int(np.prod(inner, dtype=np.int64)) * self.dtype.itemsize,
                           inner, self.dtype)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        host = self.device.download(self.ptr, self.shape, self.dtype)
        return host if dtype is None else host.astype(dtype, copy=False)

    def copy(self) -> np.ndarray:
        """Return a host copy."""
        return np.asarray(self)

    def __float__(self) -> float:  # a 0-d value (a step counter, a scalar state) read as a number
        return float(np.asarray(self))

    def __int__(self) -> int:
        return int(np.asarray(self))

    def view(self, shape: Sequence[int]) -> DeviceArray:
        """Return the same memory seen with another shape of as many elements."""
        return DeviceArray(self.device, self.ptr, tuple(shape), self.dtype)
