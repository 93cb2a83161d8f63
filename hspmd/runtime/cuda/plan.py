"""The GPU plan: a device program's schedule bound to one arena of device memory and replayed.

`build_device_plan(fn, rank, device)` schedules the step function of a device program (the
kernel level after `device-kernels`; `build_schedule(..., device=True)`), lays out one arena
(the parameters with their optimizer states, the inputs, the constants, the reused buffers,
the kernels' scratch) and gives every value a fixed place in it: a parameter's own array, a
buffer (a scan iteration's slice of a stacked buffer), a view of its operand (a reshape, a
micro-batch or a layer taken along the leading dim). Every call of a step is then prepared
once with its pointers (`Device.prepare_*`): kernel launches, GEMMs, copies. A step uploads
the batch, runs the calls (captured as one CUDA graph where the device has graphs, after a
first step run call by call), copies assigned values that were not updated in place into
their parameters, and downloads the outputs. While the device runs a step, the host makes
the next batch and queues its upload behind the step (`DevicePlan.run`'s `ahead`). The state (`initial_state`, and what `run`
updates) is `DeviceArray`s in the arena: parameters never leave the device unless read.

The captures are counted (`graphs_captured`); a capture the device refuses (`CaptureError`) is
counted with its reason (`capture_failures`), said once on stderr, and its calls run one by
one, so a run goes on and a test or the GPU check sees it.

Over several ranks, the collectives and a pipeline's sends and receives are *host-staged*:
such a call (`host_staged`) downloads its operands, runs the op's NumPy collective over the
rank's `Communicator` (MPI, as on the CPU: the way ranks that share a GPU, or GPU and CPU
ranks, exchange) and uploads the result into its place; the device calls between two of them
are captured as one CUDA graph each. A pipeline's micro-batch sums are a kernel of their own
(`sum_kernels`). A kernel that reads its piece's global position (a dropout mask, a
vocabulary range) is built with the rank's values (`kernel.FusedOp.source_for`).

Where the ranks of a collective's group sit on distinct GPUs (`runtime/comm/select.py`, the
transport "nccl"), the plan calls the rank's `NcclCommunicator` on the device arrays instead, on
the plan's stream: all-reduces, broadcasts, all-gathers and reduce-scatters whose pieces are
contiguous (along the leading dim, or dims before it of size 1), all-to-alls whose chunks are
(the experts' tokens), and the buckets' sums in their place in the arena; those calls are left
out of the graphs too. The other ops stay host-staged: gathers along inner dims, and a
pipeline's sends and receives (NCCL's are blocking in stream order, where the schedules count
on sends that do not wait).

A bucket summed through NCCL runs on the device's side stream: its start forks the side stream
from the plan's (an event), queues the all-reduce there, and its wait joins it back, so the sum
overlaps the rest of the backward. Where NCCL allows capture (2.9.6 on) its calls, forks and
joins are captured in the step's graph with the rest (the side stream a parallel branch);
otherwise they run between the graphs. A graph must join every fork it holds (else
`cudaErrorStreamCaptureUnjoined`), so a bucket's fork, all-reduce and join are never split
across graphs: buckets summed through NCCL get no poll steps (host calls, which split graphs;
NCCL progresses on its own), and where another host call falls between a bucket's fork and its
join, the three run between the graphs too (`DevicePlan.graph_parts`).

The all-reduce buckets are the CPU plan's (`codegen/schedule/buckets.py`: the same buckets,
so a GPU group and a CPU group make the same collectives): a bucket's flat buffer has a place in
the arena, its members' producers write into it, its start downloads it and starts the
communicator's all-reduce (`runtime.buckets.Bucket`), its polls let that progress, its wait
uploads the sums back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation

from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.model import Destination, Leaf, Schedule, ScheduleError, Step, nbytes
from hspmd.dialects import comm, kernel
from hspmd.ir.init_spec import initial_value
from hspmd.runtime.cuda.device import ALIGN, CaptureError, Call, Device, DeviceArray, KernelSet
from hspmd.runtime.buckets import Bucket, poller
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.comm_kernels import CommKernelError, comm_kernel
from hspmd.runtime.cuda.gemm import gemm_for
from hspmd.runtime.plan import wait_sends
from hspmd.runtime.trace import StepLabel, Tracer, step_label


class DevicePlanError(Exception):
    """The program cannot run on the device as it is (see the module docstring)."""


def _aligned(n: int) -> int:
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class DevicePlan:
    """One rank's step on a device (see the module docstring); the interface of `runtime.plan.Plan`."""

    rank: int
    device: Device
    params: list[Leaf]
    inputs: list[Leaf]
    outputs: list[tuple[str, int]]
    assigns: list[tuple[str, int]]
    #: bytes of the arena: what the step holds on the device, all of it allocated once
    peak_bytes: int = 0
    buffer_bytes: int = 0
    buckets: list = field(default_factory=list)
    #: the step's calls, and per call its trace label (None: no event)
    calls: list[Call] = field(default_factory=list)
    labels: list[StepLabel | None] = field(default_factory=list)
    #: the copies of assigned values into their parameters, after the calls
    assign_copies: list[Call] = field(default_factory=list)
    #: where each parameter, input and output lives
    param_arrays: dict[str, DeviceArray] = field(default_factory=dict)
    input_arrays: dict[str, DeviceArray] = field(default_factory=dict)
    output_arrays: dict[str, DeviceArray] = field(default_factory=dict)
    #: capture the step as one graph after the first step (where the device has graphs)
    use_graph: bool = True
    #: the CUDA graphs captured, and why each refused capture failed (its calls run one by one)
    graphs_captured: int = 0
    capture_failures: list[str] = field(default_factory=list)
    _graph: list[Call] | None = None
    _steps_run: int = 0
    #: the inputs `run`'s `ahead` uploaded for the next step
    _staged: dict | None = None
    _uploads_ahead: bool | None = None

    def initial_state(self, seed: int) -> dict[str, DeviceArray]:
        """Return this rank's pieces of every parameter's initial value, on the device."""
        state: dict[str, DeviceArray] = {}
        for p in self.params:
            full = initial_value(p.init, p.global_shape, p.dtype, p.name, seed)
            array = self.param_arrays[p.name]
            self.device.upload(array.ptr, np.ascontiguousarray(full[p.layout.slices(self.rank, p.global_shape)]))
            state[p.name] = array
        return state

    def local_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return this rank's piece of each input of a global batch (on the host)."""
        out = {}
        for leaf in self.inputs:
            if leaf.name not in batch:
                raise DevicePlanError(f"the batch has no input '{leaf.name}' (it has {', '.join(sorted(batch))})")
            value = np.asarray(batch[leaf.name], dtype=leaf.dtype)
            if value.shape != leaf.global_shape:
                raise DevicePlanError(f"input '{leaf.name}' has shape {value.shape}, the program was compiled "
                                      f"for {leaf.global_shape}")
            out[leaf.name] = np.require(value[leaf.layout.slices(self.rank, leaf.global_shape)], None, "C")
        return out

    def _bind_state(self, state: dict) -> None:
        """Make `state` hold this plan's device arrays, uploading values given as host arrays."""
        for p in self.params:
            mine = self.param_arrays[p.name]
            value = state.get(p.name)
            if value is mine:
                continue
            if isinstance(value, DeviceArray) and value.device is self.device and value.ptr == mine.ptr:
                state[p.name] = mine
                continue
            host = np.ascontiguousarray(np.asarray(value), dtype=mine.dtype)
            if host.size != mine.size:
                raise DevicePlanError(f"parameter '{p.name}' has shape {host.shape}, the program holds {mine.shape}")
            host = host.reshape(mine.shape)  # a scalar state a checkpoint holds as [1] (`opt.step`)
            self.device.upload(mine.ptr, host)
            state[p.name] = mine

    @property
    def uploads_ahead(self) -> bool:
        """Whether `run` can upload the next step's inputs while the step runs (`ahead`): no
        output lives in an input's memory (that upload would overwrite it before it is read).
        Found once: the places are fixed when the plan is built."""
        if self._uploads_ahead is None:
            spans = [(a.ptr, a.ptr + a.nbytes) for a in self.input_arrays.values()]
            self._uploads_ahead = not any(lo < b.ptr + b.nbytes and b.ptr < hi
                                          for b in self.output_arrays.values() for lo, hi in spans)
        return self._uploads_ahead

    def run(self, state: dict, inputs: dict[str, np.ndarray], tracer: Tracer | None = None,
            ahead: Callable[[], dict[str, np.ndarray] | None] | None = None) -> dict[str, np.ndarray]:
        """Run one step: upload `inputs`, run the step's calls, update `state` (device arrays)
        and return the named outputs on the host.

        `ahead` (where `uploads_ahead`) returns the next step's inputs, or None: it is called
        once the step's calls are queued, so the host makes the next batch while the device
        computes, and its upload is queued behind the step (on the same stream: after the
        step's last read of its inputs) before this step's outputs are read. The next `run`
        given that same dict uploads nothing."""
        self._bind_state(state)
        if inputs is not self._staged:
            self._upload_inputs(inputs)
        self._staged = None
        if tracer is not None:
            self._run_traced(tracer)
        elif self._graph is not None:
            for part in self._graph:
                part()
        else:
            for call in self.calls:
                call()
            if self.use_graph:  # the first step ran call by call (kernels compiled, memory touched)
                self._graph = self._captured()
        for copy in self.assign_copies:
            copy()
        self._steps_run += 1
        if ahead is not None and self.uploads_ahead:
            upcoming = ahead()
            if upcoming is not None:
                self._upload_inputs(upcoming)
                self._staged = upcoming
        return {name: np.asarray(array) for name, array in self.output_arrays.items()}

    def _upload_inputs(self, inputs: dict[str, np.ndarray]) -> None:
        for name, array in self.input_arrays.items():
            self.device.upload(array.ptr, np.asarray(inputs[name], dtype=array.dtype))

    def graph_parts(self) -> list[tuple[bool, list[Call]]]:
        """Return the step's calls in order as (True, a run to capture as one graph) and (False,
        a call run between graphs: host-staged, or NCCL where NCCL is not captured). A bucket's
        fork, all-reduce and join (`bucket_side`) stay in one graph: where a call run between
        graphs falls between them, they run between graphs too (a graph joins every fork it holds)."""
        between = [bool(getattr(c, "uncaptured", False)) for c in self.calls]
        sides: dict[int, list[int]] = {}
        for i, call in enumerate(self.calls):
            side = getattr(call, "bucket_side", None)
            if side is not None:
                sides.setdefault(side, []).append(i)
        changed = True
        while changed:  # a bucket moved out of the graphs may split another bucket's span
            changed = False
            for members in sides.values():
                inside = set(range(members[0], members[-1] + 1)) - set(members)
                if not all(between[i] for i in members) and any(between[i] for i in inside):
                    for i in members:
                        between[i] = True
                    changed = True
        parts: list[tuple[bool, list[Call]]] = []
        for call, out in zip(self.calls, between):
            if not out and parts and parts[-1][0]:
                parts[-1][1].append(call)
            else:
                parts.append((not out, [call]))
        return parts

    def replay_text(self) -> str:
        """Return how the step is split for CUDA graphs, for the plan line (the captures happen
        after the first step: `graphs_captured` counts them)."""
        parts = self.graph_parts()
        graphs = sum(1 for captured, _ in parts if captured)
        between = [calls[0] for captured, calls in parts if not captured]
        staged = sum(1 for c in between if getattr(c, "host_staged", False))
        text = f", split into {graphs} CUDA graph{'s' if graphs != 1 else ''} to capture after step 1"
        if between:
            nccl = len(between) - staged
            text += f" between {staged} host-staged{f' and {nccl} NCCL' if nccl else ''} calls"
        return text

    def _captured(self) -> list[Call]:
        """Return the step as graphs and the calls run between them (`graph_parts`), each run
        captured by the device (`Device.capture`); a refused capture is counted and said, and
        its calls run one by one."""
        parts: list[Call] = []
        runs = 0
        for captured, calls in self.graph_parts():
            if not captured:
                parts.extend(calls)
                continue
            runs += 1
            try:
                parts.append(self.device.capture(calls))
                self.graphs_captured += 1
            except CaptureError as err:
                self.capture_failures.append(str(err))
                parts.extend(calls)
        if self.capture_failures:
            print(f"hspmd: rank {self.rank}: {len(self.capture_failures)} of {runs} parts of the step could not be "
                  f"captured as CUDA graphs; they run call by call (first: {self.capture_failures[0]})",
                  file=sys.stderr, flush=True)
        return parts

    def _run_traced(self, tracer: Tracer) -> None:
        """Run the calls uncaptured, each timed by the device (`Device.time_calls`: CUDA events on a GPU)."""
        times = self.device.time_calls(self.calls, tracer.clock)
        tracer.plan_steps(self.labels, [(i, start, end) for i, (start, end) in enumerate(times)])


