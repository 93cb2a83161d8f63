"""Execution plans: a finished schedule bound to kernels, buffers and communicators, replayed.

`build_plan(fn, rank, communicator)` takes the schedule of one device group's step function
for one rank (`hspmd.codegen.schedule.build_schedule`: calls inlined, pipelines laid out,
all-reduces bucketed, buffers and in-place updates decided) and binds what running needs:
each op's kernel (`KERNELS` by dialect, `comm_kernels` for collectives), the rank's
communicator, the all-reduce buckets (`buckets.Bucket`), and the reused buffers, allocated
once. `Plan.run` then replays the list each step without looking at an xDSL object.

The schedule decides from static facts of each op (`hspmd.codegen.schedule.kernel_facts`)
which kernels write into `out=` buffers and which may overwrite an operand; a bound kernel
that cannot do what its op's facts promise (a test's stand-in, a fused kernel run as NumPy
per op) computes its result fresh and is copied into the buffer. A large row-wise kernel
runs by blocks of rows, on `threads` threads (`rows`).

`Plan.run(state, inputs, tracer)` with a `trace.Tracer` replays the same steps in a second
loop that times each one and hands the timings to the tracer with the steps' labels (their
IR names); without one, the loop is the untimed one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation

from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.buckets import group_of
from hspmd.codegen.schedule.kernel_facts import OutFacts
from hspmd.codegen.schedule.model import Leaf, Schedule, ScheduleError, Step, nbytes
from hspmd.ir.init_spec import initial_value
from hspmd.runtime import kernel_exec
from hspmd.runtime.cpu import native, rows
from hspmd.runtime.cpu.batch_chain import Chain, tile_chains
from hspmd.runtime.cpu.batch_split import BatchSplit, small_batched
from hspmd.runtime.cpu.paired_matmul import PAIR_PRODUCT, ProductPairs, product_size
from hspmd.runtime.cpu.blas_threads import BlasCount, BlasThreads
from hspmd.runtime.buckets import Bucket, poller
from hspmd.runtime.gathers import Gather, gather_poller
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.comm_kernels import CommKernelError, comm_kernel, contiguous
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.runtime.cpu.small_matmul import SmallMatmul
from hspmd.runtime.trace import StepLabel, Tracer, step_label
from hspmd.runtime.cpu.triangular_matmul import triangular_matmul

# dialect name -> maker of the NumPy function that computes one of its ops on a given rank
KERNELS: dict[str, Callable[[Operation, int], Callable]] = {
    "graph": kernel_for, "optim": kernel_for, "kernel": kernel_exec.kernel_for
}


class PlanError(Exception):
    """The physical IR cannot be run by this rank (wrong level, missing group, unknown op)."""


@dataclass
class Plan:
    """The flat program of one rank: `steps` read and write numbered slots.

    A step is `(function, argument slots, result slots, keyword arguments, slots to free)`;
    the keywords hold the preallocated `out=` buffers.
    """

    rank: int
    steps: list[tuple[Callable, tuple[int, ...], tuple[int, ...], dict, tuple[int, ...]]] = field(default_factory=list)
    num_slots: int = 0
    constants: dict[int, np.ndarray] = field(default_factory=dict)
    params: list[Leaf] = field(default_factory=list)
    inputs: list[Leaf] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    assigns: list[tuple[str, int]] = field(default_factory=list)
    #: bytes of the preallocated buffers (reused by liveness)
    buffer_bytes: int = 0
    #: peak bytes this rank holds during a step: buffers, live kernel-allocated arrays,
    #: parameters (with optimizer state), inputs, constants and all-reduce buckets
    peak_bytes: int = 0
    #: all-reduce buckets: (group, number of tensors, bytes), in start order
    buckets: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)
    # (name, slot) of outputs/assigns read from plan-owned memory: copied at the end of a step
    _copy_out: frozenset = frozenset()
    # in-place parameter updates: (keyword dict, out template, [(position, name, shape, dtype)])
    _inplace: list = field(default_factory=list)
    #: per step, what a trace calls it (None: no event); read only by a traced run
    labels: list[StepLabel | None] = field(default_factory=list)
    #: BLAS's thread count chosen per step by measurement (`blas_threads`), or None: BLAS's own
    blas: BlasThreads | None = None

    def initial_state(self, seed: int) -> dict[str, np.ndarray]:
        """Return this rank's pieces of every parameter's initial value."""
        state = {}
        for p in self.params:
            full = initial_value(p.init, p.global_shape, p.dtype, p.name, seed)
            state[p.name] = contiguous(full[p.layout.slices(self.rank, p.global_shape)])
        return state

    def local_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return this rank's piece of each input of a global batch."""
        out = {}
        for leaf in self.inputs:
            if leaf.name not in batch:
                raise PlanError(f"the batch has no input '{leaf.name}' (it has {', '.join(sorted(batch))})")
            value = np.asarray(batch[leaf.name], dtype=leaf.dtype)
            if value.shape != leaf.global_shape:
                raise PlanError(
                    f"input '{leaf.name}' has shape {value.shape}, the program was compiled for {leaf.global_shape}"
                )
            out[leaf.name] = contiguous(value[leaf.layout.slices(self.rank, leaf.global_shape)])
        return out

    def run(self, state: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
            tracer: Tracer | None = None) -> dict[str, np.ndarray]:
        """Run one step on local pieces; update `state` and return the named outputs (on the
        BLAS thread count `blas` picks, when it is set).

        Parameters updated in place (see the module docstring) are written into the arrays
        of `state` themselves; an array that cannot be written (read-only, another dtype,
        not C-contiguous) is first replaced in `state` by a writeable copy. With `tracer`,
        every step is timed and recorded (`Tracer.plan_steps`).
        """
        for kw, template, places in self._inplace:
            outs = list(template)
            for pos, name, shape, dtype in places:
                arr = state[name]
                if (type(arr) is not np.ndarray or arr.dtype != dtype or arr.shape != shape
                        or not arr.flags.c_contiguous or not arr.flags.writeable):
                    arr = state[name] = np.array(arr, dtype=dtype, order="C", copy=True)
                outs[pos] = arr
            kw["out"] = outs[0] if len(outs) == 1 else tuple(outs)
        if self.blas is not None:
            with self.blas.around_step():
                return self._run(state, inputs, tracer)
        return self._run(state, inputs, tracer)

    def _run(self, state: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
             tracer: Tracer | None) -> dict[str, np.ndarray]:
        env: list = [None] * self.num_slots
        for slot, value in self.constants.items():
            env[slot] = value
        for p in self.params:
            env[p.slot] = state[p.name]
        for leaf in self.inputs:
            env[leaf.slot] = inputs[leaf.name]
        if tracer is not None:
            self._run_traced(env, tracer)
        else:
            for fn, args, outs, kw, dead in self.steps:
                result = fn(*[env[a] for a in args], **kw)
                if len(outs) == 1:
                    env[outs[0]] = result
                elif outs:  # several results come back as a tuple
                    for slot, value in zip(outs, result):
                        env[slot] = value
                for slot in dead:
                    env[slot] = None
        copy = self._copy_out
        for name, slot in self.assigns:
            value = env[slot]
            state[name] = np.array(value, copy=True) if (name, slot) in copy else value
        return {name: (np.array(env[slot], copy=True) if (name, slot) in copy else env[slot])
                for name, slot in self.outputs}

    def _run_traced(self, env: list, tracer: Tracer) -> None:
        """Run the steps as `run` does, timing each; record them with `tracer`."""
        clock = tracer.clock
        timings = []
        for i, (fn, args, outs, kw, dead) in enumerate(self.steps):
            start = clock()
            result = fn(*[env[a] for a in args], **kw)
            timings.append((i, start, clock()))
            if len(outs) == 1:
                env[outs[0]] = result
            elif outs:
                for slot, value in zip(outs, result):
                    env[slot] = value
            for slot in dead:
                env[slot] = None
        tracer.plan_steps(self.labels, timings)



