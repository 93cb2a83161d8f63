"""Execution plans: a physical step function turned, once, into a flat list of NumPy calls.

`build_plan` reads the IR of one device group's step function for one rank and resolves
everything a step needs: kernels, constants, the rank's communicator groups, where each
parameter and input comes from. `Plan.run` then replays the list each step without looking
at an xDSL object.

What the build does, in order:

1. **Flatten** (`hspmd.codegen.schedule`, the compile-side half, which knows no ranks or kernels;
   here its steps get their kernels). The bodies of `func.call`ed functions (repeated layers) are inlined, so a step
   is one flat list of kernel calls over numbered slots (one slot per SSA value). A pipeline
   stage's `pipeline.run` is laid out the same way: its schedule's actions in order, each the
   forward or the backward inlined on one micro-batch's slices, then the sums over the
   micro-batches in their order (`hspmd.dialects.pipeline`). A `comm.send` starts a
   non-blocking send; one last step waits for them all.
2. **Bucket the all-reduces** (`hspmd.runtime.buckets`): the program's `comm.all_reduce` ops
   over groups inside this program's devices are grouped into buckets of about
   `bucket_bytes`; a bucket starts (non-blocking) as soon as its last operand is computed and
   is waited on just before the first use of any of its results, so gradient communication
   overlaps the rest of the backward pass.
3. **Aliasing and liveness.** Every value has the set of *storages* (memory blocks) it may
   share memory with: a view op (reshape, transpose, broadcast, split, slice) aliases its
   operand; a kernel that writes into a preallocated `out=` buffer owns a fresh storage; any
   other kernel may alias its operands (kept conservative for kernels the plan does not know,
   such as the fused kernels of other dialects). A storage lives from its definition to the
   last use of any value that may alias it.
4. **Buffers by liveness.** Kernels that accept `out=` (NumPy ufuncs, or functions with
   `accepts_out = True`, see `numpy_ops.takes_out`) write into buffers preallocated once
   and reused by storages whose lifetimes do not overlap (best fit by size).
   `Plan.peak_bytes` reports the rank's peak: buffers + the largest sum of live
   kernel-allocated arrays + parameters, inputs and constants.
5. **In place.** An elementwise kernel that may write over its first operand (a ufunc —
   any operand —, or one marked `inplace_safe = True`) writes its result into that
   operand's buffer when the operand dies there (chains such as scale, mask, softmax share
   one buffer). A `graph.assign` of a value computed by an `out=` kernel after the last use
   of the old parameter value writes straight into the parameter's array (Adam's `p, m, v`
   are updated in place); other assigned or output values that live in plan-owned memory
   are copied at the end of the step.
6. **Frees.** Each step lists the slots that die after it, so kernel-allocated arrays are
   released as early as possible.
7. **Rows in blocks and in parallel.** A large row-wise kernel (a ufunc, or one marked
   `rowwise = True`: elementwise, or reducing along the last dim only) runs on blocks of
   rows small enough for the caches (its temporaries too), the blocks spread over `threads`
   threads; one marked `row_parallel = True` (rows along dim 0 independent) runs on `threads`
   blocks of rows. NumPy releases the GIL, and every element is computed as it would be in
   one call (same bits). (Matmuls keep BLAS's own threads: NumPy's batched matmul split
   over Python threads measured slower than BLAS's threads inside each product.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Operation

from hspmd.codegen.schedule import Leaf, PlanError, Schedule, schedule_step
from hspmd.dialects import comm
from hspmd.ir.init_spec import initial_value
from hspmd.ir.types import dtype_name
from hspmd.runtime import kernel_exec
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.nodes import Node, group_of
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.runtime.optim_kernels import kernel_for as optim_kernel_for

# dialect name -> maker of the NumPy function that computes one of its ops on a given rank
KERNELS: dict[str, Callable[[Operation, int], Callable]] = {
    "graph": kernel_for, "optim": optim_kernel_for, "kernel": kernel_exec.kernel_for
}

#: default size of a gradient all-reduce bucket
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
#: results of at least this many bytes are computed by rows on several threads
ROW_PARALLEL_BYTES = 1 << 20
#: a row-wise kernel works on blocks of about this many result elements (stays in cache)
ROW_BLOCK_ELEMENTS = 1 << 15

# ops whose result is a view of their first operand (never written through)
_VIEW_OPS = ("graph.reshape", "graph.transpose", "graph.broadcast", "graph.split", "graph.slice")
# ops that return a fresh array not sharing memory with their operands, without out=
_FRESH_OPS = frozenset({
    "graph.embedding", "graph.embedding_grad", "graph.constant", "graph.cast", "graph.reduce_max",
    "graph.reduce_max_grad", "graph.softmax_cross_entropy", "graph.softmax_cross_entropy_grad",
    "graph.label_mask", "graph.rope", "graph.rope_grad", "graph.rms_norm", "graph.rms_norm_grad",
    "graph.relu_grad", "graph.silu", "graph.silu_grad", "graph.concat", "optim.sum_squares",
    "optim.clip_coef", "comm.all_reduce", "comm.all_gather", "comm.reduce_scatter", "comm.broadcast",
    "comm.all_to_all", "comm.recv", "comm.exchange", "comm.local_split",
})


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

    def initial_state(self, seed: int) -> dict[str, np.ndarray]:
        """Return this rank's pieces of every parameter's initial value."""
        state = {}
        for p in self.params:
            full = initial_value(p.init, p.global_shape, p.dtype, p.name, seed)
            state[p.name] = _contiguous(full[p.layout.slices(self.rank, p.global_shape)])
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
            out[leaf.name] = _contiguous(value[leaf.layout.slices(self.rank, leaf.global_shape)])
        return out

    def run(self, state: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one step on local pieces; update `state` and return the named outputs.

        Parameters updated in place (see the module docstring) are written into the arrays
        of `state` themselves; an array that cannot be written (read-only, another dtype,
        not C-contiguous) is first replaced in `state` by a writeable copy.
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
        env: list = [None] * self.num_slots
        for slot, value in self.constants.items():
            env[slot] = value
        for p in self.params:
            env[p.slot] = state[p.name]
        for leaf in self.inputs:
            env[leaf.slot] = inputs[leaf.name]
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


def _contiguous(x: np.ndarray) -> np.ndarray:
    """Return `x` as a C-contiguous array of the same shape (0-d stays 0-d)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def _comm_kernel(op: Operation, rank: int, communicator: Communicator) -> Callable[..., np.ndarray]:
    """Return the call that performs collective `op` for `rank`."""
    if isinstance(op, comm.SendOp):  # non-blocking: the plan's last step waits for its sends
        dest = {s: d for s, d in comm.groups_of(op.pairs)}.get(rank)
        tag = op.tag_value
        pending: list = []

        def send(x: np.ndarray) -> None:
            if dest is not None:
                pending.append(communicator.isend(x, dest, tag))

        send.pending = pending  # type: ignore[attr-defined]
        return send
    if isinstance(op, comm.RecvOp):
        src = {d: s for s, d in comm.groups_of(op.pairs)}.get(rank)
        shape, dtype, tag = op.result.type.get_shape(), dtype_name(op.result.type), op.tag_value
        return lambda: communicator.recv(np.empty(shape, dtype), src, tag)
    if isinstance(op, comm.ExchangeOp):
        return _exchange_kernel(op, rank, communicator)
    group = group_of(op.rank_groups, rank, op)
    match op:
        case comm.AllReduceOp():
            return lambda x: communicator.all_reduce(_contiguous(x), group)
        case comm.AllGatherOp():
            d = op.dim.value.data
            return lambda x: communicator.all_gather(_contiguous(x), group, d)
        case comm.ReduceScatterOp():
            d = op.dim.value.data
            return lambda x: communicator.reduce_scatter(_contiguous(x), group, d)
        case comm.BroadcastOp():
            root = group[op.root.value.data]
            return lambda x: communicator.broadcast(_contiguous(x), group, root)
        case comm.AllToAllOp():
            s, c = op.split_dim.value.data, op.concat_dim.value.data
            return lambda x: communicator.all_to_all(_contiguous(x), group, s, c)
        case comm.LocalSplitOp():
            d, index, n = op.dim.value.data, group.index(rank), len(group)

            def local_split(x: np.ndarray) -> np.ndarray:
                size = x.shape[d] // n
                return np.ascontiguousarray(np.take(x, np.arange(index * size, (index + 1) * size), axis=d))

            return local_split
        case comm.LocalZeroOp():
            keep = group.index(rank) == 0
            return (lambda x: x) if keep else (lambda x: np.zeros_like(x))
    raise PlanError(f"no runtime for '{op.name}'")