class _Binder:
    """Lays out a device schedule's arena and prepares its calls (see the module docstring)."""

    def __init__(self, schedule: Schedule, device: Device, kernels: KernelSet, tf32: bool = False,
                 communicator: Communicator | None = None, nccl=None,
                 transport: Callable[[tuple[int, ...]], str] | None = None) -> None:
        self.schedule, self.device, self.kernels, self.tf32 = schedule, device, kernels, tf32
        self.communicator, self.nccl = communicator, nccl
        self.transport = transport or (lambda group: "staged")
        self.types = schedule.slot_types
        self.comm_kernels: dict[tuple[Operation, int | None], Callable] = {}
        self.sends: list[list] = []  # the requests of the step's sends, waited for by its wait-sends step
        sums = {self.types[step.outs[0]] for step in schedule.steps if step.kind == "sum"}
        self.sums = sum_kernels(device, sums, schedule.rank) if sums else {}
        self.variants = microbatch_kernels(device, schedule)
        self.where: dict[int, int] = {}  # slot -> pointer
        self.staged_at: dict[tuple[int, int], int] = {}  # packed all-to-all chunks: (bytes, which) -> pointer
        self.staged_bytes = 0
        self.transposed: set[int] = set()  # slots holding the transpose of their memory's last two dims

    def layout(self) -> tuple[int, dict]:
        """Return (arena bytes, offset of each region: parameters, inputs, constants, buffers,
        results the schedule left unplaced, scratch)."""
        s = self.schedule
        offsets: dict = {}
        size = 0

        def place(key, n: int) -> None:
            nonlocal size
            offsets[key] = size
            size += _aligned(n)

        for p in s.params:
            place(("param", p.name), nbytes(self.types[p.slot]))
        for leaf in s.inputs:
            place(("input", leaf.name), nbytes(self.types[leaf.slot]))
        for c in s.constants:
            place(("constant", c.slot), c.nbytes())
        for i, b in enumerate(s.buffers):
            place(("buffer", i), b)
        for i, spec in enumerate(s.buckets):
            place(("bucket", i), spec.nbytes())
        for i, step in enumerate(s.steps):  # results the schedule left unplaced: a place of their own
            if step.kind in ("op", "stack") and not _is_view(step.op) and step.out is None:
                for o in step.outs:
                    place(("fresh", o), nbytes(self.types[o]))
        place(("scratch",), max((_scratch_bytes(step.op) for step in s.steps if isinstance(step.op, kernel.FusedOp)),
                                default=0))
        return size, offsets

    def bind(self, rank: int) -> DevicePlan:
        s, device = self.schedule, self.device
        size, offsets = self.layout()
        base = device.alloc(size)
        plan = DevicePlan(rank, device, list(s.params), list(s.inputs), list(s.outputs), list(s.assigns),
                          peak_bytes=size, buffer_bytes=sum(s.buffers), buckets=s.bucket_summaries())
        if s.buckets and self.communicator is None:
            raise DevicePlanError("the program's all-reduce buckets need the rank's communicator (build the plan "
                                  "with one)")
        self.buckets = [Bucket(self.communicator, b.group, b.dtype, list(b.shapes), b.blocking)  # type: ignore[arg-type]
                        for b in s.buckets]
        self.bucket_at = [base + offsets[("bucket", i)] for i in range(len(s.buckets))]

        def array(slot: int, ptr: int) -> DeviceArray:
            shape, dtype = self.types[slot]  # type: ignore[misc]
            return DeviceArray(device, ptr, tuple(shape), np.dtype(dtype))

        for p in s.params:
            self.where[p.slot] = base + offsets[("param", p.name)]
            plan.param_arrays[p.name] = array(p.slot, self.where[p.slot])
        for leaf in s.inputs:
            self.where[leaf.slot] = base + offsets[("input", leaf.name)]
            plan.input_arrays[leaf.name] = array(leaf.slot, self.where[leaf.slot])
        for c in s.constants:
            self.where[c.slot] = base + offsets[("constant", c.slot)]
            device.upload(self.where[c.slot], c.array())
        scratch = base + offsets[("scratch",)]
        bucket_bytes = [b.nbytes() for b in s.buckets]
        for step in s.steps:
            label = step_label(step, self.types, bucket_bytes)
            for call in self.step_calls(step, base, offsets, scratch, plan):
                plan.calls.append(call)
                plan.labels.append(label)
        plan.peak_bytes += self.staged_bytes
        for name, slot in s.outputs:
            plan.output_arrays[name] = array(slot, self.where[slot])
        for name, slot in s.assigns:
            target = plan.param_arrays[name]
            if self.where[slot] != target.ptr:
                plan.assign_copies.append(device.prepare_copy(target.ptr, self.where[slot], target.nbytes))
        return plan

    def destination(self, d: Destination, base: int, offsets: dict, plan: DevicePlan) -> int:
        """Return the pointer a result goes to (`Destination` of the schedule)."""
        if d.kind == "param":
            return plan.param_arrays[d.name].ptr
        if d.kind == "bucket":
            return self.bucket_at[d.index] + self._member_offset(d.index, d.member)
        if d.select is not None or d.perm is not None:
            raise DevicePlanError("a result placed in a consumer's layout (a device schedule places none)")
        ptr = base + offsets[("buffer", d.index)]
        if d.at is not None:  # an iteration's slice of a stacked result
            ptr += d.at * nbytes((d.shape, d.dtype))
        return ptr

    def step_calls(self, step: Step, base: int, offsets: dict, scratch: int, plan: DevicePlan) -> list[Call]:
        """Return the calls of one schedule step, after placing its results."""
        if step.kind == "take":  # a micro-batch or a layer along the leading dim: a view
            (src,) = step.ins
            self.where[step.outs[0]] = self.where[src] + step.microbatch * nbytes(self.types[step.outs[0]])
            return []
        if step.kind == "op" and _is_view(step.op):
            self.where[step.outs[0]] = self.where[step.ins[0]]
            if step.op.name == "graph.transpose":  # read by GEMMs as a transpose flag
                self.transposed.add(step.outs[0])
            return []
        if step.kind == "wait-sends":
            return [_host_call(wait_sends(list(self.sends)))]
        if step.kind in ("bucket-start", "bucket-wait", "poll"):
            return self.bucket_calls(step)
        if step.kind not in ("op", "stack", "sum"):
            raise DevicePlanError(f"a schedule step '{step.name or step.kind}' has no GPU runtime")
        for pos, o in enumerate(step.outs):
            if step.out is not None:
                self.where[o] = self.destination(step.out[pos], base, offsets, plan)
            else:
                self.where[o] = base + offsets[("fresh", o)]
        if step.kind == "stack":  # a scan's stacked result: copy the parts not written in place
            out, calls = self.where[step.outs[0]], []
            part = nbytes(self.types[step.ins[0]])
            for i, s in enumerate(step.ins):
                if self.where[s] != out + i * part:
                    calls.append(self.device.prepare_copy(out + i * part, self.where[s], part))
            return calls
        if step.kind == "sum":  # a pipeline's micro-batch sum: the sum kernel of the type
            kernels, fname = self.sums[self.types[step.outs[0]]]
            n = int(np.prod(self.types[step.outs[0]][0], dtype=np.int64))  # type: ignore[index]
            ptrs = [self.where[step.ins[0]], self.where[step.ins[1]], self.where[step.outs[0]]]
            return [self.device.prepare_launch(kernels, fname, "elementwise", n, 0, ptrs)]
        op = step.op
        assert op is not None
        if op.dialect_name() == "comm":
            through = self.nccl_call(op, step)
            return [self.staged(op, step)] if through is None else through
        if isinstance(op, kernel.FusedOp):
            return self.launches(op, step, scratch)
        if getattr(op, "CUDA_GEMM", False):
            shapes = [tuple(self.types[a][0]) for a in step.ins]  # type: ignore[index]
            out_shape, dtype = self.types[step.outs[0]]  # type: ignore[misc]
            flags = (step.ins[0] in self.transposed, step.ins[1] in self.transposed)
            g = gemm_for(op, shapes, tuple(out_shape), np.dtype(dtype), flags, tf32=self.tf32)
            return [self.device.prepare_gemm(g, self.where[step.ins[g.a]], self.where[step.ins[g.b]],
                                             self.where[step.outs[0]])]
        raise DevicePlanError(f"'{op.name}' has no GPU kernel in this program (compile it with device-kernels)")

    def _member_offset(self, index: int, member: int) -> int:
        """Return the byte offset of member `member` in bucket `index`'s flat buffer."""
        view = self.buckets[index].views[member]
        return view.ctypes.data - self.buckets[index].buffer.ctypes.data

    def bucket_calls(self, step: Step) -> list[Call]:
        """Return the calls of a bucket's start (its members copied into its place where their
        producers wrote elsewhere, then the host-staged start), poll, or wait (the sums uploaded;
        its results are views of its place)."""
        device = self.device
        if step.kind == "poll":  # MPI's transfers progress when polled; NCCL's need no poll (a host call)
            staged = [self.buckets[b] for b in step.polls if not self._through_nccl(self.buckets[b])]
            return [_host_call(poller(staged))] if staged else []
        assert step.bucket is not None
        bucket, at = self.buckets[step.bucket], self.bucket_at[step.bucket]
        on_device = self._through_nccl(bucket)
        if step.kind == "bucket-wait":
            for k, o in enumerate(step.outs):
                self.where[o] = at + self._member_offset(step.bucket, k)
            if on_device:  # summed in place on the side stream by its start: the plan's stream joins it
                return [self._nccl(_bucket_side(device.prepare_join(), step.bucket))]

            def wait() -> None:
                bucket.wait()
                device.upload(at, bucket.buffer)

            return [_host_call(wait)]
        calls = []
        for k, a in enumerate(step.ins):
            dst = at + self._member_offset(step.bucket, k)
            if self.where[a] != dst:
                calls.append(device.prepare_copy(dst, self.where[a], bucket.views[k].nbytes))

        if on_device:  # summed on the side stream, overlapping the rest of the backward
            flat = DeviceArray(device, at, bucket.buffer.shape, bucket.dtype)
            nccl, group = self.nccl, bucket.group
            side = device.prepare_on_side(lambda stream: nccl.all_reduce(flat, group, stream=stream))
            return [*calls, self._nccl(_bucket_side(device.prepare_fork(), step.bucket)),
                    self._nccl(_bucket_side(side, step.bucket))]

        def start() -> None:
            np.copyto(bucket.buffer, device.download(at, bucket.buffer.shape, bucket.dtype))
            bucket.start(*bucket.views)

        return [*calls, _host_call(start)]

    def _through_nccl(self, bucket: Bucket) -> bool:
        """Return whether `bucket` is summed through NCCL on the device (its group on distinct GPUs)."""
        return self.nccl is not None and self.transport(bucket.group) == "nccl"

    def nccl_call(self, op: Operation, step: Step) -> list[Call] | None:
        """Return the calls of collective `op` through NCCL on the device arrays, or None where
        its group is not on distinct GPUs or NCCL's flat layout is not the op's (see the module docstring)."""
        if self.nccl is None or len(step.ins) != 1 or len(step.outs) != 1:
            return None
        groups = getattr(op, "rank_groups", None)
        group = groups.group_holding(self.schedule.rank) if groups is not None else None
        if group is None or self.transport(tuple(group)) != "nccl":
            return None
        x, y = (DeviceArray(self.device, self.where[v], tuple(self.types[v][0]), np.dtype(self.types[v][1]))  # type: ignore[index]
                for v in (step.ins[0], step.outs[0]))
        nccl = self.nccl

        def leading(shape, dim: int) -> bool:  # pieces along `dim` are contiguous blocks in order
            return all(n == 1 for n in shape[:dim])

        match op:
            case comm.AllReduceOp():
                return [self._nccl(lambda: nccl.all_reduce(x, group, out=y))]
            case comm.BroadcastOp():
                root = group[op.root.value.data]
                return [self._nccl(lambda: nccl.broadcast(x, group, root, out=y))]
            case comm.AllGatherOp() if leading(x.shape, op.dim.value.data):
                return [self._nccl(lambda: nccl.all_gather(x, group, y))]
            case comm.ReduceScatterOp() if leading(y.shape, op.dim.value.data):
                return [self._nccl(lambda: nccl.reduce_scatter(x, group, y))]
            case comm.AllToAllOp():
                return self.all_to_all_calls(x, y, op.split_dim.value.data, op.concat_dim.value.data, group)
        return None

    def all_to_all_calls(self, x: DeviceArray, y: DeviceArray, split: int, concat: int, group) -> list[Call]:
        """Return the calls of an all-to-all through NCCL, whose chunks are flat and in order:
        where x's chunks along `split` (or y's along `concat`) are not contiguous, they are
        packed into (unpacked from) a staging place of the device by 2-D copies first (after)."""
        n, item = len(group), x.dtype.itemsize
        device, nccl = self.device, self.nccl
        calls: list[Call] = []
        send, recv = x, y
        x_rows = _chunk_rows(x.shape, split, n, item)
        y_rows = _chunk_rows(y.shape, concat, n, item)
        if x_rows[0] > 1:
            send = DeviceArray(device, self.staging(x.nbytes, 0), x.shape, x.dtype)
            calls += _chunk_copies(device, send.ptr, x.ptr, n, x_rows, pack=True)
        if y_rows[0] > 1:
            recv = DeviceArray(device, self.staging(y.nbytes, 1), y.shape, y.dtype)
        calls.append(self._nccl(lambda: nccl.all_to_all(send, group, recv)))
        if y_rows[0] > 1:
            calls += _chunk_copies(device, y.ptr, recv.ptr, n, y_rows, pack=False)
        return calls

    def _nccl(self, call: Call) -> Call:
        """Return `call` (an NCCL call, or a fork or join of the side stream) as the step's
        graphs take it: captured where NCCL allows capture (`NcclCommunicator.captures`), else
        run between the graphs."""
        return call if self.nccl is not None and self.nccl.captures else _uncaptured(call)

    def staging(self, nbytes: int, which: int) -> int:
        """Return a place of `nbytes` for packed chunks (`which`: 0 the sent, 1 the received),
        allocated once per size and counted in the plan's device memory."""
        key = (int(nbytes), which)
        if key not in self.staged_at:
            self.staged_at[key] = self.device.alloc(nbytes)
            self.staged_bytes += _aligned(nbytes)
        return self.staged_at[key]

    def staged(self, op: Operation, step: Step) -> Call:
        """Return the host-staged call of collective `op` (see the module docstring): its
        operands downloaded, the op's NumPy collective over the rank's communicator, its result
        uploaded into its place. A send starts (its request is waited for by the step's last call)."""
        if self.communicator is None:
            raise DevicePlanError(f"'{op.name}' needs the rank's communicator (build the plan with one)")
        key = (op, step.microbatch)
        if key not in self.comm_kernels:
            try:
                k = comm_kernel(op, self.schedule.rank, self.communicator)
            except CommKernelError as err:
                raise DevicePlanError(str(err)) from None
            if step.microbatch is not None and hasattr(k, "for_microbatch"):
                k = k.for_microbatch(step.microbatch)
            self.comm_kernels[key] = k
        k = self.comm_kernels[key]
        if hasattr(k, "pending"):
            self.sends.append(k.pending)
        device = self.device
        ins = [(self.where[a], *self.types[a]) for a in step.ins]  # type: ignore[misc]
        outs = [(self.where[o], *self.types[o]) for o in step.outs]  # type: ignore[misc]

        def call() -> None:
            result = k(*[device.download(ptr, shape, dtype) for ptr, shape, dtype in ins])
            if outs:
                ptr, shape, dtype = outs[0]
                device.upload(ptr, np.asarray(result, dtype=dtype).reshape(shape))

        return _host_call(call)

    def launches(self, op: kernel.FusedOp, step: Step, scratch: int) -> list[Call]:
        """Return the launches of a kernel: operand, result and scratch pointers, then the extents
        (of its micro-batch's variant, where it reads the micro-batch: `microbatch_kernels`)."""
        kernels, launch_list = self.kernels, op.launch_list
        if (op, step.microbatch) in self.variants:
            kernels, launch_list = self.variants[(op, step.microbatch)]
        ptrs = [self.where[a] for a in step.ins] + [self.where[o] for o in step.outs]
        item = 8 if op.dtype.data == "f64" else 4  # scratch of the compute type (float for 16-bit floats), or less
        at = scratch
        for n in op.scratch_sizes:
            ptrs.append(at)
            at += _aligned(n * item)
        return [self.device.prepare_launch(kernels, fname, kind, n0, n1, ptrs)
                for kind, fname, n0, n1 in launch_list]


