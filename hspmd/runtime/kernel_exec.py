"""Running `kernel.fused` ops: compiled C++ on the CPU, or NumPy op by op.

* `kernel_for(op, rank)` (registered for the `kernel` dialect in `plan.KERNELS`) returns a
  function of NumPy arrays. On first use in a program it builds ONE shared library holding
  every kernel of the program (`hspmd/codegen/cpu_compile.py`, cached on disk by content);
  where no compiler is found or the build fails, it says so once and runs the op's body with
  the per-op NumPy kernels instead.
* `select_program(physical, kernels, backend)` is what a runner calls before building plans:
  the compiler fused each group's program once (the bundle's kernel-level IR); "numpy" runs
  the physical program, "cpu" the kernel-level one and builds its library (falling back to
  the physical program, with one line on stderr, when there is no compiler), "cuda" the
  kernel-level one for CuPy (falling back to "cpu", with one line, when CuPy or a GPU is
  missing).
"""

from __future__ import annotations

import ctypes
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.codegen import cpu_compile
from hspmd.codegen.emit_cuda import C_FLOAT, c_type
from hspmd.codegen.schedule.chains import leading_chunks, trailing_broadcasts
from hspmd.dialects import kernel
from hspmd.ir.types import dtype_name
from hspmd.runtime.cpu import native

BACKENDS = ("numpy", "cpu", "cuda")
_SAID: set[str] = set()


class KernelFallbackWarning(RuntimeWarning):
    """A kernel backend is unavailable here; the run goes on with a slower one.

    Not shown by default: `say_once` prints its one line itself. `warnings.filterwarnings(
    "error", category=KernelFallbackWarning)` turns a fallback into an error.
    """


warnings.filterwarnings("ignore", category=KernelFallbackWarning)  # the printed line says it once

def say_once(message: str) -> None:
    """Warn with `message` (one line, `hspmd: ...`) the first time it comes up in this process."""
    if message in _SAID:
        return
    _SAID.add(message)
    warnings.warn(message, KernelFallbackWarning, stacklevel=3)
    print(message, file=sys.stderr)


def _root(op: Operation) -> Operation:
    while op.parent_op() is not None:
        op = op.parent_op()  # type: ignore[assignment]
    return op


def fused_ops(module: Operation) -> list[kernel.FusedOp]:
    """Return every kernel.fused op of `module`, in walk order."""
    return [op for op in module.walk() if isinstance(op, kernel.FusedOp)]


def launch_specs(op: kernel.FusedOp) -> list[cpu_compile.LaunchSpec]:
    """Return the CPU launch specs of `op`: each function it launches (once, however many
    launches it makes of it: a sort's passes) with the C types of its pointer args."""
    t = C_FLOAT[op.dtype.data]
    types = tuple([c_type(v.type) for v in (*op.inputs, *op.outputs)] + [t] * len(op.scratch_sizes))
    kinds = {fname: kind for kind, fname, _, _ in op.launch_list}
    return [cpu_compile.LaunchSpec(kind, fname, types) for fname, kind in kinds.items()]


def build_program(module: Operation, team: bool = False, rank: int = 0) -> Path:
    """Build (or find cached) the one library holding every kernel of `module` as `rank` runs
    them (`kernel.FusedOp.source_for`: a kernel reading its piece's position gets the rank's
    values); return its path.

    `team` adds the blockDim > 1 emulation (`cpu_call(..., team=N)`), for tests."""
    ops = fused_ops(module)
    seen: dict[str, str] = {}
    sources, specs = [], []
    for op in ops:
        name, source = op.kernel.data, op.source_for(rank)
        if name in seen:
            if seen[name] != source:
                raise cpu_compile.CompileError(f"two different kernels are named {name}")
            continue
        seen[name] = source
        sources.append(source)
        specs += launch_specs(op)
    return cpu_compile.build_library(sources, specs, team=team)


