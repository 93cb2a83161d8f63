"""CUDA C emission for fused kernels: elementwise chains and row reductions.

Each emitter returns a `KernelCode`: the source (written against the portability layer that
`cuda_preamble.cuh` / `cuda_emu.h` define), its launches (`"KIND NAME N0 N1"`) and scratch
buffer sizes. Every `__global__` function of one kernel takes the same arguments: operands
(`const` pointers), results, scratch buffers, then `long n0, long n1`.

The arithmetic follows the NumPy reference kernels (`hspmd/runtime/numpy_ops.py`,
`optim_kernels.py`) operation by operation, in the operands' float type, with Python-float
constants rounded to that type first as NumPy's weak scalars are. Sums over a row are
reassociated (SIMD lanes on a CPU, a tree across threads on a GPU), as NumPy's pairwise
summation is; docs/kernels.md states the resulting tolerance.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from xdsl.dialects.builtin import Float32Type, Float64Type, IntegerType, TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph, optim
from hspmd.dialects.cuda_c import RowKernel

C_FLOAT = {"f32": "float", "f64": "double"}


class EmitError(Exception):
    """An op or operand the emitter cannot turn into CUDA C (the pass leaves it unfused)."""


@dataclass
class KernelCode:
    """A kernel's CUDA C source, its launches and the sizes of its scratch buffers."""

    source: str
    launches: list[str]
    scratch: list[int] = field(default_factory=list)


def float_kind(typ) -> str | None:
    """Return "f32"/"f64" for a tensor of that element type, else None."""
    if isinstance(typ, TensorType):
        if isinstance(typ.element_type, Float32Type):
            return "f32"
        if isinstance(typ.element_type, Float64Type):
            return "f64"
    return None


def c_type(typ) -> str:
    """Return the C element type of a tensor type (float, double, int32_t, int64_t)."""
    et = typ.element_type
    if isinstance(et, Float32Type):
        return "float"
    if isinstance(et, Float64Type):
        return "double"
    if isinstance(et, IntegerType) and et.width.data in (8, 16, 32, 64):
        return f"int{et.width.data}_t"
    raise EmitError(f"no C type for {typ}")


def shape(value: SSAValue) -> tuple[int, ...]:
    return tuple(value.type.get_shape())  # type: ignore[attr-defined]


def lit(x: float, t: str) -> str:
    """Return a C expression for Python float `x` rounded to C type `t` (inf/nan spelled out)."""
    if math.isnan(x):
        return f"(({t})HS_NAN)"
    if math.isinf(x):
        return f"(({t})HS_INF)" if x > 0 else f"(-({t})HS_INF)"
    return f"(({t}){x!r})"


def _prop(op: Operation, name: str) -> float:
    return float(op.properties[name].value.data)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- elementwise