def _chunk_rows(shape, dim: int, n: int, item: int) -> tuple[int, int, int]:
    """Return how the `n` chunks along `dim` of a contiguous array of `shape` lie in memory:
    (rows, bytes of a chunk's row, bytes between rows); chunk j's rows start j row-bytes in.
    One row: the chunks are contiguous, one after the other."""
    rows = int(np.prod(shape[:dim], dtype=np.int64))
    inner = int(np.prod(shape[dim + 1:], dtype=np.int64)) * item
    return rows, shape[dim] // n * inner, shape[dim] * inner


def _chunk_copies(device: Device, dst: int, src: int, n: int, layout: tuple[int, int, int], pack: bool) -> list[Call]:
    """Return the 2-D copies packing the `n` strided chunks (`_chunk_rows`) at `src` one after the
    other at `dst` (`pack`), or unpacking them from `src` to their rows at `dst`."""
    rows, width, pitch = layout
    out = []
    for j in range(n):
        flat, strided = j * rows * width, j * width
        if pack:
            out.append(device.prepare_copy2d(dst + flat, width, src + strided, pitch, width, rows))
        else:
            out.append(device.prepare_copy2d(dst + strided, pitch, src + flat, width, width, rows))
    return out


def _host_call(call: Call) -> Call:
    """Mark `call` as one the host runs between device calls (never captured in a graph)."""
    call.host_staged = True  # type: ignore[attr-defined]
    return _uncaptured(call)


