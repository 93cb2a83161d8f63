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
their parameters, and downloads the outputs. The state (`initial_state`, and what `run`
updates) is `DeviceArray`s in the arena: parameters never leave the device unless read.

What this plan does not do yet (a PlanError names it): collectives and buckets (more than one
rank: GPU runs over several ranks are part 2), pipeline micro-batch sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation

from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.model import Destination, Leaf, Schedule, ScheduleError, Step, nbytes
from hspmd.dialects import kernel
from hspmd.ir.init_spec import initial_value
from hspmd.runtime.cuda.device import ALIGN, Call, Device, DeviceArray, KernelSet
from hspmd.runtime.cuda.gemm import gemm_for
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
    _graph: Call | None = None
    _steps_run: int = 0

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
            out[leaf.name] = np.ascontiguousarray(value[leaf.layout.slices(self.rank, leaf.global_shape)])
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

    def run(self, state: dict, inputs: dict[str, np.ndarray], tracer: Tracer | None = None) -> dict[str, np.ndarray]:
        """Run one step: upload `inputs`, run the step's calls, update `state` (device arrays)
        and return the named outputs on the host."""
        self._bind_state(state)
        for name, array in self.input_arrays.items():
            self.device.upload(array.ptr, np.asarray(inputs[name], dtype=array.dtype))
        if tracer is not None:
            self._run_traced(tracer)
        elif self._graph is not None:
            self._graph()
        else:
            for call in self.calls:
                call()
            if self.use_graph:  # the first step ran call by call (kernels compiled, memory touched)
                self._graph = self.device.capture(self.calls)
        for copy in self.assign_copies:
            copy()
        self._steps_run += 1
        return {name: np.asarray(array) for name, array in self.output_arrays.items()}

    def _run_traced(self, tracer: Tracer) -> None:
        """Run the calls uncaptured, each timed by the device (`Device.time_calls`: CUDA events on a GPU)."""
        times = self.device.time_calls(self.calls, tracer.clock)
        tracer.plan_steps(self.labels, [(i, start, end) for i, (start, end) in enumerate(times)])


class _Binder:
    """Lays out a device schedule's arena and prepares its calls (see the module docstring)."""

    def __init__(self, schedule: Schedule, device: Device, kernels: KernelSet, tf32: bool = False) -> None:
        self.schedule, self.device, self.kernels, self.tf32 = schedule, device, kernels, tf32
        self.types = schedule.slot_types
        self.where: dict[int, int] = {}  # slot -> pointer
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
                          peak_bytes=size, buffer_bytes=sum(s.buffers))

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
        if d.kind != "buffer":
            raise DevicePlanError("all-reduce buckets on the GPU come with runs over several GPUs")
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
        if step.kind not in ("op", "stack"):
            raise DevicePlanError(f"a schedule step '{step.name or step.kind}': GPU runs of it come with runs "
                                  "over several GPUs")
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
        op = step.op
        assert op is not None
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

    def launches(self, op: kernel.FusedOp, step: Step, scratch: int) -> list[Call]:
        """Return the launches of a kernel: operand, result and scratch pointers, then the extents."""
        ptrs = [self.where[a] for a in step.ins] + [self.where[o] for o in step.outs]
        item = 8 if op.dtype.data == "f64" else 4  # scratch of the compute type (float for 16-bit floats), or less
        at = scratch
        for n in op.scratch_sizes:
            ptrs.append(at)
            at += _aligned(n * item)
        return [self.device.prepare_launch(self.kernels, fname, kind, n0, n1, ptrs)
                for kind, fname, n0, n1 in op.launch_list]


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
                      tf32: bool = False) -> DevicePlan:
    """Return the plan running step function `fn` of a device program as `rank` on `device`
    (see the module docstring); `cuda_graph=False` runs every step call by call; `tf32`: float32
    products on TF32 tensor cores (the script's `tf32` config key)."""
    try:
        schedule = build_schedule(fn, rank, bucket_bytes=None, triangular=False, device=True)
    except ScheduleError as err:
        raise DevicePlanError(str(err)) from None
    if schedule.buckets:
        raise DevicePlanError("all-reduce buckets on the GPU come with runs over several GPUs")
    kernels = device.kernels(_module_of(fn))
    plan = _Binder(schedule, device, kernels, tf32).bind(rank)
    plan.use_graph = cuda_graph
    return plan


__all__ = ["DevicePlan", "DevicePlanError", "build_device_plan"]