def _exchange_kernel(op: comm.ExchangeOp, rank: int, communicator: Communicator,
                     microbatch: int = 0) -> Callable[..., np.ndarray]:
    """Return the call doing `rank`'s transfers of an exchange, in the op's one global order
    (an exchange over a stage's virtual devices: those of its virtual device in `microbatch`,
    all on the rank itself; the kernel's `for_microbatch(i)` gives micro-batch i's)."""
    shape, dtype = op.result.type.get_shape(), dtype_name(op.result.type)
    me = rank
    if op.microbatch_ranks is not None and op.stage_ranks is not None:
        stage = tuple(op.stage_ranks.get_values())
        me = tuple(op.microbatch_ranks.get_values())[microbatch * len(stage) + stage.index(rank)]
    mine = [(s, d, tuple(slice(a, a + n) for a, _, n in r), tuple(slice(b, b + n) for _, b, n in r))
            for s, d, r in op.transfer_list() if me in (s, d)]
    if me != rank and any(s != d for s, d, _, _ in mine):
        raise PlanError(f"'{op.name}' over virtual devices moves data between them; only local transfers can run")

    def exchange(x: np.ndarray) -> np.ndarray:
        out = np.zeros(shape, dtype)
        for s, d, sr, dr in mine:
            if s == d:
                out[dr] += x[sr]
            elif s == rank:
                communicator.send(_contiguous(x[sr]), d)
            else:
                out[dr] += communicator.recv(np.empty(out[dr].shape, dtype), s)
        return out

    if me != rank:
        exchange.for_microbatch = lambda i: _exchange_kernel(op, rank, communicator, i)  # type: ignore[attr-defined]
    return exchange


