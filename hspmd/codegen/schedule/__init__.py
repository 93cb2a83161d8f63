"""Execution schedules: a physical step function turned, once, into a finished plan of plain data.

`build_schedule(fn, rank)` decides what one rank runs, in which order, into which buffer:

1. **Flatten** (`flatten`): calls inlined, a pipeline stage's `pipeline.run` laid out as its
   schedule's actions, one flat list of nodes over numbered slots.
2. **Bucket the all-reduces** (`buckets`): gradient all-reduces grouped into buckets that
   start as soon as their operands are ready and are waited on just before their first use.
3. **Prefetch the gathers** (`prefetch`): ZeRO-3's all-gathers of a layer's weights start one
   layer ahead (non-blocking) and are waited on where they stood (CPU programs).
4. **Memory** (`memory`): aliasing, liveness, in-place updates, reused buffers, frees and the
   peak bytes, from static facts of each op's kernel (`kernel_facts`).

The result (`model.Schedule`) holds op references but no kernel, array or communicator:
`hspmd.runtime.plan` binds those for its rank and runs it. `analysis` reads schedules for
reports (`memory_report`, `matmul_flops`).
"""

from __future__ import annotations

import os

from xdsl.dialects import func

from hspmd.codegen.schedule.buckets import plan_buckets
from hspmd.codegen.schedule.flatten import flatten
from hspmd.codegen.schedule.memory import assemble
from hspmd.codegen.schedule.model import Schedule
from hspmd.codegen.schedule.prefetch import plan_prefetch
from hspmd.ir.devices import DeviceRange

#: default size of a gradient all-reduce bucket
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


def _devices(fn: func.FuncOp) -> DeviceRange | None:
    """Return the devices of the group module holding `fn` (None when it says nothing)."""
    from hspmd.dialects.levels import DEVICES_ATTR, devices_of

    module = fn.parent_op()
    attr = module.attributes.get(DEVICES_ATTR) if module is not None else None
    return devices_of(attr) if attr is not None else None


def build_schedule(fn: func.FuncOp, rank: int, *, bucket_bytes: int | None = -1,
                   reuse_buffers: bool = True, triangular: bool = True, device: bool = False,
                   prefetch: bool | None = None) -> Schedule:
    """Return the schedule of physical step function `fn` for `rank`.

    `bucket_bytes` is the size of a gradient all-reduce bucket (default: the
    `HSPMD_BUCKET_BYTES` environment variable, else `DEFAULT_BUCKET_BYTES`; None or 0: every
    all-reduce runs blocking where the program has it). `reuse_buffers=False` gives every
    kernel a fresh array each step (for debugging a kernel's `out=` support). `triangular=False`
    marks no matmul for block products (`triangular.py`): every product in full, as written.
    `device=True` schedules a device program (`device-kernels`): every result, scalars too,
    in a buffer allocated once (a GPU step allocates nothing), none placed in a consumer's layout.
    `prefetch` (default: unless the `HSPMD_PREFETCH` environment variable is 0; never for a device
    program) starts ZeRO-3's all-gathers one layer ahead (`prefetch.py`).
    Raises `model.ScheduleError` where `fn` cannot be scheduled.
    """
    if bucket_bytes == -1:
        env = os.environ.get("HSPMD_BUCKET_BYTES")
        bucket_bytes = int(env) if env else DEFAULT_BUCKET_BYTES
    flat = flatten(fn)
    buckets = plan_buckets(flat, rank, _devices(fn), bucket_bytes) if bucket_bytes else []
    if prefetch is None:
        prefetch = os.environ.get("HSPMD_PREFETCH", "1") != "0"
    if prefetch and not device:
        plan_prefetch(flat, rank, _devices(fn))
    return assemble(flat, rank, buckets, reuse_buffers, triangular, device)