def _bucket_side(call: Call, bucket: int) -> Call:
    """Mark `call` as part of bucket `bucket`'s sum on the side stream (its fork, all-reduce or
    join), which one graph holds whole or none does (`DevicePlan.graph_parts`)."""
    call.bucket_side = bucket  # type: ignore[attr-defined]
    return call


def _uncaptured(call: Call) -> Call:
    """Mark `call` as one run between the step's graphs, not inside one (a collective)."""
    call.uncaptured = True  # type: ignore[attr-defined]
    return call


def sum_kernels(device: Device, types, rank: int) -> dict:
    """Return, per slot type (shape, dtype) of a pipeline's micro-batch sums, (the kernels, the
    function) adding two arrays of it: `graph.add`'s elementwise GPU kernel, one per dtype."""
    from xdsl.dialects.builtin import ModuleOp, TensorType
    from xdsl.ir import Block

    from hspmd.codegen.emit_cuda import emit_elementwise, float_kind
    from hspmd.dialects import graph
    from hspmd.ir.types import element_type

    by_dtype: dict[np.dtype, str] = {}
    made = []
    for shape, dtype in sorted(types, key=lambda t: (str(t[1]), t[0])):
        dtype = np.dtype(dtype)
        if dtype in by_dtype:
            continue
        name = f"hs_sum_{len(by_dtype)}"
        by_dtype[dtype] = name
        typ = TensorType(element_type(dtype), [1])
        block = Block(arg_types=[typ, typ])
        add = graph.AddOp(block.args[0], block.args[1])
        kind = float_kind(typ, reduced=True) or "f32"
        code = emit_elementwise(name, [add], list(block.args), [add.result], kind, (1,))
        region, body = kernel.make_body([typ, typ])
        inner = add.clone(value_mapper=dict(zip(block.args, body.args)))
        body.add_ops([inner, kernel.YieldOp(inner.result)])
        made.append(kernel.FusedOp(list(block.args), [typ], name, kind, code.source, code.launches, code.scratch,
                                   region))
    kernels = device.kernels(ModuleOp(made), rank)
    out = {}
    for shape, dtype in types:
        name = by_dtype[np.dtype(dtype)]
        out[(shape, dtype)] = (kernels, name)
    return out