def _kernel(op: Operation, rank: int, communicator: Communicator) -> Callable:
    """Return the call that computes `op` on `rank`."""
    if op.dialect_name() == "comm":
        return _comm_kernel(op, rank, communicator)
    if op.dialect_name() in KERNELS:
        return KERNELS[op.dialect_name()](op, rank)
    raise PlanError(f"'{op.name}' cannot run: lower it to {', '.join(KERNELS)} or comm ops first")


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


# ----------------------------------------------------------------------------- rows in parallel

_POOL = None


def _pool(threads: int):
    """Return the process's thread pool for row blocks (grown to `threads - 1` workers)."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="hspmd-rows")
    return _POOL


def _by_rows(kernel: Callable, operand_types: list, result_type, threads: int) -> Callable | None:
    """Return `kernel` run on `threads` blocks of rows (dim 0) of its `out=`, or None if it cannot be.

    An operand of the result's rank and leading extent is cut into the same rows; one of lower
    rank or with a leading extent of 1 broadcasts, and is passed whole; any other shape keeps
    the kernel whole.
    """
    if not (getattr(kernel, "row_parallel", False) is True
            or isinstance(kernel, np.ufunc) and kernel.nout == 1 and kernel.nin == len(operand_types)):
        return None
    shape = result_type[0]
    if len(shape) < 1 or shape[0] < threads:
        return None
    cut = []
    for t in operand_types:
        if t is None:
            return None
        if len(t[0]) == len(shape) and t[0][0] == shape[0]:
            cut.append(True)
        elif len(t[0]) < len(shape) or t[0][0] == 1:
            cut.append(False)
        else:
            return None
    step = -(-shape[0] // threads)
    blocks = [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]
    pool = _pool(threads)

    def by_rows(*args, out):
        def part(lo: int, hi: int):
            return kernel(*[a[lo:hi] if c else a for a, c in zip(args, cut)], out=out[lo:hi])

        _run_spans(pool, part, blocks)
        return out

    by_rows.__name__ = getattr(kernel, "__name__", "kernel")
    by_rows.rows_of = kernel  # type: ignore[attr-defined]
    return by_rows


def _run_spans(pool, part, spans) -> None:
    """Run `part(lo, hi)` for every span: the first on this thread, the others on `pool` (None: none)."""
    futures = [pool.submit(part, lo, hi) for lo, hi in spans[1:]] if pool is not None else []
    part(*spans[0])
    for f in futures:
        f.result()


def _as_rows(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Return a view of `a` as [rows, cols]; AttributeError if that needs a copy."""
    v = a.view()
    v.shape = (rows, cols)
    return v