def accepts_out(fn: Callable) -> bool:
    """Return whether kernel `fn` can write its result into a preallocated `out=` array.

    True for NumPy ufuncs and for functions marked `fn.accepts_out = True` (which must then
    fill `out` — a tuple of arrays for several results — and return it).
    """
    return isinstance(fn, np.ufunc) or getattr(fn, "accepts_out", False) is True


def inplace_safe(fn: Callable) -> bool:
    """Return whether kernel `fn` may be given an `out=` array that is also one of its operands.

    True for NumPy ufuncs (elementwise; NumPy copies on partial overlap) and for functions
    marked `fn.inplace_safe = True` (elementwise updates such as the optimizers').
    """
    return isinstance(fn, np.ufunc) or getattr(fn, "inplace_safe", False) is True


def _honouring(kernel: Callable, facts: OutFacts) -> Callable:
    """Return `kernel`, or, where it cannot do what `facts` promise the schedule, a function that
    runs it and copies its results into `out=`."""
    if not facts.takes_out or isinstance(kernel, np.ufunc):
        return kernel
    if accepts_out(kernel) and (facts.overwrites == "" or facts.overwrites == "first" and inplace_safe(kernel)):
        return kernel

    def into_out(*args, out):
        result = kernel(*args)
        if isinstance(out, tuple):
            for o, r in zip(out, result):
                np.copyto(o, r)
        else:
            np.copyto(out, result)
        return out

    into_out.__name__ = getattr(kernel, "__name__", "kernel")
    return into_out