def microbatch_kernels(device: Device, schedule: Schedule) -> dict:
    """Return, per (kernel op, micro-batch) of a pipeline's steps whose kernel reads the
    micro-batch it runs on (a dropout mask: `cuda_c.reads_microbatch`), (the kernels, the
    launches) of its variant for that micro-batch, all variants built as one program."""
    from xdsl.dialects.builtin import ModuleOp
    from xdsl.ir import Block

    from hspmd.dialects.cuda_c import for_microbatch, reads_microbatch

    wanted = list(dict.fromkeys((step.op, step.microbatch) for step in schedule.steps
                                if isinstance(step.op, kernel.FusedOp) and step.microbatch is not None
                                and reads_microbatch(step.op.kernel.data, step.op.source.data)))
    if not wanted:
        return {}
    made = []
    for op, mb in wanted:
        launches = [s.data for s in op.launches.data]
        name, source, launches = for_microbatch(op.kernel.data, op.source_for(schedule.rank), launches, mb)
        operands = Block(arg_types=[v.type for v in op.inputs]).args  # stand-ins: only the types are read
        region, _ = kernel.make_body([v.type for v in op.inputs])
        made.append(kernel.FusedOp(list(operands), [r.type for r in op.outputs], name, op.dtype.data, source,
                                   launches, list(op.scratch_sizes), region))
    kernels = device.kernels(ModuleOp(made), schedule.rank)
    return {key: (kernels, variant.launch_list) for key, variant in zip(wanted, made)}


