"""Which device each rank of a run uses: `--device cpu|cuda|auto` (or one entry per rank,
`--device cuda,cuda,cpu`), a strategy group's `device=` key, and the GPU of each rank.

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


def device_entries(text: str, n: int) -> list[str]:
    """Return one `--device` entry per rank of an `n`-rank run: `text` is one of cpu|cuda|auto
    for every rank, or a comma-separated list of them with one per rank (`cuda,cuda,cpu`).
    DeviceError, one line, for a list of another length or an unknown entry."""
    entries = [e.strip() for e in str(text).split(",")]
    bad = [e for e in entries if e not in DEVICES]
    if bad:
        raise DeviceError(f"--device {text}: unknown device '{bad[0]}' (each entry is one of {', '.join(DEVICES)})")
    if len(entries) == 1:
        return entries * n
    if len(entries) != n:
        raise DeviceError(f"--device {text} names {len(entries)} ranks but the run has -n {n} "
                          f"(give one entry per rank, or one for all)")
    return entries


def rank_devices(entries: list[str], group_kinds: list[str | None]) -> list[str]:
    """Return "cpu" or "cuda" for every rank, from its `--device` entry (`device_entries`) and
    the `device=` key of its strategy group (None where the group names none).

    A group's key decides where the entry is "auto"; an entry naming the other kind is a
    DeviceError. "auto" with no key is "cuda" only for a run of one rank where a GPU is usable
    (several GPU ranks are asked for by name); a "cuda" rank needs a usable GPU (`resolve_device`).
    """
    if len(entries) != len(group_kinds):
        raise DeviceError(f"{len(entries)} --device entries for a strategy of {len(group_kinds)} ranks")
    kinds = []
    for rank, (entry, key) in enumerate(zip(entries, group_kinds)):
        if key is not None and entry not in ("auto", key):
            raise DeviceError(f"--device puts rank {rank} on '{entry}' but its strategy group says device={key}")
        if entry == "auto":
            entry = key or ("auto" if len(entries) == 1 else "cpu")
        kinds.append(entry)
    if "cuda" in kinds:
        resolve_device("cuda")  # the error where no GPU is usable, said once
    return [resolve_device(k) if k == "auto" else k for k in kinds]


def devices_text(kinds: list[str]) -> str:
    """Return the worker's `--device` value for per-rank `kinds`: "cpu" or "cuda" where every
    rank runs on that kind, else the list (`cuda,cuda,cpu`)."""
    return kinds[0] if len(set(kinds)) == 1 else ",".join(kinds)


def rank_device(text: str, rank: int) -> str:
    """Return the device of `rank` from the worker's `--device` value (`devices_text`)."""
    entries = str(text).split(",")
    if len(entries) == 1:
        return entries[0]
    if not 0 <= rank < len(entries):
        raise DeviceError(f"--device {text} names {len(entries)} ranks; there is no entry for rank {rank}")
    return entries[rank]


def rank_place(kind: str, rank: int):
    """Return where this process runs as `rank` of kind `kind` (`comm.select.RankPlace`): its
    host and, on a GPU rank, the GPU its local rank takes. The emulated device (the test
    switch) is one GPU that every rank of the host shares."""
    from hspmd.runtime.comm.select import place_of_rank

    if kind != "cuda":
        return place_of_rank("cpu", local_rank(rank), 0)
    if emulated():
        return place_of_rank("cuda", local_rank(rank), 1, env={})
    import cupy

    return place_of_rank("cuda", local_rank(rank), cupy.cuda.runtime.getDeviceCount())
