"""The finished execution schedule of one rank: plain data the runtime binds and replays.

A `Schedule` says what runs in which order over numbered slots (one per value), where each
result is written (a reused buffer, a bucket, a parameter's own array, or a fresh array the
kernel allocates), which slots die after each step, and how many bytes all that takes. It
holds op references for the steps that compute an IR op, so the runtime can make their
kernels; it holds no kernel, array or communicator (`hspmd.runtime.plan` binds those).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.ir import Operation

from hspmd.codegen.schedule.kernel_facts import FRESH, OutFacts
from hspmd.ir.layout import Layout

#: (shape, dtype) of a slot; None for a value that is not a tensor
SlotType = tuple[tuple[int, ...], np.dtype] | None


class ScheduleError(Exception):
    """The physical IR cannot be scheduled for this rank (wrong level, missing group, recursion)."""


def nbytes(t: SlotType) -> int:
    """Return the bytes of a value of slot type `t` (0 for None)."""
    if t is None:
        return 0
    shape, dtype = t
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


@dataclass(frozen=True)
class Leaf:
    """A parameter or input: its slot, global shape, layout and dtype (and initialiser)."""

    name: str
    slot: int
    global_shape: tuple[int, ...]
    layout: Layout
    dtype: str
    init: str = ""


@dataclass(frozen=True)
class Constant:
    """A `graph.constant`: slot `slot` holds `value` everywhere in an array of `shape` and `dtype`."""

    slot: int
    shape: tuple[int, ...]
    dtype: str
    value: float

    def array(self) -> np.ndarray:
        """Return the constant's array."""
        return np.full(self.shape, self.value, self.dtype)

    def nbytes(self) -> int:
        """Return the bytes of the constant's array."""
        return nbytes((self.shape, np.dtype(self.dtype)))


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of all-reduces: one flat buffer over `group` holding tensors of `shapes`.

    `blocking`: nothing runs between its start and its wait (a *coalesced* all-reduce, several
    tensors in one collective), or its group reaches other programs (which must all call the
    same kind of collective), so its start sums it with one blocking `all_reduce` and its wait
    only hands out the views: MPI's non-blocking collectives need the rank's polls to
    progress, and with none to make, a blocking one is faster (3 ranks, 2 of them on one
    core, 1.9 MB: 3.1 ms blocking against 9.0 ms started and waited on).
    """

    group: tuple[int, ...]
    dtype: np.dtype
    shapes: tuple[tuple[int, ...], ...]
    blocking: bool = False

    def nbytes(self) -> int:
        """Return the bytes of the bucket's buffer (at least one element)."""
        return max(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes), 1) * self.dtype.itemsize

    def summary(self) -> tuple[tuple[int, ...], int, int]:
        """Return (group, number of tensors, bytes)."""
        return self.group, len(self.shapes), self.nbytes()


@dataclass(frozen=True)
class Destination:
    """Where one result of a step is written (`out=`).

    kind "buffer": a view of shape `shape` and dtype `dtype` at the start of reused buffer
    `index`; "bucket": member `member` of bucket `index`; "param": the array of parameter
    `name` itself (an in-place update).

    A buffer destination with `stored` (`placement.Placement`) is laid out for its consumer:
    the buffer holds a C-contiguous array of shape `stored`, and the result is its slice
    `select` (dim, start, stop; None: all of it) transposed by `perm` (see `view`), or its
    slice `at` along the leading dim (an iteration's value in a scan's stacked result).
    """

    kind: str
    index: int = -1
    member: int = -1
    name: str = ""
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    stored: tuple[int, ...] | None = None
    select: tuple[int, int, int] | None = None
    perm: tuple[int, ...] | None = None
    at: int | None = None

    def view(self, raw: np.ndarray) -> np.ndarray:
        """Return this buffer destination's array in buffer `raw` (bytes)."""
        shape = self.shape if self.stored is None else self.stored
        array = raw[: nbytes((shape, self.dtype))].view(self.dtype).reshape(shape)
        if self.at is not None:  # a view also of a 1-d stack (array[at] would copy a NumPy scalar out)
            array = array[self.at, ...]
        if self.select is not None:
            d, start, stop = self.select
            array = array[(slice(None),) * d + (slice(start, stop),)]
        if self.perm is not None:
            array = array.transpose(self.perm)
        return array