def _is_view(op: Operation | None) -> bool:
    """Return whether a device step of `op` is a view: a reshape, or a transpose its GEMMs read as a flag."""
    return op is not None and (bool(getattr(op, "DEVICE_VIEW", False)) or op.name == "graph.transpose")


def _scratch_bytes(op: kernel.FusedOp) -> int:
    item = 8 if op.dtype.data == "f64" else 4
    return sum(_aligned(n * item) for n in op.scratch_sizes)


def _module_of(fn: func.FuncOp) -> Operation:
    op: Operation = fn
    while op.parent_op() is not None:
        op = op.parent_op()  # type: ignore[assignment]
    return op


def build_device_plan(fn: func.FuncOp, rank: int, device: Device, *, cuda_graph: bool = True,
                      tf32: bool = False, communicator: Communicator | None = None, nccl=None,
                      transport: Callable[[tuple[int, ...]], str] | None = None) -> DevicePlan:
    """Return the plan running step function `fn` of a device program as `rank` on `device`
    (see the module docstring); `cuda_graph=False` runs every step call by call; `tf32`: float32
    products on TF32 tensor cores (the script's `tf32` config key); `communicator`: the rank's,
    for the program's collectives and pipeline sends (host-staged); `nccl`: the rank's
    `NcclCommunicator`, used for the groups that `transport(group)` says are "nccl" (its groups
    are opened here, in one order on every rank)."""
    try:
        schedule = build_schedule(fn, rank, triangular=False, device=True)
    except ScheduleError as err:
        raise DevicePlanError(str(err)) from None
    kernels = device.kernels(_module_of(fn), rank)
    if nccl is not None and transport is not None:
        groups = {tuple(g) for op in fn.walk() if op.dialect_name() == "comm" for g in getattr(op, "rank_groups", ())}
        groups |= {b.group for b in schedule.buckets}
        nccl.open_groups([g for g in groups if transport(g) == "nccl"])
    plan = _Binder(schedule, device, kernels, tf32, communicator, nccl, transport).bind(rank)
    plan.use_graph = cuda_graph
    return plan


__all__ = ["DevicePlan", "DevicePlanError", "build_device_plan"]
