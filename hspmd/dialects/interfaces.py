"""What an op says about itself: the interfaces of hspmd's ops, one per fact.

An op's knowledge stands beside its IRDL definition, in its family's module
(`dialects/graph/<family>.py`, `dialects/optim.py`), as methods and class constants of the op
class, the way a JAX primitive registers its abstract evaluation, JVP and lowerings and an
MLIR op declares its interfaces. The machinery that uses a fact asks the op for it and never
switches on op names:

| fact | on the op class | asked by |
| --- | --- | --- |
| shape and type rules | `verify_(self)` (IRDL) | every level's verifier |
| sharding rule | `sharding_rule(self) -> OpRule` | `dialects/sharding.py` (`rule_for`, `infer`) |
| gradient | `vjp(self, gs, emit) -> [maker or None per operand]`, or `NO_VJP = "why not"` | `transforms/autodiff.py` |
| NumPy kernel | `numpy_kernel(self, ctx: KernelContext) -> Kernel` | `runtime/numpy_ops.py` (`kernel_for`) |
| kernel facts | `OUT_FACTS = ...` (or `out_facts(self)` where they depend on attributes) | `codegen/schedule/kernel_facts.py` |
| CUDA C | `cuda_expr(self, a, t, stmts, out)` (fusable elementwise) or `cuda_row(self, rk)` (a row kernel); `cuda_kernel(self, name)` (a standalone kernel); or `CUDA_GEMM` (cuBLAS computes it) / `DEVICE_VIEW` (a view on a device) | `codegen/emit_cuda.py`, `fuse-kernels`, `device-kernels` |
| frontend | `FRONTEND = ("name", ...)`: functions of the op's module (or `Tensor` operators) | `frontend/ops.py`, `hspmd` |
| ATen ops | `ATEN = ("aten.erf.default", ...)`: the ATen ops of `torch.export`'s graphs it answers to | `frontend/torch_import.py` (its translators, `frontend/aten.py`) |

`vjp(gs, emit)` gets the gradient of each result (None where a result has none) and an
`emit(op) -> first result` that inserts backward ops; it returns, per operand, a function
making that operand's gradient (None: the operand gets none), called only for operands that
need one. `numpy_kernel(ctx)` returns a function of the operand arrays (several results: a
tuple); it is made once per op when a plan is built, so it may read the op's attributes then
and must not touch xDSL objects when it runs. Kernels marked with the decorators below take
`out=` buffers, which `OUT_FACTS` must say too (a test checks that both agree).

`tests/test_op_facts.py` lists every op with the facts it has and fails where an op lacks one
its level needs. `docs/architecture.md` ("A new op") walks through adding one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from xdsl.ir import Operation, SSAValue

Kernel = Callable[..., Any]
#: makes an operand's gradient when called (see `HasVJP`)
Thunk = Callable[[], SSAValue]
#: inserts a backward op and returns its first result
Emit = Callable[[Operation], SSAValue]


# ----------------------------------------------------------------------------- the interfaces


@runtime_checkable
class HasShardingRule(Protocol):
    """An op that says which operand layouts it accepts and which result layouts follow."""

    def sharding_rule(self) -> Any:  # an `hspmd.dialects.sharding.OpRule`
        ...


@runtime_checkable
class HasVJP(Protocol):
    """A differentiable op: its vector-Jacobian product in terms of other ops."""

    def vjp(self, gs: Sequence[SSAValue | None], emit: Emit) -> list[Thunk | None]:
        ...


@runtime_checkable
class HasNumpyKernel(Protocol):
    """An op the NumPy runtime can run: the reference every other kernel is tested against."""

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        ...


@runtime_checkable
class HasCudaExpr(Protocol):
    """An elementwise op a fused CUDA C kernel can compute: it appends statements that compute
    its results (C variables named `out`) from operand expressions `a` in C type `t`."""

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        ...


@runtime_checkable
class HasCudaRow(Protocol):
    """An op a CUDA C row kernel computes (a reduction over the last dim, one block per row)."""

    def cuda_row(self, rk: Any) -> Any:  # an `hspmd.dialects.cuda_c.RowKernel` -> `RowSource`
        ...


def has_vjp(op: type[Operation] | Operation) -> bool:
    """Return whether `op` (a class or an instance) has a gradient rule."""
    return callable(getattr(op, "vjp", None))


def no_vjp_reason(op: type[Operation] | Operation) -> str | None:
    """Return why `op` has no gradient rule (its `NO_VJP`), None where it does not say."""
    return getattr(op, "NO_VJP", None)


def aten_names(op: type[Operation] | Operation) -> tuple[str, ...]:
    """Return the ATen ops that the PyTorch importer translates into `op` (its `ATEN`, or ())."""
    return tuple(getattr(op, "ATEN", ()))


def frontend_names(op: type[Operation] | Operation) -> tuple[str, ...]:
    """Return the names of the frontend functions that emit `op` (its `FRONTEND`, or ())."""
    return tuple(getattr(op, "FRONTEND", ()))


# ----------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class KernelContext:
    """What an op's NumPy kernel may know of where it runs.

    `rank`: the rank running it (ops whose values depend on where a piece lies in the global
    tensor read their `global_type` layout with it: dropout, a split vocabulary, iota).
    `native`: the runtime's compiled helpers (the module `hspmd.runtime.cpu.native`:
    `scatter_add_rows(out, index, rows) -> bool` and `sum_squares(x) -> float | None`, in one
    C++ pass each, which say False/None where the library is not built or the arrays do not
    fit), or None; a kernel that uses them keeps a NumPy path of its own. A dialect module
    cannot import the runtime, so the runtime hands them over here.
    """

    rank: int = 0
    native: Any = None


@dataclass(frozen=True)
class OutFacts:
    """Whether an op's kernels write into preallocated `out=` arrays, and which operands `out`
    may be (the schedule gives such ops reused buffers, and may update in place).

    `overwrites`:
    * "" — `out` must not be an operand's array;
    * "first" — `out` may be the first operand's array (the kernel reads each element of it
      before writing that element of `out`);
    * "any" — `out` may be any operand's array (NumPy ufuncs: elementwise, any overlap handled).
    """

    takes_out: bool = False
    overwrites: str = ""

    @property
    def inplace_safe(self) -> bool:
        """Return whether `out` may be (at least) the first operand's array."""
        return self.overwrites in ("first", "any")