#: per module, its library per rank (the same for every rank unless a kernel reads its piece's position)
_PROGRAMS: "weakref.WeakKeyDictionary[Operation, dict[int, cpu_compile.Library | None]]" = weakref.WeakKeyDictionary()


def program_library(module: Operation, rank: int = 0) -> cpu_compile.Library | None:
    """Return the loaded library of `module`'s kernels as `rank` runs them, or None (said once)
    when it cannot be built."""
    per_rank = _PROGRAMS.setdefault(module, {})
    if rank in per_rank:
        return per_rank[rank]
    lib = None
    if cpu_compile.find_compiler() is None:
        say_once("hspmd: no C++ compiler found ($CXX, g++, c++); fused kernels run as NumPy per op")
    else:
        try:
            lib = cpu_compile.load_library(build_program(module, rank=rank))
            native.bind_parallel(lib)  # its launches in chunks on the runtime's threads
        except (cpu_compile.CompileError, OSError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            say_once(f"hspmd: building the CPU kernels failed ({first}); fused kernels run as NumPy per op")
    per_rank[rank] = lib
    return lib


def sample_operands(op: kernel.FusedOp, rng: np.random.Generator) -> list[np.ndarray]:
    """Return random operands for fused op `op` (to check a backend against `numpy_call`):
    integers in [0, the last dim) (indices, labels), floats positive and away from 0 (logs,
    divisions and square roots stay finite), a scalar 0.5. A kernel of one op whose operands must
    agree with each other (a flash attention's backward reads the forward's o and logsumexp)
    takes them from the op's own `sample_operands(rng)`."""
    members = [m for m in op.body.block.ops if not isinstance(m, kernel.YieldOp)]
    own = getattr(members[0], "sample_operands", None) if len(members) == 1 else None
    if callable(own):
        return own(rng)
    args = []
    for v in op.inputs:
        shape, dt = tuple(v.type.get_shape()), str(v.type.element_type)
        if dt.startswith("i"):
            args.append(rng.integers(0, shape[-1] if shape else 1, shape).astype("int" + dt[1:]))
        else:
            a = np.abs(rng.standard_normal(shape)) + 0.1 if shape else np.array(0.5)
            args.append(a.astype({"f32": np.float32, "f64": np.float64}[dt]))
    return args


def numpy_call(op: kernel.FusedOp, rank: int = 0) -> Callable:
    """Return a function running `op`'s body with the per-op NumPy kernels (the reference)."""
    from hspmd.runtime.numpy_ops import kernel_for
    block = op.body.block
    slots = {a: i for i, a in enumerate(block.args)}
    steps = []
    returns: tuple[int, ...] = ()
    for inner in block.ops:
        if isinstance(inner, kernel.YieldOp):
            returns = tuple(slots[v] for v in inner.values)
            continue
        fn = kernel_for(inner, rank)
        for r in inner.results:
            slots[r] = len(slots)
        steps.append((fn, tuple(slots[v] for v in inner.operands), tuple(slots[r] for r in inner.results)))
    n, single = len(slots), len(returns) == 1

    def call(*args):
        env: list = [None] * n
        env[: len(args)] = args
        for fn, ins, outs in steps:
            res = fn(*[env[i] for i in ins])
            if len(outs) == 1:
                env[outs[0]] = res
            else:
                for s, v in zip(outs, res):
                    env[s] = v
        return env[returns[0]] if single else tuple(env[r] for r in returns)

    return call


def cpu_call(op: kernel.FusedOp, lib: cpu_compile.Library, team: int = 1) -> Callable:
    """Return a function running `op`'s launches from `lib` on NumPy arrays.

    `team` > 1 runs row launches with that many emulated threads per block (an OpenMP team,
    real barriers and shuffles): slow, for testing the GPU algorithm on a CPU; `lib` must then
    come from `build_program(module, team=True)`.
    Results are new arrays, or the arrays passed as `out=` (a tuple, one per result).
    """
    if team > 1 and not lib.has_team:
        raise ValueError("team > 1 needs a library built with team=True (build_program(module, team=True))")
    in_types = [(tuple(v.type.get_shape()), np.dtype(dtype_name(v.type))) for v in op.inputs]
    out_types = [(tuple(v.type.get_shape()), np.dtype(dtype_name(v.type))) for v in op.outputs]
    t = np.dtype("float64" if op.dtype.data == "f64" else "float32")  # scratch: the compute type
    scratch = op.scratch_sizes
    launches = [(lib.function(fname), n0, n1) for _, fname, n0, n1 in op.launch_list]
    nptr = len(in_types) + len(out_types) + len(scratch)
    ptr_array = ctypes.c_void_p * nptr
    single = len(out_types) == 1
    name = op.kernel.data

    # The pointers of the last call, reused: a plan calls a kernel on the same arrays every step
    # (its buffers, the parameters), and making a pointer (`np.require`, `a.ctypes.data`: 3.5 us
    # an array) cost more than a small kernel (an Adam update of 256 values: 28 us a call). An
    # array's data never moves, and a weak reference of a freed array is None, so a pointer is
    # reused only for the very array it was taken from. Scalars (0-d operands: a learning rate)
    # are copied into a 0-d array of this call's own, whose pointer never changes.
    ptrs = ptr_array()
    held: list = [None] * nptr  # weak references of the arrays whose pointers `ptrs` holds
    scalars = {k: np.empty((), dt) for k, (shape, dt) in enumerate(in_types) if shape == ()}
    for k, box in scalars.items():
        ptrs[k] = box.ctypes.data

    def point(k: int, a: np.ndarray, given) -> None:
        """Set pointer k to array `a` (made from `given`, the caller's object)."""
        ptrs[k] = a.ctypes.data
        held[k] = weakref.ref(given) if a is given and type(given) is np.ndarray else None

    def call(*args, out=None):
        if len(args) != len(in_types):
            raise TypeError(f"kernel {name} takes {len(in_types)} arrays, got {len(args)}")
        alive = []  # arrays made here (conversions, results, scratch): alive until the launches end
        for k, (a, (shape, dt)) in enumerate(zip(args, in_types)):
            if k in scalars:
                try:
                    scalars[k][()] = a
                except ValueError:
                    raise ValueError(f"kernel {name}: operand {k} is compiled as a scalar, got shape {np.shape(a)}") from None
                continue
            h = held[k]
            if h is not None and h() is a:
                continue
            c = np.require(a, dt, "C")
            if c.shape != shape:
                raise ValueError(f"kernel {name}: operand of shape {c.shape}, compiled for {shape}")
            point(k, c, a)
            alive.append(c)
        if out is None:
            outs = [np.empty(shape, dt) for shape, dt in out_types]
        else:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for k, (o, (shape, dt)) in enumerate(zip(outs, out_types), len(in_types)):
            h = held[k]
            if h is not None and h() is o:
                continue
            if type(o) is not np.ndarray and not isinstance(o, np.ndarray) or o.shape != shape or o.dtype != dt \
                    or not o.flags.c_contiguous:
                raise ValueError(f"kernel {name}: out= must be C-contiguous {dt} arrays of the results' shapes")
            point(k, o, o)
        for k, n in enumerate(scratch, len(in_types) + len(out_types)):
            alive.append(np.empty(n, t))
            point(k, alive[-1], None)
        for fn, n0, n1 in launches:
            fn(ptrs, n0, n1, team)
        del alive
        return outs[0] if single else tuple(outs)

    def chain_desc(*args, out) -> list[int] | None:
        """Return this kernel as steps of a C++ chain (`native/chain.cpp`: each launch on entries
        of the leading dim of every operand and result), or None where an operand is not
        C-contiguous of the compiled dtype. Scalars are copied here, as a call does; an operand
        broadcast onto the trailing dims is passed whole to every slice."""
        lead_shape = out_types[0][0]
        pairs: list[int] = []
        for k, (a, (shape, dt)) in enumerate(zip(args, in_types)):
            if k in scalars:
                scalars[k][()] = a
                pairs += [scalars[k].ctypes.data, 0]
                continue
            if type(a) is not np.ndarray or a.dtype != dt or a.shape != shape or not a.flags.c_contiguous:
                return None
            pairs += [a.ctypes.data, a.strides[0] if shape == lead_shape else 0]
        for o, (shape, dt) in zip((out,) if single else out, out_types):
            if type(o) is not np.ndarray or o.dtype != dt or o.shape != shape or not o.flags.c_contiguous:
                return None
            pairs += [o.ctypes.data, o.strides[0]]
        desc: list[int] = []
        for address, n0, n1 in addresses:
            desc += [1, address, n0 // lead_shape[0], n1, len(pairs) // 2, *pairs]
        return desc

    # the plan may preallocate results (out=); an elementwise kernel reads operand i before it
    # writes result i, so a result may even be an operand's own array (in-place update)
    # a batch chain's member (`codegen/schedule/chains.py`)
    if leading_chunks(in_types, out_types, op.launch_list, scratch, trailing_broadcasts(op)):
        addresses = [(ctypes.cast(fn, ctypes.c_void_p).value, n0, n1) for fn, n0, n1 in launches]
        call.chain_desc = chain_desc  # type: ignore[attr-defined]
    call.accepts_out = True  # type: ignore[attr-defined]
    call.inplace_safe = op.out_facts().inplace_safe  # type: ignore[attr-defined]
    return call


def kernel_for(op: Operation, rank: int = 0) -> Callable:
    """Return the function computing a `kernel.fused` op (compiled CPU code, else NumPy per op)."""
    if not isinstance(op, kernel.FusedOp):
        raise NotImplementedError(f"no runtime for '{op.name}'")
    lib = program_library(_root(op), rank if op.rank_values is not None else 0)
    if lib is None:
        return numpy_call(op, rank)
    return cpu_call(op, lib)


def select_program(physical: ModuleOp | Callable[[], ModuleOp],
                   kernels: ModuleOp | Callable[[], ModuleOp] | None, backend: str = "cpu") -> ModuleOp:
    """Return the module a runner should build plans from for `backend` ("numpy", "cpu", "cuda").

    `physical` is a group's physical program and `kernels` the same program at the kernel
    level (fused by the compiler; None for a bundle written before bundles held it); either may
    be given as a function that loads it, called only if that level is the one chosen (parsing
    a large program's text is the slow part of starting a run).
    "numpy": `physical`. "cpu": `kernels`, its library built now (so a compile failure is
    found before the first step); `physical`, said once, without a compiler, or where the
    build fails. "cuda": `kernels` for the CuPy backend; as "cpu", said once, without CuPy or
    a GPU. Without kernel-level IR: `physical`, said once.
    """
    def load(level):
        return level if isinstance(level, ModuleOp) else level()

    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend '{backend}' (expected one of {', '.join(BACKENDS)})")
    if backend == "numpy":
        return load(physical)
    if kernels is None:
        say_once("hspmd: the bundle holds no kernel-level IR (compiled before kernels were fused by the "
                 "compiler; compile it again to fuse); running NumPy per op")
        return load(physical)
    if backend == "cuda":
        from hspmd.codegen.cupy_backend import gpu_status

        ok, why = gpu_status()
        if ok:
            return load(kernels)
        say_once(f"hspmd: the cuda backend is unavailable ({why}); running on the CPU")
    if cpu_compile.find_compiler() is None:
        say_once("hspmd: no C++ compiler found ($CXX, g++, c++); running NumPy per op")
        return load(physical)
    fused = load(kernels)
    if not fused_ops(fused) or program_library(fused) is None:
        return load(physical)  # nothing fused (no library to build), or the build failed
    return fused