class _Binder:
    """Binds a schedule's steps for one rank: kernels (one per op, and per micro-batch where the
    kernel depends on it), buckets and buffers."""

    def __init__(self, schedule: Schedule, communicator: Communicator, allocate: bool, threads: int,
                 split_batches: bool = True, small_matmul: bool = True, pair_products: bool = True,
                 batch_chains: bool = True) -> None:
        self.schedule, self.communicator, self.allocate, self.threads = schedule, communicator, allocate, threads
        self.chains = batch_chains and allocate
        self.split = BatchSplit() if split_batches and allocate else None
        self.pairs = ProductPairs() if pair_products and allocate else None
        self.small = SmallMatmul.create() if small_matmul and allocate and _has_small_batches(schedule) else None
        self.kernels: dict[tuple[Operation, int | None], Callable] = {}
        self.sends: list[list] = []
        self.buckets = [Bucket(communicator, b.group, b.dtype, list(b.shapes), b.blocking) for b in schedule.buckets]
        self.gathers = {s.gather: self._gather(s) for s in schedule.steps if s.kind == "gather-start"}
        self.raw = [np.empty(size if allocate else 0, dtype=np.uint8) for size in schedule.buffers]

    def _gather(self, step: Step) -> Gather:
        """Return the prefetched gather that `gather-start` step `step` starts."""
        op = step.op
        shape, dtype = self.schedule.slot_types[step.outs[0]]  # type: ignore[misc]
        group = group_of(op.rank_groups, self.schedule.rank, op)  # type: ignore[union-attr]
        return Gather(self.communicator, group, op.dim.value.data, shape, dtype)  # type: ignore[union-attr]

    def kernel(self, op: Operation, microbatch: int | None) -> Callable:
        """Return the op's kernel; inside a pipeline's forward or backward, micro-batch
        `microbatch`'s where the kernel depends on it (`for_microbatch`, as a micro-batched dropout's mask)."""
        if (op, None) not in self.kernels:
            self.kernels[(op, None)] = _kernel(op, self.schedule.rank, self.communicator)
        k = self.kernels[(op, None)]
        if microbatch is None or not hasattr(k, "for_microbatch"):
            return k
        if (op, microbatch) not in self.kernels:
            self.kernels[(op, microbatch)] = k.for_microbatch(microbatch)
        return self.kernels[(op, microbatch)]

    def call(self, step: Step) -> Callable:
        """Return the function step `step` calls."""
        match step.kind:
            case "op":
                assert step.op is not None
                if step.op.name == "graph.matmul":
                    return self.matmul(step)
                k = self.kernel(step.op, step.microbatch)
                if hasattr(k, "pending"):  # a send: the step's last call waits for its requests
                    self.sends.append(k.pending)
                return k
            case "take":
                i = step.microbatch
                return lambda x: x[i, ...]  # a view, also of a 1-d stack (x[i] would copy a NumPy scalar out)
            case "sum":
                return np.add
            case "stack":
                return _stack
            case "bucket-start":
                return self.buckets[step.bucket].start  # type: ignore[index]
            case "bucket-wait":
                return self.buckets[step.bucket].wait  # type: ignore[index]
            case "poll":
                return poller([self.buckets[b] for b in step.polls])
            case "gather-start":
                return self.gathers[step.gather].start
            case "gather-wait":
                return self.gathers[step.gather].wait
            case "gather-poll":
                return gather_poller([self.gathers[g] for g in step.polls])
            case "wait-sends":
                return wait_sends(list(self.sends))
        raise PlanError(f"a schedule step of unknown kind '{step.kind}'")

    def matmul(self, step: Step) -> Callable:
        """Return the kernel of a `graph.matmul` step: a batch of small float32 products in one C++
        call (`small_matmul`: triangles skipped by tiles), else NumPy's: over the non-zero blocks of
        a triangular operand (causal attention's products), and a batch of small products by
        halves on two threads (`batch_split`)."""
        assert step.op is not None
        if step.triangle:
            k = triangular_matmul(step.triangle)
        else:
            k = self.kernel(step.op, step.microbatch)
        types = self.schedule.slot_types
        small = small_batched(types[step.ins[0]][0], types[step.ins[1]][0])  # type: ignore[index]
        if self.small is not None and accepts_out(k) and (small or step.triangle):
            return self.small.kernel(step.triangle, k)
        if self.split is not None and accepts_out(k) and small:
            k = self.split.wrap(k)
        return k

    def out(self, step: Step) -> tuple[list, list]:
        """Return the `out=` template of a step (arrays, None where a parameter goes) and its
        in-place parameter places `(position, name, shape, dtype)`."""
        template: list = []
        places = []
        for pos, d in enumerate(step.out or ()):
            if d.kind == "bucket":
                template.append(self.buckets[d.index].views[d.member] if self.allocate else None)
            elif d.kind == "buffer":
                template.append(d.view(self.raw[d.index]) if self.allocate else None)
            else:
                template.append(None)
                places.append((pos, d.name, d.shape, d.dtype))
        return template, places

    def bind(self) -> Plan:
        """Return the plan of the schedule."""
        s = self.schedule
        plan = Plan(s.rank, params=list(s.params), inputs=list(s.inputs),
                    constants={c.slot: c.array() for c in s.constants}, outputs=list(s.outputs),
                    assigns=list(s.assigns), num_slots=s.num_slots, buffer_bytes=s.buffer_bytes,
                    peak_bytes=s.peak_bytes, buckets=s.bucket_summaries(), _copy_out=s.copy_out)
        types = s.slot_types
        bucket_bytes = [b.nbytes() for b in s.buckets]
        for step in s.steps:
            plan.labels.append(step_label(step, types, bucket_bytes))
            kernel = self.call(step)
            kw: dict = {}
            if step.out is not None:
                kernel = _honouring(kernel, step.facts)
                template, places = self.out(step)
                if places:
                    plan._inplace.append((kw, tuple(template), places))
                else:
                    kw["out"] = template[0] if len(template) == 1 else tuple(template)
                if nbytes(types[step.outs[0]]) >= rows.ROW_PARALLEL_BYTES:
                    kernel = rows.by_rows_or_blocks(kernel, [types[a] for a in step.ins], [types[o] for o in step.outs],
                                                    self.threads)
            plan.steps.append((kernel, step.ins, step.outs, kw, step.frees))
        if self.pairs is not None:
            self.pair_products(plan)
        if self.chains and self.schedule.chains:
            self.batch_chains(plan)
        return plan

    def batch_chains(self, plan: Plan) -> None:
        """Run the schedule's batch chains (attention's products and softmax) by slices of their
        batch, each as one step (`batch_chain`)."""
        steps = self.schedule.steps
        lib = native.library()

        def fused_kernel(i: int) -> Callable | None:
            step = steps[i]
            return self.kernel(step.op, step.microbatch) if step.op is not None else None

        def label(chain: Chain, first: int, last: int) -> StepLabel:
            names = [lab.name for lab in plan.labels[first:last + 1]
                     if lab is not None and lab.name not in ("graph.transpose", "graph.reshape", "graph.split")]
            head = plan.labels[first]
            return StepLabel("kernel.batch_chain", "kernel", {"steps": names, "per_slice": chain.per_slice},
                             scope=head.scope if head is not None else "")

        tile_chains(plan.steps, plan.labels, self.schedule, fused_kernel,
                    lib.hs_chain_run if lib is not None else None, BlasCount().get, label)

    def pair_products(self, plan: Plan) -> None:
        """Run adjacent large independent 2-D products (a layer's input and weight gradients)
        at once on two threads, one BLAS thread each (`paired_matmul`)."""
        assert self.pairs is not None
        types, steps = self.schedule.slot_types, self.schedule.steps

        def size(i: int) -> int:
            step = steps[i]
            if step.kind != "op" or step.op is None or step.triangle or len(step.ins) != 2 or len(step.outs) != 1:
                return 0
            a, b, r = (types[s] for s in (*step.ins, step.outs[0]))
            if a is None or b is None or r is None or r[1] not in (np.float32, np.float64) \
                    or not isinstance(plan.steps[i][3].get("out"), np.ndarray):
                return 0
            return product_size(step.op.name, a[0], b[0])

        i = 0
        while i + 1 < len(steps):
            if size(i) >= PAIR_PRODUCT and size(i + 1) >= PAIR_PRODUCT \
                    and not set(steps[i].outs) & set(steps[i + 1].ins):
                (fa, ia, oa, kwa, da), (fb, ib, ob, kwb, db) = plan.steps[i], plan.steps[i + 1]
                launch, join = self.pairs.pair(fa, kwa, fb, kwb)
                plan.steps[i], plan.steps[i + 1] = (launch, ia, oa, kwa, da), (join, ib, ob, kwb, db)
                i += 2
            else:
                i += 1