FRESH = OutFacts()
OUT = OutFacts(True)
FIRST = OutFacts(True, "first")
ANY = OutFacts(True, "any")


def out_facts_of(op: Operation) -> OutFacts:
    """Return the kernel facts `op` declares (`out_facts()` or `OUT_FACTS`; FRESH if neither)."""
    method = getattr(op, "out_facts", None)
    if callable(method):
        return method()
    return getattr(op, "OUT_FACTS", FRESH)


def takes_out(fn: Kernel) -> Kernel:
    """Mark kernel `fn` as accepting `out=` (an array of the result's shape and dtype, or a tuple
    of them for several results: it fills it and returns it); return it."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    return fn


def by_rows(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as parallel along dim 0: rows of its result along dim 0 depend
    only on the same rows of its operands with that leading extent (the plan may run blocks
    of rows on threads)."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    fn.row_parallel = True  # type: ignore[attr-defined]
    return fn


def overwrites_first(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as correct when `out` is its first operand (it reads each element
    of the first operand before writing that element of `out`); return it."""
    fn.inplace_safe = True  # type: ignore[attr-defined]
    return fn


def rowwise(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as row-wise over all leading dims: each row (last dim) of its
    results depends only on the same row of its operands of the result's leading dims, and on
    operands of rank <= 1 (elementwise kernels, softmax or a norm over the last dim). The plan
    may run it by small blocks of rows (cache-sized) and on threads; the bits are the same."""
    by_rows(fn)
    fn.rowwise = True  # type: ignore[attr-defined]
    return fn


def along(axis: int, ndim: int) -> Callable[[Kernel], Kernel]:
    """Return the marker of a kernel that reduces along `axis` of an `ndim`-dimensional result."""
    axis %= ndim
    return rowwise if axis == ndim - 1 else by_rows if axis != 0 else takes_out
