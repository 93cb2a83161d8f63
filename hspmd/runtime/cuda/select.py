"""Which device a run uses: `--device cpu|cuda|auto`, and the GPU of each rank.

"auto" (the default) is "cuda" where CuPy finds a GPU, else "cpu". "cuda" without a usable GPU
is an error (`DeviceError`), never a quiet run on the CPU. A rank takes the GPU of its local
rank modulo the GPUs it sees (after `CUDA_VISIBLE_DEVICES`): more ranks than GPUs share them.

`HSPMD_EMULATE_GPU=1` is a switch for tests only: "cuda" then runs on `EmulatedDevice` (the
CPU build of the same kernels, host memory as device memory), so that CI runs the whole GPU
plan on machines without a GPU. Users never get it by accident: it is only read here, and
only when "cuda" is asked for by name.
"""

from __future__ import annotations

import os

from hspmd.codegen.cupy_backend import gpu_status
from hspmd.runtime.cuda.device import Device, DeviceError

DEVICES = ("cpu", "cuda", "auto")
#: the test switch (see the module docstring)
EMULATION = "HSPMD_EMULATE_GPU"


def emulated() -> bool:
    """Return whether the test switch makes "cuda" runs use the emulated device."""
    return os.environ.get(EMULATION, "") not in ("", "0")


def resolve_device(name: str) -> str:
    """Return "cpu" or "cuda" for `--device name`: "auto" is "cuda" where a GPU is usable.
    DeviceError for "cuda" without one (the switch `HSPMD_EMULATE_GPU` aside)."""
    if name not in DEVICES:
        raise DeviceError(f"unknown device '{name}' (expected one of {', '.join(DEVICES)})")
    if name == "cpu":
        return "cpu"
    ok, why = gpu_status()
    if name == "auto":
        return "cuda" if ok else "cpu"
    if not ok and not emulated():
        raise DeviceError(f"--device cuda: no usable GPU here ({why}); run with --device cpu")
    return "cuda"


def open_device(local_rank: int = 0) -> Device:
    """Return the device a rank's GPU plan runs on: its GPU (local rank modulo the GPUs it
    sees), or the emulated device under the test switch."""
    if emulated():
        from hspmd.runtime.cuda.emulated import EmulatedDevice

        return EmulatedDevice()
    from hspmd.runtime.cuda.cupy_device import CupyDevice

    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    return CupyDevice(local_rank % max(count, 1))


def local_rank(rank: int) -> int:
    """Return the rank's index among the ranks of its host (what MPI launchers say), else `rank`."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return rank