#: ops an elementwise kernel can compute (all operands of the group's shape, or 0-d scalars)
ELEMENTWISE = (
    graph.AddOp, graph.SubOp, graph.MulOp, graph.DivOp, graph.ScaleOp, graph.ReluOp, graph.ReluGradOp,
    graph.ExpOp, graph.LogOp, graph.SqrtOp, graph.RsqrtOp, graph.TanhOp, graph.TanhGradOp, graph.SigmoidOp, graph.SigmoidGradOp, graph.BinaryCrossEntropyOp,
    graph.BinaryCrossEntropyGradOp, graph.SiluOp,
    graph.SiluGradOp, graph.GeluOp, graph.GeluGradOp, graph.PowOp, graph.PowGradOp, graph.CausalMaskOp,
    optim.MulScalarOp, optim.AdamOp, optim.SGDOp,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def is_elementwise(op: Operation) -> bool:
    """Return whether an elementwise kernel can compute `op` (it has a `cuda_expr`)."""
    return isinstance(op, ELEMENTWISE) or callable(getattr(op, "cuda_expr", None))


def is_row_op(op: Operation) -> bool:
    """Return whether a row kernel computes `op` (it has a `cuda_row`)."""
    return isinstance(op, ROW_OPS) or callable(getattr(op, "cuda_row", None))


def takes_prologue(op: Operation) -> bool:
    """Return whether `op`'s row kernel can compute its first operand from an elementwise chain."""
    return isinstance(op, PROLOGUE_ROW_OPS) or bool(getattr(op, "CUDA_ROW_PROLOGUE", False))


def _pow_expr(x: str, p: float, t: str) -> str:
    if p == 2.0:
        return f"({x} * {x})"
    if p == 1.0:
        return x
    if p == 0.5:
        return f"hs_sqrt({x})"
    return f"hs_pow({x}, {lit(p, t)})"


def elementwise_expr(op: Operation, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
    """Append statements computing `op` from operand expressions `a` into `stmts`; `out` are
    the names of its result variables.

    Scalar (0-d) operands arrive as `double` expressions. EmitError for an unsupported op.
    """
    own = getattr(op, "cuda_expr", None)
    if callable(own):
        own(a, t, stmts, out)
        return
    L = lambda x: lit(x, t)  # noqa: E731
    one, half = L(1.0), L(0.5)
    r = out[0]

    def put(expr: str) -> None:
        stmts.append(f"const {t} {r} = {expr};")

    match op:
        case graph.AddOp():
            put(f"{a[0]} + {a[1]}")
        case graph.SubOp():
            put(f"{a[0]} - {a[1]}")
        case graph.MulOp():
            put(f"{a[0]} * {a[1]}")
        case graph.DivOp():
            put(f"{a[0]} / {a[1]}")
        case graph.ScaleOp():
            put(f"{a[0]} * {L(_prop(op, 'factor'))}")
        case graph.ReluOp():
            put(f"({a[0]} > ({t})0 || {a[0]} != {a[0]}) ? {a[0]} : ({t})0")
        case graph.ReluGradOp():
            put(f"{a[0]} > ({t})0 ? {a[1]} : ({t})0")
        case graph.ExpOp():
            put(f"hs_exp({a[0]})")
        case graph.LogOp():
            put(f"hs_log({a[0]})")
        case graph.SqrtOp():
            put(f"hs_sqrt({a[0]})")
        case graph.RsqrtOp():
            put(f"({t})1 / hs_sqrt({a[0]})")
        case graph.TanhOp():
            put(f"hs_tanh({a[0]})")
        case graph.TanhGradOp():
            put(f"{a[1]} * ({one} - {a[0]} * {a[0]})")
        case graph.SigmoidOp():
            put(f"hs_sigmoid({a[0]})")
        case graph.BinaryCrossEntropyOp():
            z, y = a
            stmts.append(f"const {t} {r}_p = {z} > ({t})0 ? {z} : ({t})0;")  # max(z, 0); -|z| = z - 2 max(z, 0)
            put(f"{r}_p - {z} * {y} + hs_log({one} + hs_exp({z} - {L(2.0)} * {r}_p))")
        case graph.BinaryCrossEntropyGradOp():
            put(f"(hs_sigmoid({a[0]}) - {a[1]}) * {a[2]}")
        case graph.SigmoidGradOp():
            put(f"{a[1]} * ({a[0]} * ({one} - {a[0]}))")
        case graph.SiluOp():
            put(f"{a[0]} * hs_sigmoid({a[0]})")
        case graph.SiluGradOp():
            stmts.append(f"const {t} {r}_s = hs_sigmoid({a[0]});")
            put(f"{a[1]} * ({r}_s * ({one} + {a[0]} * ({one} - {r}_s)))")
        case graph.GeluOp():
            x = a[0]
            if op.approximate.data == "tanh":
                # 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)): one exp, no cancellation for x < 0
                y = f"{L(_SQRT_2_OVER_PI)} * ({x} + {L(_GELU_C)} * ({x} * {x} * {x}))"
                put(f"{x} / ({one} + hs_exp({L(-2.0)} * ({y})))")
            else:
                put(f"{half} * {x} * ({one} + hs_erf({x} / {L(math.sqrt(2.0))}))")
        case graph.GeluGradOp():
            x, dy = a
            if op.approximate.data == "tanh":
                # with s = sigmoid(2y) (so tanh(y) = 2s - 1): gelu' = s + 2 x s (1 - s) c (1 + 3 k x^2)
                y = f"{L(_SQRT_2_OVER_PI)} * ({x} + {L(_GELU_C)} * ({x} * {x} * {x}))"
                stmts.append(f"const {t} {r}_s = {one} / ({one} + hs_exp({L(-2.0)} * ({y})));")
                stmts.append(
                    f"const {t} {r}_d = {r}_s + {L(2.0)} * {x} * {r}_s * ({one} - {r}_s)"
                    f" * {L(_SQRT_2_OVER_PI)} * ({one} + {L(3 * _GELU_C)} * {x} * {x});"
                )
            else:
                stmts.append(f"const {t} {r}_c = {half} * ({one} + hs_erf({x} / {L(math.sqrt(2.0))}));")
                stmts.append(
                    f"const {t} {r}_d = {r}_c + {x} * hs_exp({L(-0.5)} * {x} * {x}) / {L(math.sqrt(2 * math.pi))};"
                )
            put(f"{dy} * {r}_d")
        case graph.PowOp():
            put(_pow_expr(a[0], _prop(op, "exponent"), t))
        case graph.PowGradOp():
            p = _prop(op, "exponent")
            if p == 0.0:
                put(f"({t})0 * {a[1]}")
            elif p == 1.0:
                put(a[1])
            else:
                put(f"{a[1]} * ({_pow_expr(a[0], p - 1.0, t)} * {L(p)})")
        case optim.MulScalarOp():
            put(f"{a[0]} * ({t})({a[1]})")
        case optim.AdamOp():
            p, g, m, v, lr, bc1, bc2 = a
            b1, b2, eps, wd = (_prop(op, k) for k in ("beta1", "beta2", "eps", "weight_decay"))
            decoupled = bool(op.decoupled.value.data)
            if wd and decoupled:
                stmts.append(f"const {t} {r}_p = {p} * ({t})(1.0 - ({lr}) * {wd!r});")
                p = f"{r}_p"
            elif wd:
                stmts.append(f"const {t} {r}_g = {g} + {L(wd)} * {p};")
                g = f"{r}_g"
            stmts.append(f"const {t} {out[1]} = {L(b1)} * {m} + {L(1.0 - b1)} * {g};")
            stmts.append(f"const {t} {out[2]} = {L(b2)} * {v} + {L(1.0 - b2)} * ({g} * {g});")
            stmts.append(f"const {t} {r}_den = hs_sqrt({out[2]}) / ({t})sqrt((double)({bc2})) + {L(eps)};")
            put(f"{p} - ({t})(({lr}) / ({bc1})) * ({out[1]} / {r}_den)")
        case optim.SGDOp():
            momentum, wd = _prop(op, "momentum"), _prop(op, "weight_decay")
            nesterov = bool(op.nesterov.value.data)
            p, g = a[0], a[1]
            lr = a[-1]
            stmts.append(f"const {t} {r}_d0 = {g + ' + ' + L(wd) + ' * ' + p if wd else g};")
            d = f"{r}_d0"
            if momentum:
                buf = a[2]
                stmts.append(f"const {t} {out[1]} = {L(momentum)} * {buf} + {d};")
                d = f"({d} + {L(momentum)} * {out[1]})" if nesterov else out[1]
            put(f"{p} - ({t})({lr}) * {d}")
        case _:
            raise EmitError(f"no elementwise emitter for '{op.name}'")


def _broadcast_index(op: graph.BroadcastOp, cols: int) -> str:
    """Return the C expression of the input offset read at result position (row r, column j)
    of the result seen as rows of `cols` (its last dim)."""
    out_shape, in_shape = shape(op.result), shape(op.input)
    dims = list(op.dims.get_values())
    in_strides = [math.prod(in_shape[k + 1:]) for k in range(len(in_shape))]
    terms = []
    for k, d in enumerate(dims):
        if in_shape[k] == 1:
            continue
        if d == len(out_shape) - 1:
            terms.append(f"j * {in_strides[k]}L" if in_strides[k] != 1 else "j")
        else:
            row_stride = math.prod(out_shape[d + 1:-1])  # rows per step of dim d
            terms.append(f"((r / {row_stride}L) % {out_shape[d]}L) * {in_strides[k]}L")
    return " + ".join(terms) or "0"


def _elementwise_body(
    members: list[Operation], inputs: list[SSAValue], outputs: list[SSAValue], t: str, cols: int
) -> tuple[list[str], list[str], dict[SSAValue, str]]:
    """Return (statements before the loop, statements per item, value names) computing
    `members` at flat index `i` (= row `r` * `cols` + column `j` where an op needs them)."""
    input_index = {v: k for k, v in enumerate(inputs)}
    names: dict[SSAValue, str] = {}
    pre: list[str] = []
    body: list[str] = []
    for k, v in enumerate(inputs):
        if shape(v) == ():
            pre.append(f"const double s{k} = (double)in{k}[0];")
            names[v] = f"s{k}"
    bcast_inputs = {m.input for m in members if isinstance(m, graph.BroadcastOp)}
    for k, v in enumerate(inputs):
        if v not in names and v not in bcast_inputs:
            body.append(f"const {t} x{k} = in{k}[i];")
            names[v] = f"x{k}"
    for j, m in enumerate(members):
        outs = [f"v{j}_{q}" for q in range(len(m.results))]
        if isinstance(m, graph.BroadcastOp):
            src = m.input
            if src not in input_index:
                raise EmitError("a fused graph.broadcast must read an operand of the kernel")
            if shape(src) == ():
                body.append(f"const {t} {outs[0]} = ({t})s{input_index[src]};")
            else:
                body.append(f"const {t} {outs[0]} = in{input_index[src]}[{_broadcast_index(m, cols)}];")
        elif isinstance(m, graph.CausalMaskOp):
            tq = shape(m.result)[-2]
            value = lit(_prop(m, "value"), t)
            body.append(f"const {t} {outs[0]} = (j > r % {tq}L) ? {value} : {names[m.operands[0]]};")
        else:
            elementwise_expr(m, [names[v] for v in m.operands], t, body, outs)
        for res, nm in zip(m.results, outs):
            names[res] = nm
    missing = [v for v in outputs if v not in names]
    if missing:
        raise EmitError("a kernel result is not computed by its ops")
    return pre, body, names


def emit_elementwise(
    name: str,
    members: list[Operation],
    inputs: list[SSAValue],
    outputs: list[SSAValue],
    dtype: str,
    out_shape: tuple[int, ...],
) -> KernelCode:
    """Return the elementwise kernel computing `outputs` from `inputs` through `members` (in
    order). Inputs are tensors of the group's shape (read at `i`), 0-d scalars (read once) or
    the operands of member `graph.broadcast` ops (read at the mapped index).

    A plain chain is one flat loop (`HS_FOR`, launch `elementwise`). A chain that reads
    through a broadcast or masks by position runs as rows of the last dim (launch `row`, no
    reduction): the row and column indices then come without a division per element, and
    the column loop stays unit-stride so a CPU compiler vectorises it.
    """
    t = C_FLOAT[dtype]
    numel = math.prod(out_shape)
    cols = out_shape[-1]
    rows = numel // cols
    two_d = any(isinstance(m, (graph.BroadcastOp, graph.CausalMaskOp)) for m in members)
    # no __restrict__: a runner may pass an operand's array as the result of the same index
    # (an in-place optimizer update), which is safe for a loop reading in[i] before out[i]
    params = [f"const {c_type(v.type)}* in{k}" for k, v in enumerate(inputs)]
    params += [f"{t}* out{k}" for k in range(len(outputs))]
    params += ["long n0", "long n1"]
    pre, body, names = _elementwise_body(members, inputs, outputs, t, cols)
    for k, v in enumerate(outputs):
        body.append(f"out{k}[i] = {names[v]};")
    ops = ", ".join(m.name for m in members)
    head = f"HS_KERNEL void {name}({', '.join(params)}) {{\n" + "".join(f"  {s}\n" for s in pre)
    if two_d:
        src = (
            f"// {name}: elementwise, rows of the last dim: {ops}\n" + head
            + "  HS_ROWS(r, n0) {\n    HS_COLS_SIMD(j, n1) {\n      const long i = r * n1 + j;\n"
            + "".join(f"      {s}\n" for s in body)
            + "    }\n  }\n}\n"
        )
        return KernelCode(src, [f"row {name} {rows} {cols}"], [])
    src = (
        f"// {name}: elementwise: {ops}\n" + head
        + "  HS_FOR(i, n0) {\n"
        + "".join(f"    {s}\n" for s in body)
        + "  }\n}\n"
    )
    return KernelCode(src, [f"elementwise {name} {numel} 0"], [])


@dataclass
class Prologue:
    """An elementwise chain computing a row op's main operand, to be computed inside the row
    kernel wherever the kernel reads that operand instead of being stored and read back."""

    members: list[Operation]
    inputs: list[SSAValue]
    output: SSAValue


#: row ops whose kernel can take a prologue on their first operand
PROLOGUE_ROW_OPS = (graph.SoftmaxOp, graph.LayerNormOp, graph.RmsNormOp, graph.SoftmaxCrossEntropyOp,
                    graph.SoftmaxCrossEntropyGradOp)


def _prologue_function(name: str, pro: Prologue, t: str, cols: int) -> tuple[str, list[str]]:
    """Return the `__device__` function computing the prologue's value at (r, j), and the
    kernel parameters that replace the row op's first operand."""
    pre, body, names = _elementwise_body(pro.members, pro.inputs, [pro.output], t, cols)
    params = [f"const {c_type(v.type)}* in{k}" for k, v in enumerate(pro.inputs)]
    fn = (
        f"__device__ __forceinline__ {t} {name}_x({', '.join(params)}, long r, long j, long cols) {{\n"
        + "  const long i = r * cols + j;\n"
        + "".join(f"  {s}\n" for s in pre + body)
        + f"  return {names[pro.output]};\n}}\n"
    )
    return fn, params


# ----------------------------------------------------------------------------- rows

#: ops computed by a row kernel (a reduction over the last dim, one block per row)
ROW_OPS = (
    graph.SoftmaxOp, graph.SoftmaxGradOp, graph.LayerNormOp, graph.LayerNormGradOp, graph.RmsNormOp,
    graph.RmsNormGradOp, graph.SoftmaxCrossEntropyOp, graph.SoftmaxCrossEntropyGradOp, graph.MoeRouteOp,
)


def _fill(template: str, **kw: str) -> str:
    for k, v in kw.items():
        template = template.replace("{" + k + "}", v)
    return template


_SOFTMAX = """\
// {name}: softmax over the last dim
HS_KERNEL void {name}(XPARAM, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
    LIVE
    T m = -HS_INF;
    HS_COLS_MAX(j, live, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, live, s) {
      const T e = hs_exp(XLOAD[j] - m);
      yr[j] = e;
      s += e;
    }
    const T inv = (T)1 / hs_block_sum(s);  // one division a row (within 1 ulp of NumPy's e / sum)
    HS_COLS(j, live) yr[j] = yr[j] * inv;
    TAIL
  }
}
"""

# Softmax after a causal mask of -inf: the columns j > r % Tq are -inf, their results exactly 0;
# the row's loops stop after its last unmasked column (HS_LIVE_COLS: rounded up to whole CPU
# vectors, the masked columns before that bound still go through the loops as -inf) and the rest
# of the row is written as 0. The same values; half the work of a causal row on average.
_CAUSAL_LIVE = "const long live = HS_LIVE_COLS(r % {tq}L + 1, cols);"
_CAUSAL_TAIL = "HS_COLS(j, cols - live) yr[live + j] = (T)0;"

_SOFTMAX_GRAD = """\
// {name}: softmax backward y * (dy - sum(dy * y)) over the last dim
HS_KERNEL void {name}(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* yr = y + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += gr[j] * yr[j];
    s = hs_block_sum(s);
    HS_COLS(j, cols) dr[j] = yr[j] * (gr[j] - s);
  }
}
"""

_MOMENTS = """\
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += XLOAD[j];
    const T mean = hs_block_sum(s) / (T)cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) {
      const T d = XLOAD[j] - mean;
      q += d * d;
    }
    const T var = hs_block_sum(q) / (T)cols;
"""

_LAYER_NORM = """\
// {name}: layer norm over the last dim
HS_KERNEL void {name}(XPARAM, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                      long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
{moments}    const T rstd = (T)1 / hs_sqrt(var + {eps});  // one division a row (within 1 ulp of NumPy's x / den)
    HS_COLS(j, cols) yr[j] = (XLOAD[j] - mean) * rstd * w[j] + b[j];
  }
}
"""

_LAYER_NORM_GRAD = """\
// {name}: layer norm backward: dx per row, then dweight/dbias per column
HS_KERNEL void {name}_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ db,
                           T* __restrict__ mean_out, T* __restrict__ rstd_out, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
{moments}    const T rstd = (T)1 / hs_sqrt(var + {eps});
    T sg = 0, sgx = 0;
    HS_COLS_SUM(j, cols, sg) sg += gr[j] * w[j];
    HS_COLS_SUM(j, cols, sgx) sgx += gr[j] * w[j] * ((xr[j] - mean) * rstd);
    const T mg = hs_block_sum(sg) / (T)cols;
    const T mgx = hs_block_sum(sgx) / (T)cols;
    HS_COLS(j, cols) dr[j] = rstd * (gr[j] * w[j] - mg - ((xr[j] - mean) * rstd) * mgx);
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}
HS_KERNEL void {name}_cols(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ db,
                           T* __restrict__ mean, T* __restrict__ rstd, long cols, long rows) {
  // each thread sums its columns [c0, c1) over the rows in order (a GPU thread: one column)
  HS_COLUMN_RANGE(c0, c1, cols) {
    for (long c = c0; c < c1; ++c) dw[c] = db[c] = (T)0;
    for (long r = 0; r < rows; ++r) {
      const T m = mean[r], s = rstd[r];
      const T* xr = x + r * cols;
      const T* gr = dy + r * cols;
      HS_SIMD for (long c = c0; c < c1; ++c) {
        dw[c] += gr[c] * ((xr[c] - m) * s);
        db[c] += gr[c];
      }
    }
  }
}
"""

_RMS_NORM = """\
// {name}: RMS norm over the last dim
HS_KERNEL void {name}(XPARAM, const T* __restrict__ w, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) q += XLOAD[j] * XLOAD[j];
    const T rr = (T)1 / hs_sqrt(hs_block_sum(q) / (T)cols + {eps});
    HS_COLS(j, cols) yr[j] = XLOAD[j] * rr * w[j];
  }
}
"""

_RMS_NORM_GRAD = """\
// {name}: RMS norm backward: dx per row, then dweight per column
HS_KERNEL void {name}_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ rstd_out, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) q += xr[j] * xr[j];
    const T rr = (T)1 / hs_sqrt(hs_block_sum(q) / (T)cols + {eps});
    T sgx = 0;
    HS_COLS_SUM(j, cols, sgx) sgx += gr[j] * w[j] * xr[j];
    const T mgx = hs_block_sum(sgx) / (T)cols;
    HS_COLS(j, cols) dr[j] = rr * (gr[j] * w[j]) - xr[j] * (rr * rr * rr) * mgx;
    if (threadIdx.x == 0) rstd_out[r] = rr;
  }
}
HS_KERNEL void {name}_cols(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ rstd, long cols, long rows) {
  HS_COLUMN_RANGE(c0, c1, cols) {
    for (long c = c0; c < c1; ++c) dw[c] = (T)0;
    for (long r = 0; r < rows; ++r) {
      const T s = rstd[r];
      const T* xr = x + r * cols;
      const T* gr = dy + r * cols;
      HS_SIMD for (long c = c0; c < c1; ++c) dw[c] += gr[c] * xr[c] * s;
    }
  }
}
"""

_XENT = """\
// {name}: softmax cross-entropy per row
HS_KERNEL void {name}(XPARAM, const L* __restrict__ labels, T* __restrict__ loss, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T m = -HS_INF;
    HS_COLS_MAX(j, cols, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += hs_exp(XLOAD[j] - m);
    s = hs_block_sum(s);
    if (threadIdx.x == 0) {
      const long lab = (long)labels[r];
      const T picked = (lab >= 0 && lab < cols) ? XLOAD[lab] : (T)HS_NAN;
      const T value = (hs_log(s) + m) - picked;
      loss[r] = {ignored} ? (T)0 : value;
    }
  }
}
"""

_XENT_GRAD = """\
// {name}: softmax cross-entropy backward
HS_KERNEL void {name}(XPARAM, const L* __restrict__ labels, const T* __restrict__ dloss,
                      T* __restrict__ dx, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* dr = dx + r * cols;
    T m = -HS_INF;
    HS_COLS_MAX(j, cols, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, cols, s) {
      const T e = hs_exp(XLOAD[j] - m);
      dr[j] = e;
      s += e;
    }
    const T inv = (T)1 / hs_block_sum(s);
    const long lab = (long)labels[r];
    // a label out of range gives NaN (NumPy raises an IndexError)
    const T scale = {ignored} ? (T)0 : ((lab >= 0 && lab < cols) ? dloss[r] : (T)HS_NAN);
    HS_COLS(j, cols) dr[j] = (dr[j] * inv - (j == lab ? (T)1 : (T)0)) * scale;
  }
}
"""


_MOE_ROUTE = """\
// {name}: top-{k} routing, {capacity} slots per expert; one block per routing group [{tokens}, {experts}]
HS_KERNEL void {name}(XPARAM, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * ({tokens}L * {experts}L * {capacity}L);
    HS_COLS(j, {tokens}L * {experts}L * {capacity}L) yr[j] = (T)0;
    __syncthreads();
    // a thread per expert fills its slots: choices rank by rank, tokens in order (as graph.moe_route)
    HS_COLS(e, {experts}) {
      long used = 0;
      for (long k = 0; k < {k}; ++k) {
        for (long s = 0; s < {tokens}; ++s) {
          // the k-th choice of token s: order by probability, then by the lower expert
          long pick = -1, prev = -1;
          T pv = (T)0, prevv = HS_INF;
          for (long t = 0; t <= k; ++t) {
            pick = -1;
            for (long c = 0; c < {experts}; ++c) {
              const T v = XLOAD[s * {experts}L + c];
              const bool after = v < prevv || (v == prevv && c > prev);
              if (after && (pick < 0 || v > pv)) {
                pick = c;
                pv = v;
              }
            }
            prev = pick;
            prevv = pv;
          }
          if (pick == e) {
            if (used < {capacity}) yr[(s * {experts}L + e) * {capacity}L + used] = (T)1;
            ++used;
          }
        }
      }
    }
    __syncthreads();
  }
}
"""


def row_extents(op: Operation) -> tuple[int, int]:
    """Return (rows, cols) of a row op: its main operand as rows of its last dim (or what the
    op's `cuda_row_extents()` says: a routing group's [tokens, experts] for `graph.moe_route`)."""
    own = getattr(op, "cuda_row_extents", None)
    if callable(own):
        return own()
    s = shape(op.operands[0])
    if not s:
        raise EmitError(f"'{op.name}' on a 0-d tensor")
    if isinstance(op, graph.MoeRouteOp):
        return s[0], s[1] * s[2]
    return math.prod(s[:-1]), s[-1]


def _causal_rows(prologue: Prologue | None) -> int | None:
    """Return Tq where `prologue`'s result is a causal mask of -inf (entries j > r % Tq are
    -inf, whatever the ops before it computed), else None."""
    if prologue is None:
        return None
    last = prologue.output.owner
    if isinstance(last, graph.CausalMaskOp) and _prop(last, "value") == -math.inf:
        return shape(last.result)[-2]
    return None


def emit_row(name: str, op: Operation, prologue: Prologue | None = None) -> KernelCode:
    """Return the kernel of row op `op` (EmitError where its form is not handled); with a
    `prologue`, the kernel computes the op's first operand from the prologue's inputs where
    it reads it (its operands are then the prologue's inputs and the op's other operands)."""
    dtype = float_kind(op.operands[0].type)
    if dtype is None:
        raise EmitError(f"'{op.name}' is not f32/f64")
    t = C_FLOAT[dtype]
    rows, cols = row_extents(op)
    nd = len(shape(op.operands[0]))
    kw = {"name": name, "rows": str(rows), "cols": str(cols)}
    eps = lit(_prop(op, "eps"), t) if "eps" in op.properties else ""
    launches = [f"row {name} {rows} {cols}"]
    scratch: list[int] = []
    own = getattr(op, "cuda_row", None)
    if callable(own):
        code = own(RowKernel(name, t, rows, cols, prologue))
        return _finish_row(name, op, code, dtype, t, cols, prologue)
    match op:
        case graph.SoftmaxOp() | graph.SoftmaxGradOp():
            if op.dim.value.data != nd - 1:
                raise EmitError("softmax over a dim other than the last")
            src = _fill(_SOFTMAX if isinstance(op, graph.SoftmaxOp) else _SOFTMAX_GRAD, **kw)
            tq = _causal_rows(prologue) if isinstance(op, graph.SoftmaxOp) else None
            live, tail = (_CAUSAL_LIVE.replace("{tq}", str(tq)), _CAUSAL_TAIL) if tq else ("const long live = cols;", "")
            src = src.replace("    LIVE\n", f"    {live}\n").replace("    TAIL\n", f"    {tail}\n" if tail else "")
        case graph.LayerNormOp():
            src = _fill(_fill(_LAYER_NORM, moments=_MOMENTS), eps=eps, **kw)
        case graph.LayerNormGradOp():
            src = _fill(_fill(_LAYER_NORM_GRAD, moments=_MOMENTS), eps=eps, **kw)
            launches = [f"row {name}_rows {rows} {cols}", f"elementwise {name}_cols {cols} {rows}"]
            scratch = [rows, rows]
        case graph.RmsNormOp():
            src = _fill(_RMS_NORM, eps=eps, **kw)
        case graph.RmsNormGradOp():
            src = _fill(_RMS_NORM_GRAD, eps=eps, **kw)
            launches = [f"row {name}_rows {rows} {cols}", f"elementwise {name}_cols {cols} {rows}"]
            scratch = [rows]
        case graph.MoeRouteOp():
            _, tokens, experts = shape(op.operands[0])
            src = _fill(_MOE_ROUTE, k=str(op.top_k.value.data), capacity=str(shape(op.result)[-1]),
                        tokens=str(tokens), experts=str(experts), **kw)
        case graph.SoftmaxCrossEntropyOp() | graph.SoftmaxCrossEntropyGradOp():
            lab = c_type(op.operands[1].type)
            ignore = op.ignore_index.value.data if op.ignore_index is not None else None
            ignored = "false" if ignore is None else f"(labels[r] == ({lab}){ignore})"
            template = _XENT if isinstance(op, graph.SoftmaxCrossEntropyOp) else _XENT_GRAD
            src = _fill(template, ignored=ignored, **kw).replace("const L*", f"const {lab}*")
        case _:
            raise EmitError(f"no row emitter for '{op.name}'")
    for w in op.operands[1:]:
        if float_kind(w.type) not in (None, dtype):
            raise EmitError(f"'{op.name}' mixes float types")
    if isinstance(op, (graph.LayerNormOp, graph.LayerNormGradOp, graph.RmsNormOp, graph.RmsNormGradOp)):
        if shape(op.operands[1]) != (cols,):
            raise EmitError(f"'{op.name}' weight is not [{cols}]")
        if isinstance(op, graph.LayerNormOp) and shape(op.operands[2]) != (cols,):
            raise EmitError(f"'{op.name}' bias is not [{cols}]")
    if prologue is None:
        src = src.replace("XPARAM", "const T* __restrict__ x").replace("XDECL", "const T* xr = x + r * cols;")
        src = src.replace("XLOAD[", "xr[")
    else:
        if not isinstance(op, PROLOGUE_ROW_OPS) or shape(prologue.output) != shape(op.operands[0]):
            raise EmitError(f"'{op.name}' takes no prologue")
        fn, params = _prologue_function(name, prologue, t, cols)
        args = ", ".join(f"in{k}" for k in range(len(prologue.inputs)))
        src = src.replace("XPARAM", ", ".join(params)).replace("    XDECL\n", "")
        src = re.sub(r"XLOAD\[([^\]]+)\]", lambda m: f"{name}_x({args}, r, {m.group(1)}, cols)", src)
        ops = ", ".join(m.name for m in prologue.members)
        src = f"// {name}: prologue {ops}\n" + fn + src
    if "XLOAD" in src or "XPARAM" in src or "XDECL" in src:
        raise EmitError(f"internal: unresolved template in the kernel of '{op.name}'")
    src = _retype(src, t)
    return KernelCode(src, launches, scratch)


def _finish_row(name: str, op: Operation, code: KernelCode, dtype: str, t: str, cols: int,
                prologue: Prologue | None) -> KernelCode:
    """Return the row kernel `code` (a template from the op's `cuda_row`) with its first operand
    read from a pointer or computed by `prologue`, and its type name T filled."""
    src = code.source
    for w in op.operands[1:]:
        if float_kind(w.type) not in (None, dtype):
            raise EmitError(f"'{op.name}' mixes float types")
    if prologue is None:
        src = src.replace("XPARAM", "const T* __restrict__ x").replace("XDECL", "const T* xr = x + r * cols;")
        src = src.replace("XLOAD[", "xr[")
    else:
        if not takes_prologue(op) or shape(prologue.output) != shape(op.operands[0]):
            raise EmitError(f"'{op.name}' takes no prologue")
        fn, params = _prologue_function(name, prologue, t, cols)
        args = ", ".join(f"in{k}" for k in range(len(prologue.inputs)))
        src = src.replace("XPARAM", ", ".join(params)).replace("    XDECL\n", "")
        src = re.sub(r"XLOAD\[([^\]]+)\]", lambda m: f"{name}_x({args}, r, {m.group(1)}, cols)", src)
        ops = ", ".join(m.name for m in prologue.members)
        src = f"// {name}: prologue {ops}\n" + fn + src
    if "XLOAD" in src or "XPARAM" in src or "XDECL" in src:
        raise EmitError(f"internal: unresolved template in the kernel of '{op.name}'")
    return KernelCode(_retype(src, t), code.launches, code.scratch)


def _retype(src: str, t: str) -> str:
    """Replace the template's type name T by `t` (whole words only)."""
    return re.sub(r"\bT\b", t, src)
