"""What an op's CUDA C is written with: C types and literals, kernel sources, row-kernel templates.

An op gives its CUDA C beside its definition (`dialects/interfaces.py`): an elementwise op a
`cuda_expr` (statements over C variables, fused into chains by `fuse-kernels`), a row op a
`cuda_row` (a kernel template with one block per row). `hspmd.codegen.emit_cuda` assembles
the kernels from them. Sources are written against the portability layer that
`codegen/cuda_preamble.cuh` (NVRTC) and `codegen/cuda_emu.h` (the host C++ build) define.

The arithmetic follows the op's NumPy kernel operation by operation, in the operands' float
type, with Python-float constants rounded to that type first as NumPy's weak scalars are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xdsl.dialects.builtin import BFloat16Type, Float16Type, Float32Type, Float64Type, IntegerType, TensorType
from xdsl.ir import Operation, SSAValue

#: the C type a kernel computes in, per float kind (16-bit floats are stored as such, computed in float)
C_FLOAT = {"f32": "float", "f64": "double", "bf16": "float", "f16": "float"}
#: the C storage type of a 16-bit float kind (`codegen/hs_float16.cuh`), and its rounding function
C_STORAGE = {"bf16": "hs_bf16", "f16": "hs_half"}
C_ROUND = {"bf16": "hs_round_bf16", "f16": "hs_round_half"}
REDUCED = frozenset(C_STORAGE)
COMPUTE_OF_STORAGE = {C_STORAGE[k]: C_FLOAT[k] for k in C_STORAGE}


class EmitError(Exception):
    """An op or operand the emitter cannot turn into CUDA C (the pass leaves it unfused)."""


@dataclass
class KernelCode:
    """A kernel's CUDA C source, its launches (`"KIND NAME N0 N1"`) and its scratch buffer sizes.

    `rank_values`: the kernel of an op whose piece depends on the rank (a dropout mask, a
    vocabulary range, a literal's piece: see `rank_value`) reads macros `NAME_RV0`, ...; this
    maps each rank of the op's layout to their values. The source defines them for a rank
    holding the whole tensor (`rank_defaults`); a rank's run defines its own first (`rank_prelude`).
    """

    source: str
    launches: list[str]
    scratch: list[int] = field(default_factory=list)
    rank_values: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Prologue:
    """An elementwise chain computing a row op's main operand, to be computed inside the row
    kernel wherever the kernel reads that operand instead of being stored and read back."""

    members: list[Operation]
    inputs: list[SSAValue]
    output: SSAValue


@dataclass(frozen=True)
class RowKernel:
    """What a row op's `cuda_row` gets: the kernel's `name`, the C float type `t`, the extents
    (`rows` blocks of `cols`), and the prologue computing its first operand (or None).

    `cuda_row` returns a `KernelCode` whose source is a template: `T` the float type, and where
    it reads its first operand `XPARAM` (the parameter), `XDECL` (the row pointer's declaration)
    and `XLOAD[j]` (element j of row r), which the emitter fills for a plain operand or a prologue.
    """

    name: str
    t: str
    rows: int
    cols: int
    prologue: Any = None

    def fill(self, template: str, **kw: str) -> str:
        """Return `template` with `{name}`, `{rows}`, `{cols}` and the `kw` placeholders filled."""
        return fill(template, name=self.name, rows=str(self.rows), cols=str(self.cols), **kw)

    def launch(self) -> list[str]:
        """Return the one `row` launch of a kernel named as this one."""
        return [f"row {self.name} {self.rows} {self.cols}"]


def float_kind(typ, reduced: bool = False) -> str | None:
    """Return "f32"/"f64" for a tensor of that element type, else None; with `reduced`, also
    "bf16"/"f16" (the GPU's kernels take 16-bit floats; the CPU's fused kernels do not, their
    ops run per op in NumPy)."""
    if isinstance(typ, TensorType):
        et = typ.element_type
        if isinstance(et, Float32Type):
            return "f32"
        if isinstance(et, Float64Type):
            return "f64"
        if reduced and isinstance(et, BFloat16Type):
            return "bf16"
        if reduced and isinstance(et, Float16Type):
            return "f16"
    return None


def c_type(typ) -> str:
    """Return the C element type of a tensor type (float, double, hs_bf16, hs_half, int32_t, int64_t)."""
    et = typ.element_type
    if isinstance(et, Float32Type):
        return "float"
    if isinstance(et, Float64Type):
        return "double"
    if isinstance(et, BFloat16Type):
        return "hs_bf16"
    if isinstance(et, Float16Type):
        return "hs_half"
    if isinstance(et, IntegerType) and et.width.data in (8, 16, 32, 64):
        return f"int{et.width.data}_t"
    raise EmitError(f"no C type for {typ}")


def shape(value: SSAValue) -> tuple[int, ...]:
    """Return the shape of a tensor value."""
    return tuple(value.type.get_shape())  # type: ignore[attr-defined]


def lit(x: float, t: str) -> str:
    """Return a C expression for Python float `x` rounded to C type `t` (inf/nan spelled out)."""
    if math.isnan(x):
        return f"(({t})HS_NAN)"
    if math.isinf(x):
        return f"(({t})HS_INF)" if x > 0 else f"(-({t})HS_INF)"
    return f"(({t}){x!r})"


def put(stmts: list[str], t: str, name: str, expr: str) -> None:
    """Append the statement `const t name = expr;` to `stmts`."""
    stmts.append(f"const {t} {name} = {expr};")


def prop(op: Operation, name: str) -> float:
    """Return float property `name` of `op`."""
    return float(op.properties[name].value.data)  # type: ignore[attr-defined]


def fill(template: str, **kw: str) -> str:
    """Return `template` with every `{key}` replaced by `kw[key]`."""
    for k, v in kw.items():
        template = template.replace("{" + k + "}", v)
    return template


def retype(src: str, t: str) -> str:
    """Replace the template's type name T by `t` (whole words only): by the type a kernel computes
    in, float where `t` is a 16-bit float storage type (its pointers keep that type, from
    `kernel_params`; its values, sums and scratch are floats, rounded where they are stored)."""
    return re.sub(r"\bT\b", COMPUTE_OF_STORAGE.get(t, t), src)


# ----------------------------------------------------------------------------- standalone device kernels


def contiguous_strides(shape) -> tuple[int, ...]:
    """Return the row-major strides (in elements) of `shape`."""
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def offset_expr(index: str, shape, strides) -> str:
    """Return the C expression of the offset (in elements, `strides` per dim; 0 for a dim read
    whole, as a broadcast does) of the element whose row-major flat index over `shape` is the C
    expression `index`."""
    shape = tuple(shape)
    terms = []
    for k, (n, s) in enumerate(zip(shape, strides)):
        if n == 1 or s == 0:
            continue
        below = math.prod(shape[k + 1:])
        term = index if below == 1 else f"({index} / {below}L)"
        if k > 0:
            term = f"({term} % {n}L)"
        terms.append(term if s == 1 else f"{term} * {s}L")
    return " + ".join(terms) or "0"


def rank_value(name: str, k: int) -> str:
    """Return the macro of kernel `name`'s k-th rank-dependent value (`KernelCode.rank_values`)."""
    return f"{name}_RV{k}"


def rank_defaults(name: str, defaults) -> str:
    """Return the lines defining kernel `name`'s rank-dependent macros as `defaults` unless the
    rank's prelude (`rank_prelude`) defined them already."""
    return "".join(f"#ifndef {rank_value(name, k)}\n#define {rank_value(name, k)} {int(v)}LL\n#endif\n"
                   for k, v in enumerate(defaults))


def rank_prelude(name: str, values) -> str:
    """Return the lines defining kernel `name`'s rank-dependent macros as one rank's `values`."""
    return "".join(f"#define {rank_value(name, k)} {int(v)}LL\n" for k, v in enumerate(values))


def parse_rank_values(text: str) -> dict[int, tuple[int, ...]]:
    """Return the rank values of `format_rank_values`'s text ("RANK:V,V;RANK:V,V")."""
    out: dict[int, tuple[int, ...]] = {}
    for item in filter(None, text.split(";")):
        rank, _, values = item.partition(":")
        out[int(rank)] = tuple(int(v) for v in values.split(",") if v)
    return out


def format_rank_values(values: dict[int, tuple[int, ...]]) -> str:
    """Return `rank_values` as text (a `kernel.fused` op's property): "RANK:V,V;RANK:V,V"."""
    return ";".join(f"{r}:{','.join(str(int(v)) for v in vs)}" for r, vs in sorted(values.items()))


def global_index(name: str, local_shape, global_shape, shift: dict[int, str] | None = None,
                 start: Callable[[int], str] | None = None) -> str:
    """Return C statements setting `long gi` to the row-major index in the global tensor of
    `global_shape` of item `i` of a piece of `local_shape` whose start along dim d is the
    rank-dependent macro `rank_value(name, d)` (or the C expression `start(d)`), plus the C
    expression `shift[d]`, if any."""
    strides = contiguous_strides(global_shape)
    lines = ["long gi = 0, rest = i;"]
    for d in reversed(range(len(local_shape))):
        more = f" + {shift[d]}" if shift and d in shift else ""
        first = start(d) if start is not None else rank_value(name, d)
        lines.append(f"gi += (rest % {local_shape[d]}L + {first}{more}) * {strides[d]}L; "
                     f"rest /= {local_shape[d]}L;")
    return "\n    ".join(lines)


def microbatch_macro(name: str) -> str:
    """Return the macro of the micro-batch that kernel `name` runs on (a pipeline stage's kernel
    whose result depends on it, as a dropout mask does): 0 unless the run defines it."""
    return f"{name}_MB"


def microbatch_default(name: str) -> str:
    """Return the lines defining `microbatch_macro(name)` as 0 unless defined before."""
    m = microbatch_macro(name)
    return f"#ifndef {m}\n#define {m} 0LL\n#endif\n"


def reads_microbatch(name: str, source: str) -> bool:
    """Return whether kernel `name`'s `source` depends on the micro-batch it runs on."""
    return f"#ifndef {microbatch_macro(name)}\n" in source


def for_microbatch(name: str, source: str, launches: list[str], microbatch: int) -> tuple[str, str, list[str]]:
    """Return (name, source, launches) of kernel `name`'s variant for `microbatch`: its
    functions renamed `NAME_mbI` (one library holds every variant), its macro defined first."""
    new = f"{name}_mb{microbatch}"
    return (new, f"#define {microbatch_macro(new)} {int(microbatch)}LL\n" + source.replace(name, new),
            [s.replace(name, new) for s in launches])


def kernel_params(op: Operation, scratch: int = 0) -> list[str]:
    """Return the parameters every `__global__` function of `op`'s standalone kernel takes: its
    operands (`const` pointers `in0`, ...), results (`out0`, ...), `scratch` buffers of T, then
    the launch extents `long n0, long n1`."""
    params = [f"const {c_type(v.type)}* in{k}" for k, v in enumerate(op.operands)]
    params += [f"{c_type(v.type)}* out{k}" for k, v in enumerate(op.results)]
    params += [f"T* scratch{k}" for k in range(scratch)]
    return params + ["long n0", "long n1"]


def flat_kernel(name: str, op: Operation, t: str, body: str, n: int | None = None, pre: str = "",
                comment: str = "") -> KernelCode:
    """Return `op`'s kernel of one `elementwise` launch over `n` items (default: its first
    result's elements): `body` runs per item `i` (a grid-stride loop on a GPU), after `pre` once."""
    n = math.prod(shape(op.results[0])) if n is None else n
    src = (f"// {name}: {comment or op.name}\n"
           f"HS_KERNEL void {name}({', '.join(kernel_params(op))}) {{\n"
           + (f"  {pre}\n" if pre else "")
           + f"  HS_FOR(i, n0) {{\n    {body}\n  }}\n}}\n")
    return KernelCode(retype(src, t), [f"elementwise {name} {n} 0"])