def _has_small_batches(schedule: Schedule) -> bool:
    """Return whether a matmul step of `schedule` is a batch of small float32 products or has a
    triangular operand (what `SmallMatmul` computes)."""
    types = schedule.slot_types
    for step in schedule.steps:
        if step.op is None or step.op.name != "graph.matmul" or len(step.ins) != 2:
            continue
        a, b = types[step.ins[0]], types[step.ins[1]]
        if a is not None and b is not None and a[1] == np.float32 and (step.triangle or small_batched(a[0], b[0])):
            return True
    return False


def _kernel(op: Operation, rank: int, communicator: Communicator) -> Callable:
    """Return the call that computes `op` on `rank`."""
    if op.dialect_name() == "comm":
        try:
            return comm_kernel(op, rank, communicator)
        except CommKernelError as err:
            raise PlanError(str(err)) from None
    if op.dialect_name() in KERNELS:
        return KERNELS[op.dialect_name()](op, rank)
    raise PlanError(f"'{op.name}' cannot run: lower it to {', '.join(KERNELS)} or comm ops first")


def _stack(*parts: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Return `parts` stacked along a new leading dim (into `out` when given): a scan's stacked
    result. A part that its op already wrote into its slice of `out` (`placement.py`) is not copied."""
    if out is None:
        return np.stack(parts)
    for i, part in enumerate(parts):
        slot = out[i, ...]  # a view, also of a 1-d stack
        if not (part.__array_interface__["data"][0] == slot.__array_interface__["data"][0]
                and part.strides == slot.strides and part.shape == slot.shape and part.dtype == slot.dtype):
            np.copyto(slot, part)
    return out


_stack.accepts_out = True  # type: ignore[attr-defined]


def wait_sends(pending: list[list]) -> Callable[[], None]:
    """Return the call that waits for every send the plan's send kernels started in this step."""

    def wait() -> None:
        for requests in pending:
            while requests:
                requests.pop().wait()

    return wait


def bind_plan(schedule: Schedule, communicator: Communicator, *, allocate: bool = True,
              threads: int | None = None, blas_threads: str | None = None, split_batches: bool = True,
              small_matmul: bool = True, pair_products: bool = True, batch_chains: bool = True) -> Plan:
    """Return the plan running `schedule` over `communicator` (see `build_plan`)."""
    if threads is None:
        env = os.environ.get("HSPMD_THREADS")
        threads = int(env) if env else 1
    plan = _Binder(schedule, communicator, allocate, max(1, threads), split_batches, small_matmul,
                  pair_products, batch_chains).bind()
    choice = blas_threads or os.environ.get("HSPMD_BLAS_THREADS") or "fixed"
    if choice not in ("auto", "fixed"):
        raise PlanError(f"BLAS threads '{choice}': expected auto or fixed (HSPMD_BLAS_THREADS)")
    if choice == "auto" and allocate:
        plan.blas = BlasThreads()
    return plan


def build_plan(
    fn: func.FuncOp, rank: int, communicator: Communicator, *, bucket_bytes: int | None = -1,
    reuse_buffers: bool = True, allocate: bool = True, threads: int | None = None, blas_threads: str | None = None,
    triangular: bool = True, split_batches: bool = True, small_matmul: bool = True, pair_products: bool = True,
    batch_chains: bool = True,
) -> Plan:
    """Return the plan that runs physical step function `fn` as `rank`.

    `bucket_bytes`, `reuse_buffers` and `triangular` are the schedule's (`build_schedule`). `allocate=False`
    only sizes the buffers (for reports: such a plan cannot run). `threads` (default: the
    `HSPMD_THREADS` environment variable, else 1) is how many threads run a large row-wise
    kernel; matmuls use BLAS's own threads. (On the 2-core machine these were measured on,
    shared with other work, 2 threads did not beat 1.)
    `blas_threads` (default: the `HSPMD_BLAS_THREADS` environment variable, else "fixed"):
    "auto" runs each step's matmuls on BLAS's thread count or on one thread, whichever the
    last steps measured faster (`blas_threads.BlasThreads`: a machine shared with other work
    can make BLAS's threads several times slower than one); "fixed" leaves BLAS as it is.
    Under "auto" the bits of a product can depend on the choice where OpenBLAS picks another
    kernel for another thread count (seen on a 33x1000 @ 1000x65 product, not on GPT-tiny's).
    `triangular` (default True): causal attention's products (`Step.triangle`) computed on
    their non-zero blocks only (`triangular_matmul`); False: every matmul in full, as written.
    `split_batches` (default True): a batch of small products (attention's) by halves of the
    batch on two threads with one BLAS thread each, where BLAS has two or more (`batch_split`).
    `small_matmul` (default True): batches of small float32 products, and products with a
    triangular operand, in one C++ call each (`small_matmul`: the bits of `np.matmul` on
    attention's shapes; where there is no C++ compiler, NumPy's as above); it takes the place of
    `split_batches` for those products.
    `pair_products` (default True): two adjacent large products that do not read each other (a
    layer's input and weight gradients) at once on two threads, one BLAS thread each, where BLAS
    has two or more (`paired_matmul`; the bits of the two calls on GPT's shapes).
    `batch_chains` (default True): a chain of batched steps over one leading dim (causal
    attention's products and softmax) as one step running all of them on a slice of the batch,
    then the next slice, so that a slice's intermediates stay in the caches (`batch_chain`; the
    same bits).
    """
    try:
        schedule = build_schedule(fn, rank, bucket_bytes=bucket_bytes, reuse_buffers=reuse_buffers,
                                  triangular=triangular)
    except ScheduleError as err:
        raise PlanError(str(err)) from None
    return bind_plan(schedule, communicator, allocate=allocate, threads=threads, blas_threads=blas_threads,
                     split_batches=split_batches, small_matmul=small_matmul, pair_products=pair_products,
                     batch_chains=batch_chains)