@dataclass(frozen=True)
class Step:
    """One call of the schedule, over slots.

    kind "op": computes IR op `op` (inside a pipeline's forward or backward on micro-batch
    `microbatch`, else `microbatch` is None); "take": slice `microbatch` of its operand along
    the leading dim (a view: a micro-batch, or a layer of a `graph.scan`); "sum": `ins[0] + ins[1]`
    (a pipeline's micro-batch sums); "stack": the `ins` stacked along a new leading dim (a scan's
    stacked result: one slice per iteration);
    "bucket-start" / "bucket-wait": start / wait for bucket `bucket`; "poll": let the buckets
    `polls` progress; "gather-start" / "gather-wait": start the all-gather `op` of its piece
    `ins[0]` into `outs[0]` / wait for it (`ins`: the result and the piece), prefetched gather
    number `gather` (`prefetch.py`); "gather-poll": let the gathers `polls` progress;
    "wait-sends": wait for every send the step started.
    `out` places each result (None: the kernel allocates); `facts` is what the schedule
    assumed of the kernel in placing them; `frees` lists the slots that die after the step.
    `name` is what the step is called in traces (`step_name`: the IR op's name, `kernel.fused
    @NAME` for a fused kernel); `scope` the pipeline function (`pipeline_forward`,
    `pipeline_backward`) whose inlined body holds the step, "" outside a `pipeline.run`.
    `triangle` says which operand of a `graph.matmul` is triangular and how (causal
    attention's products, `triangular.TRIANGLES`; "" for any other step), so that a CPU
    runtime may compute over its non-zero blocks only.
    """

    kind: str
    op: Operation | None
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    microbatch: int | None = None
    out: tuple[Destination, ...] | None = None
    facts: OutFacts = FRESH
    frees: tuple[int, ...] = ()
    bucket: int | None = None
    polls: tuple[int, ...] = ()
    name: str = ""
    scope: str = ""
    triangle: str = ""
    gather: int | None = None


#: the names of the steps that compute no IR op of their own (`step_name`)
KIND_NAMES = {
    "take": "pipeline.take", "sum": "pipeline.sum", "stack": "graph.scan.stack", "bucket-start": "comm.all_reduce.start",
    "bucket-wait": "comm.all_reduce.wait", "poll": "comm.all_reduce.poll", "wait-sends": "comm.send.wait",
    "gather-start": "comm.all_gather.start", "gather-wait": "comm.all_gather.wait", "gather-poll": "comm.all_gather.poll",
}


def step_name(kind: str, op: Operation | None) -> str:
    """Return the name of a step of kind `kind` computing `op` in traces: the op's IR name
    (`graph.matmul`, `comm.all_reduce`), `kernel.fused @NAME` for a fused kernel, else the
    kind's `KIND_NAMES` entry (a bucket's start and wait, a micro-batch sum, the sends' wait)."""
    if kind == "op" and op is not None:
        kernel = op.properties.get("kernel") if op.name == "kernel.fused" else None
        return f"{op.name} @{kernel.data}" if kernel is not None else op.name  # type: ignore[attr-defined]
    return KIND_NAMES.get(kind, kind)


@dataclass(frozen=True)
class Schedule:
    """The finished schedule of one rank's step (see the module docstring)."""

    rank: int
    steps: tuple[Step, ...]
    slot_types: tuple[SlotType, ...]
    params: tuple[Leaf, ...]
    inputs: tuple[Leaf, ...]
    constants: tuple[Constant, ...]
    outputs: tuple[tuple[str, int], ...]
    assigns: tuple[tuple[str, int], ...]
    #: (name, slot) of outputs/assigns read from schedule-owned memory: copied at the end of a step
    copy_out: frozenset[tuple[str, int]]
    #: bytes of each reused buffer
    buffers: tuple[int, ...]
    #: the all-reduce buckets, by index
    buckets: tuple[BucketSpec, ...]
    #: peak bytes during a step: buffers, live kernel-allocated arrays, parameters (with optimizer
    #: state), inputs, constants and all-reduce buckets
    peak_bytes: int
    #: batch chains (`chains.py`), (first, last) step indices: a runtime may run each by slices
    #: of its batch (their values' buffers live to the chain's end)
    chains: tuple[tuple[int, int], ...] = ()

    @property
    def num_slots(self) -> int:
        """Return the number of slots."""
        return len(self.slot_types)

    @property
    def buffer_bytes(self) -> int:
        """Return the bytes of the reused buffers."""
        return sum(self.buffers)

    def bucket_summaries(self) -> list[tuple[tuple[int, ...], int, int]]:
        """Return (group, number of tensors, bytes) of every bucket, in the order they start."""
        order = list(dict.fromkeys(s.bucket for s in self.steps if s.bucket is not None))
        return [self.buckets[b].summary() for b in order]