def _rowwise(kernel: Callable, operand_types: list, result_types: list, threads: int) -> Callable | None:
    """Return `kernel` run by cache-sized blocks of rows (all leading dims merged), spread over
    `threads` threads; None unless the kernel is row-wise (a ufunc, or marked `rowwise = True`).

    An operand with the results' leading dims is cut into the same rows; one of rank <= 1
    broadcasts along rows and is passed whole. An operand that cannot be viewed as rows
    without a copy (a transposed view, say) makes that call run whole.
    """
    if not (getattr(kernel, "rowwise", False) is True
            or isinstance(kernel, np.ufunc) and kernel.nout == 1 and kernel.nin == len(operand_types)):
        return None
    shape = result_types[0][0]
    if any(t is None or t[0] != shape for t in result_types) or not shape:
        return None
    lead, last = (shape[:-1], shape[-1]) if len(shape) > 1 else (shape, 1)
    rows = int(np.prod(lead, dtype=np.int64))
    cols: list[int | None] = []
    for t in operand_types:
        if t is None:
            return None
        s = t[0]
        if len(s) == len(shape) and (s[:-1] == lead if len(shape) > 1 else s == shape):
            cols.append(s[-1] if len(shape) > 1 else 1)
        elif len(s) == 0 or len(shape) > 1 and len(s) == 1:
            cols.append(None)
        else:
            return None
    per_block = max(1, ROW_BLOCK_ELEMENTS // last)
    per_thread = -(-rows // threads)
    spans = [(lo, min(lo + per_thread, rows)) for lo in range(0, rows, per_thread)]
    pool = _pool(threads) if len(spans) > 1 else None
    single = len(result_types) == 1

    def by_blocks(*args, out):
        try:
            views = [a if c is None else _as_rows(a, rows, c) for a, c in zip(args, cols)]
            outs = [_as_rows(o, rows, last) for o in ((out,) if single else out)]
        except AttributeError:  # an operand is not a view of rows: one call on the whole
            return kernel(*args, out=out)

        def part(lo: int, hi: int) -> None:
            for b in range(lo, hi, per_block):
                e = min(b + per_block, hi)
                block_out = outs[0][b:e] if single else tuple(o[b:e] for o in outs)
                kernel(*[v if c is None else v[b:e] for v, c in zip(views, cols)], out=block_out)

        _run_spans(pool, part, spans)
        return out

    by_blocks.__name__ = getattr(kernel, "__name__", "kernel")
    by_blocks.rows_of = kernel  # type: ignore[attr-defined]
    return by_blocks


# ----------------------------------------------------------------------------- flattening


@dataclass
class _Flat:
    """A schedule with its kernels bound for one rank: nodes over the schedule's slots."""

    nodes: list[Node]
    types: list[tuple[tuple[int, ...], np.dtype] | None]
    params: list[Leaf]
    inputs: list[Leaf]
    constants: dict[int, np.ndarray]
    outputs: list[tuple[str, int]]
    assigns: list[tuple[str, int]]


def _bind(schedule: Schedule, rank: int, communicator: Communicator) -> _Flat:
    """Return `schedule` with each step's kernel made for `rank` (`codegen.schedule` decided the steps)."""
    kernels: dict[tuple[Operation, int | None], Callable] = {}

    def kernel(op: Operation, microbatch: int | None) -> Callable:
        """The op's kernel; inside a pipeline's forward or backward, micro-batch `microbatch`'s
        where the kernel depends on it (`for_microbatch`, as a micro-batched dropout's mask)."""
        if (op, None) not in kernels:
            kernels[(op, None)] = _kernel(op, rank, communicator)
        k = kernels[(op, None)]
        if microbatch is None or not hasattr(k, "for_microbatch"):
            return k
        if (op, microbatch) not in kernels:
            kernels[(op, microbatch)] = k.for_microbatch(microbatch)
        return kernels[(op, microbatch)]

    nodes: list[Node] = []
    for step in schedule.steps:
        if step.kind == "op":
            assert step.op is not None
            nodes.append(Node(step.op, kernel(step.op, step.microbatch), step.ins, step.outs))
        elif step.kind == "take":
            nodes.append(Node(None, _take(step.index), step.ins, step.outs, "view"))
        elif step.kind == "add":
            nodes.append(Node(None, np.add, step.ins, step.outs))  # the kernel of graph.add
        else:
            assert step.kind == "wait-sends", step.kind
            nodes.append(Node(None, _wait_sends(nodes), (), (), "poll"))
    return _Flat(nodes, schedule.types, schedule.params, schedule.inputs, schedule.constants, schedule.outputs,
                 schedule.assigns)


def _take(i: int) -> Callable[[np.ndarray], np.ndarray]:
    """Return the view of slice i along the leading dim."""
    return lambda x: x[i]


def _wait_sends(nodes: list[Node]) -> Callable[[], None]:
    """Return the call that waits for every send the plan's send kernels started in this step."""
    pending = [n.kernel.pending for n in nodes if isinstance(n.op, comm.SendOp) and hasattr(n.kernel, "pending")]

    def wait_sends() -> None:
        for requests in pending:
            while requests:
                requests.pop().wait()

    return wait_sends


# ----------------------------------------------------------------------------- building


def _nbytes(t) -> int:
    if t is None:
        return 0
    shape, dtype = t
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def build_plan(
    fn: func.FuncOp, rank: int, communicator: Communicator, *, bucket_bytes: int | None = -1,
    reuse_buffers: bool = True, allocate: bool = True, threads: int | None = None,
) -> Plan:
    """Return the plan that runs physical step function `fn` as `rank`.

    `bucket_bytes` is the size of a gradient all-reduce bucket (default: the
    `HSPMD_BUCKET_BYTES` environment variable, else `DEFAULT_BUCKET_BYTES`; None or 0: every
    all-reduce runs blocking where the program has it). `reuse_buffers=False` gives every kernel a
    fresh array each step (for debugging a kernel's `out=` support). `allocate=False` only
    sizes the buffers (for reports: such a plan cannot run). `threads` (default: the
    `HSPMD_THREADS` environment variable, else 1) is how many threads run a large row-wise
    kernel; matmuls use BLAS's own threads. (On the 2-core machine these were measured on,
    shared with other work, 2 threads did not beat 1.)
    """
    from hspmd.runtime.buckets import plan_buckets

    if bucket_bytes == -1:
        env = os.environ.get("HSPMD_BUCKET_BYTES")
        bucket_bytes = int(env) if env else DEFAULT_BUCKET_BYTES
    flat = _bind(schedule_step(fn), rank, communicator)
    devices = _devices(fn)
    if bucket_bytes:
        plan_buckets(flat, rank, communicator, devices, bucket_bytes)
    if threads is None:
        env = os.environ.get("HSPMD_THREADS")
        threads = int(env) if env else 1
    return _assemble(flat, rank, reuse_buffers, allocate, max(1, threads))


def memory_report(physical) -> str:
    """Return one line per rank of a physical module: its plan's peak bytes per step (and buffers)."""
    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm.inprocess import InProcessCommunicator

    groups = physical_groups(physical)
    world = InProcessCommunicator.create_world(max(max(d) for d, _ in groups) + 1)
    lines = ["plan memory per rank (one step: buffers reused by liveness, live arrays, parameters, inputs):"]
    for devices, module in groups:
        fn = next((op for op in module.body.block.ops if isinstance(op, func.FuncOp)
                   and op.sym_name.data == "train_step"), None)
        if fn is None:
            continue
        for rank in devices:
            plan = build_plan(fn, rank, world[rank], allocate=False)
            lines.append(f"  rank {rank}: peak {plan.peak_bytes:,} bytes ({plan.peak_bytes / 2**20:.1f} MiB), "
                         f"buffers {plan.buffer_bytes:,} bytes, {len(plan.buckets)} all-reduce buckets")
    return "\n".join(lines) + "\n"


def _devices(fn: func.FuncOp) -> frozenset[int] | None:
    """Return the devices of the group module holding `fn` (None when it says nothing)."""
    from hspmd.dialects.levels import DEVICES_ATTR

    module = fn.parent_op()
    attr = module.attributes.get(DEVICES_ATTR) if module is not None else None
    return frozenset(int(d) for d in attr.get_values()) if attr is not None else None  # type: ignore[attr-defined]


def _assemble(flat: _Flat, rank: int, reuse_buffers: bool, allocate: bool = True, threads: int = 1) -> Plan:
    """Return the plan of a flat program: storages, liveness, buffers, in-place updates, frees."""
    memory = _Memory(flat, reuse_buffers)
    memory.liveness()
    memory.update_parameters_in_place()
    memory.reuse_dying_operands()
    memory.pack_buffers()
    plan = Plan(rank, params=flat.params, inputs=flat.inputs, constants=flat.constants, outputs=flat.outputs,
                assigns=flat.assigns, num_slots=len(flat.types))
    memory.emit_steps(plan, allocate, threads)
    memory.count_peak(plan)
    return plan


class _Memory:
    """The memory decisions of one flat program, phase by phase (see the module docstring, 3-6).

    A *storage* is a memory block: "param" (state arrays), "fixed" (inputs, constants, buckets:
    never written by the plan), "pooled" (an out= buffer), "fresh" (kernel-allocated). Each slot
    has the set of storages it may share memory with (`alias`).
    """

    def __init__(self, flat: _Flat, reuse_buffers: bool) -> None:
        self.flat, self.nodes, self.types = flat, flat.nodes, flat.types
        self.kind: list[str] = []
        self.owner: list[int] = []  # the slot a storage was created for
        self.alias: list[frozenset[int]] = [frozenset()] * len(self.types)
        self.param_storage: dict[str, int] = {}
        for p in flat.params:
            self.param_storage[p.name] = s = self._new_storage("param", p.slot)
            self.alias[p.slot] = frozenset({s})
        for leaf in flat.inputs:
            self.alias[leaf.slot] = frozenset({self._new_storage("fixed", leaf.slot)})
        for slot in flat.constants:
            self.alias[slot] = frozenset({self._new_storage("fixed", slot)})
        self.out_capable = [self._storages_of(node, reuse_buffers) for node in self.nodes]
        self.inplace: dict[tuple[int, int], str] = {}  # (node index, result position) -> parameter name
        self.root = list(range(len(self.kind)))  # a storage -> the storage whose buffer it takes over

    def _new_storage(self, k: str, slot: int) -> int:
        self.kind.append(k)
        self.owner.append(slot)
        return len(self.kind) - 1

    def _storages_of(self, node: Node, reuse_buffers: bool) -> bool:
        """Give `node`'s results their storages; return whether it writes into out= buffers."""
        types, alias = self.types, self.alias
        name = node.op.name if node.op is not None else ""
        poolable = (reuse_buffers and node.kind == "op" and accepts_out(node.kernel)
                    and all(types[o] is not None and types[o][0] != () for o in node.outs))
        if node.kind == "bucket-wait":
            fixed = self._new_storage("fixed", node.outs[0] if node.outs else -1)
            for o in node.outs:
                alias[o] = frozenset({fixed})
        elif poolable:
            for pos, o in enumerate(node.outs):
                alias[o] = frozenset({self._new_storage("fixed" if node.into and pos in node.into else "pooled", o)})
        elif name in _VIEW_OPS or node.kind == "view":
            for o in node.outs:
                alias[o] = alias[node.ins[0]]
        else:
            shared = frozenset() if name in _FRESH_OPS else frozenset().union(*(alias[i] for i in node.ins))
            for o in node.outs:
                alias[o] = shared | {self._new_storage("fresh", o)}
        return poolable

    def liveness(self) -> None:
        """Each slot's defining node and last use; each storage's first and last node."""
        flat, n_nodes, n_slots = self.flat, len(self.nodes), len(self.types)
        self.defined = defined = [-1] * n_slots  # node index defining each slot (-1: before the first node)
        self.last_use = last_use = [-1] * n_slots
        for i, node in enumerate(self.nodes):
            for o in node.outs:
                defined[o] = i
                last_use[o] = max(last_use[o], i)
            for a in node.ins:
                last_use[a] = i
        for _, slot in flat.outputs + flat.assigns:
            last_use[slot] = n_nodes  # outputs and assigns are read after the last node
        n_storages = len(self.kind)
        self.s_start = [n_nodes + 1] * n_storages
        self.s_end = s_end = [-1] * n_storages
        for slot in range(n_slots):
            for s in self.alias[slot]:
                s_end[s] = max(s_end[s], last_use[slot])
        for s in range(n_storages):
            o = self.owner[s]
            self.s_start[s] = defined[o] if o >= 0 else -1
            s_end[s] = max(s_end[s], self.s_start[s])

    def update_parameters_in_place(self) -> None:
        """An assigned value computed by an out= kernel after the parameter's last use is written
        straight into the parameter's array."""
        flat, types, nodes = self.flat, self.types, self.nodes
        assigned_once = [name for name, _ in flat.assigns]
        out_slots = {slot for _, slot in flat.outputs}
        slot_uses: dict[int, int] = {}
        for _, slot in flat.assigns:
            slot_uses[slot] = slot_uses.get(slot, 0) + 1
        params_by_name = {p.name: p for p in flat.params}
        for name, slot in flat.assigns:
            p = params_by_name.get(name)
            i = self.defined[slot]
            if (p is None or i < 0 or not self.out_capable[i] or assigned_once.count(name) != 1
                    or slot in out_slots or slot_uses[slot] != 1 or types[slot] != types[p.slot]):
                continue
            last = self.s_end[self.param_storage[name]]
            if (last < i or last == i and inplace_safe(nodes[i].kernel)) and len(self.alias[slot]) == 1:
                self.inplace[(i, nodes[i].outs.index(slot))] = name
                self.alias[slot] = frozenset({self.param_storage[name]})

    def find(self, s: int) -> int:
        """Return the storage whose buffer storage `s` uses."""
        while self.root[s] != s:
            s = self.root[s]
        return s

    def reuse_dying_operands(self) -> None:
        """An elementwise result takes the buffer of an operand that dies there."""
        types, alias, kind, find = self.types, self.alias, self.kind, self.find
        for i, node in enumerate(self.nodes):
            if (not self.out_capable[i] or len(node.outs) != 1 or (i, 0) in self.inplace
                    or not inplace_safe(node.kernel)):
                continue
            o = node.outs[0]
            (so,) = alias[o]
            if kind[so] != "pooled":
                continue
            for a in node.ins if isinstance(node.kernel, np.ufunc) else node.ins[:1]:
                if types[a] != types[o] or len(alias[a]) != 1:
                    continue
                (sa,) = alias[a]
                r = find(sa)
                others = {find(x) for b in node.ins if b != a for x in alias[b]}
                if kind[sa] == "pooled" and self.owner[sa] == a and self.s_end[r] == i and r not in others:
                    self.root[so] = r
                    self.s_end[r] = max(self.s_end[r], self.s_end[so])
                    break

    def pack_buffers(self) -> None:
        """Pack the pooled storages into buffers by liveness (best fit)."""
        owner, defined, s_start = self.owner, self.defined, self.s_start
        pooled = sorted((s for s in range(len(self.kind)) if self.kind[s] == "pooled" and self.root[s] == s
                         and (defined[owner[s]], self.nodes[defined[owner[s]]].outs.index(owner[s]))
                         not in self.inplace),
                        key=lambda s: (s_start[s], s))
        self.buffers: list[int] = []  # bytes of each buffer
        free: list[int] = []  # buffer indices free at the current point
        busy: list[tuple[int, int]] = []  # (end, buffer index)
        self.storage_buffer: dict[int, int] = {}
        for s in pooled:
            need = max(_nbytes(self.types[owner[s]]), 1)
            still = []
            for end, b in busy:
                (free.append(b) if end < s_start[s] else still.append((end, b)))
            busy = still
            fits = [b for b in free if self.buffers[b] >= need]
            if fits:
                b = min(fits, key=lambda b: self.buffers[b])
                free.remove(b)
            else:
                self.buffers.append(need)
                b = len(self.buffers) - 1
            self.storage_buffer[s] = b
            busy.append((self.s_end[s], b))

    def emit_steps(self, plan: Plan, allocate: bool, threads: int) -> None:
        """Append one step per node to `plan`: its kernel, out= buffers and the slots that die."""
        flat, nodes, types, alias = self.flat, self.nodes, self.types, self.alias
        raw = [np.empty(size if allocate else 0, dtype=np.uint8) for size in self.buffers]

        def view(s: int) -> np.ndarray | None:
            if not allocate:
                return None
            shape, dtype = types[self.owner[s]]
            return raw[self.storage_buffer[self.find(s)]][: _nbytes(types[self.owner[s]])].view(dtype).reshape(shape)

        keep = {slot for _, slot in flat.outputs + flat.assigns} | {p.slot for p in flat.params}
        dead_at: list[list[int]] = [[] for _ in range(len(nodes))]
        for slot in range(len(types)):
            if slot not in keep and 0 <= self.last_use[slot] < len(nodes):
                dead_at[self.last_use[slot]].append(slot)
        for i, node in enumerate(nodes):
            kw: dict = {}
            if self.out_capable[i]:
                template: list = []
                places = []
                for pos, o in enumerate(node.outs):
                    name = self.inplace.get((i, pos))
                    if node.into and pos in node.into:
                        template.append(node.into[pos] if allocate else None)
                    elif name is None:
                        (s,) = alias[o]
                        template.append(view(s))
                    else:
                        template.append(None)
                        places.append((pos, name, types[o][0], types[o][1]))
                if places:
                    plan._inplace.append((kw, tuple(template), places))
                else:
                    kw["out"] = template[0] if len(template) == 1 else tuple(template)
            plan.steps.append((self._kernel_of(i, threads), node.ins, node.outs, kw, tuple(dead_at[i])))
        updated = {nodes[i].outs[pos]: name for (i, pos), name in self.inplace.items()}
        plan._copy_out = frozenset(
            (name, slot) for name, slot in flat.outputs + flat.assigns
            if updated.get(slot) != name and any(self.kind[s] != "fresh" for s in alias[slot])
        )
        plan.buckets = [b.summary() for b in self._buckets()]

    def _kernel_of(self, i: int, threads: int) -> Callable:
        """Return node i's kernel, run by blocks of rows (and threads) when its result is large."""
        node, types = self.nodes[i], self.types
        kernel = node.kernel
        if self.out_capable[i] and _nbytes(types[node.outs[0]]) >= ROW_PARALLEL_BYTES:
            operand_types = [types[a] for a in node.ins]
            kernel = (_rowwise(kernel, operand_types, [types[o] for o in node.outs], threads)
                      or (_by_rows(kernel, operand_types, types[node.outs[0]], threads)
                          if threads > 1 and len(node.outs) == 1 else None)
                      or kernel)
        return kernel

    def _buckets(self) -> list:
        return list({id(n.bucket): n.bucket for n in self.nodes if n.bucket is not None}.values())

    def count_peak(self, plan: Plan) -> None:
        """Set the plan's buffer and peak bytes: buffers, the largest sum of live kernel-allocated
        arrays, parameters, inputs, constants and buckets."""
        flat, types, n_nodes = self.flat, self.types, len(self.nodes)
        plan.buffer_bytes = sum(self.buffers)
        persistent = (sum(_nbytes(types[p.slot]) for p in flat.params)
                      + sum(_nbytes(types[leaf.slot]) for leaf in flat.inputs))
        persistent += sum(c.nbytes for c in flat.constants.values())
        persistent += sum(b.nbytes() for b in self._buckets())
        delta = [0] * (n_nodes + 2)
        for s in range(len(self.kind)):
            if self.kind[s] == "fresh" and self.s_start[s] >= 0:
                size = _nbytes(types[self.owner[s]])
                delta[self.s_start[s]] += size
                delta[min(self.s_end[s], n_nodes) + 1] -= size
        live = peak_fresh = 0
        for d in delta:
            live += d
            peak_fresh = max(peak_fresh, live)
        plan.peak_bytes = plan.buffer_bytes + peak_fresh + persistent
