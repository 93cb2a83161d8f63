"""The `optim` dialect: fused optimizer updates, gradient-clipping and loss-scaling pieces.

The optimizer passes (`sgd`, `adam`, `clip-grad-norm`, `dynamic-loss-scale`) write these ops
into the logical step after `autodiff`. Each update op reads a parameter, its gradient, its
optimizer state and the per-step scalars, and returns the new parameter and state, which the
pass stores with `graph.assign`. The formulas are PyTorch's (`torch.optim.SGD`, `Adam`,
`AdamW`, `torch.nn.utils.clip_grad_norm_`, `torch.amp.GradScaler`'s skip and scale update).
Each op carries its facts (`dialects/interfaces.py`): its sharding rule, its NumPy kernel
(PyTorch's formulas on local pieces) and, for the elementwise updates, its fused CUDA C
expression. They are written by the optimizer passes, after autodiff:
no op of this dialect is differentiated, and none has a frontend function.

Arrays are computed in the parameter's dtype; the 0-d scalar operands (lr, bias corrections,
clip coefficients) are read as Python floats, and the scalars derived from them (`lr / bc1`,
`sqrt(bc2)`) are formed in float64 before they meet the arrays, as PyTorch's single-tensor
Adam does with its Python-float step size. Without `out=` every kernel returns new arrays; the
update kernels (SGD, Adam) and `mul_scalar` also take `out=` (one array per result) and
compute the same bits into it, and `out` may be the operands themselves (`p, m, v` updated
in place: the plan does that when the old values are not read afterwards).

Scalars (the learning rate, bias corrections, a norm) are 0-d tensors of any float type, so
they can come from `graph.input "lr"` (fed each step by the runtime), a `graph.constant`, or
a scalar state parameter. Every op gives its own sharding rule: elementwise over the
parameter's dims, scalars replicated, and *not* linear, so a partial gradient is all-reduced
before it is used (`sum_squares` of a partial gradient would square partial sums).

    %w1, %m1, %v1 = optim.adam %w, %g, %m, %v, %lr, %bc1, %bc2 {beta1 = 0.9 : f64, ...}
        : (tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>,
           tensor<f64>, tensor<f64>, tensor<f64>) -> (tensor<4x3xf32>, tensor<4x3xf32>, tensor<4x3xf32>)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import BoolAttr, Float64Type, FloatAttr, IntegerAttr, TensorType, i1, i64
from xdsl.ir import Attribute, Dialect, Operation, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_result_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, flat_kernel, kernel_params, lit, prop, put, retype
from hspmd.dialects.graph.base import FLOAT_TYPES, result_dtype, tensor_shape
from hspmd.dialects.interfaces import FIRST, Kernel, KernelContext, OutFacts
from hspmd.dialects.op_rule import OpRule
from hspmd.dialects.optim_math import CLIP_EPS, adam, adam_into, clip_coef, sgd, sgd_into  # noqa: F401 (the API)
from hspmd.ir.types import dtype_name

__all__ = ["Optim"]


def f64_attr(value: float) -> FloatAttr:
    """Return `value : f64` as a property value."""
    return FloatAttr(float(value), Float64Type())


def bool_attr(value: bool) -> BoolAttr:
    """Return `true`/`false` as a property value."""
    return IntegerAttr(int(bool(value)), i1)


def _float_tensor(op: IRDLOperation, what: str, value: SSAValue) -> None:
    typ = value.type
    if not isinstance(typ, TensorType) or not isinstance(typ.element_type, FLOAT_TYPES):
        raise VerifyException(f"'{op.name}': {what} must be a float tensor, got {typ}")


def _scalar(op: IRDLOperation, what: str, value: SSAValue) -> None:
    _float_tensor(op, what, value)
    if tensor_shape(value) != ():
        raise VerifyException(f"'{op.name}': {what} must be a 0-d tensor, got shape {list(tensor_shape(value))}")


def _like(op: IRDLOperation, ref: SSAValue, **values: SSAValue) -> None:
    """Check every value has `ref`'s shape and element type (layouts may differ until insert-reshard)."""
    for what, value in values.items():
        typ = value.type
        if not isinstance(typ, TensorType) or (typ.get_shape(), typ.element_type) != (
            ref.type.get_shape(), ref.type.element_type  # type: ignore[attr-defined]
        ):
            raise VerifyException(f"'{op.name}': {what} has type {typ}, unlike {ref.type}")


def _in_range(op: IRDLOperation, what: str, value: float, lo: float, hi: float | None = None) -> None:
    if not (value >= lo and (hi is None or value < hi)):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise VerifyException(f"'{op.name}': {what} = {value} must be {bound}")


def _elementwise_rule(param: SSAValue, tensors: int, scalars: int, results: int) -> OpRule:
    """Factors d0..dn for `tensors` parameter-like operands and `results`, none for scalars."""
    d = tuple(f"d{i}" for i in range(len(tensor_shape(param))))
    return OpRule((d,) * tensors + ((),) * scalars, (d,) * results)


#: elements a block of `optim.sum_squares`' GPU kernel sums before the blocks' sums are added
SUM_CHUNK = 8192
def _update(fn: Callable) -> Callable:
    """Mark `fn` as taking `out=` that may be its own operands (elementwise, so the plan may run
    it by blocks of rows): what `OUT_FACTS = FIRST` says of its op."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    fn.inplace_safe = True  # type: ignore[attr-defined]
    fn.rowwise = True  # type: ignore[attr-defined]
    return fn


def _f(op: Operation, name: str) -> float:
    return float(op.properties[name].value.data)  # type: ignore[attr-defined]


class _OptimOp(IRDLOperation):
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "operands attr-dict `:` functional-type(operands, results)"
    NO_VJP: ClassVar[str] = "an optimizer op: written after the gradients, never differentiated"
    NO_FRONTEND: ClassVar[str] = "written by the optimizer passes (hs.optim.SGD, Adam, AdamW, clipping)"


@irdl_op_definition
class SGDOp(_OptimOp):
    """One `torch.optim.SGD` step (dampening 0): `param, grad, [buf], lr -> param', [buf']`.

        d = grad + weight_decay * param
        buf' = momentum * buf + d                  (only when momentum != 0; buf starts at 0)
        d = d + momentum * buf' if nesterov else buf'
        param' = param - lr * d

    The momentum buffer operand and result exist exactly when `momentum` is not 0. With a
    zero initial buffer the first step gives `buf' = d`, as PyTorch's first step does.
    """

    name = "optim.sgd"
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    param = operand_def(TensorType)
    grad = operand_def(TensorType)
    buf = opt_operand_def(TensorType)
    lr = operand_def(TensorType)
    new_param = result_def(TensorType)
    new_buf = opt_result_def(TensorType)
    momentum = prop_def(FloatAttr)
    weight_decay = prop_def(FloatAttr)
    nesterov = prop_def(BoolAttr)
    traits = traits_def(Pure())

    def __init__(
        self,
        param: SSAValue,
        grad: SSAValue,
        buf: SSAValue | None,
        lr: SSAValue,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        super().__init__(
            operands=[param, grad, [buf] if buf is not None else [], lr],
            result_types=[param.type, [param.type] if buf is not None else []],
            properties={
                "momentum": f64_attr(momentum),
                "weight_decay": f64_attr(weight_decay),
                "nesterov": bool_attr(nesterov),
            },
        )

    def verify_(self) -> None:
        _float_tensor(self, "the parameter", self.param)
        _like(self, self.param, gradient=self.grad, result=self.new_param)
        _scalar(self, "lr", self.lr)
        momentum = self.momentum.value.data
        _in_range(self, "momentum", momentum, 0.0)
        _in_range(self, "weight_decay", self.weight_decay.value.data, 0.0)
        if (self.buf is None) != (momentum == 0.0) or (self.buf is None) != (self.new_buf is None):
            raise VerifyException(f"'{self.name}' has a momentum buffer operand and result exactly when momentum != 0")
        if self.buf is not None and self.new_buf is not None:
            _like(self, self.param, buffer=self.buf, **{"new buffer": self.new_buf})
        if self.nesterov.value.data and momentum == 0.0:
            raise VerifyException(f"'{self.name}': nesterov needs a momentum")

    def sharding_rule(self) -> OpRule:
        """Elementwise over the parameter's dims; lr replicated; not linear in the gradient."""
        n = 3 if self.buf is not None else 2
        return _elementwise_rule(self.param, n, 1, len(self.results))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        momentum, wd, nesterov = _f(self, "momentum"), _f(self, "weight_decay"), bool(self.nesterov.value.data)
        dtype = np.dtype(dtype_name(self.param.type))
        if momentum:

            def sgd_momentum(p, g, buf, lr, out=None):
                if out is not None:
                    sgd_into(p, g, buf, float(lr), momentum, wd, nesterov, out)
                    return out
                p1, b1 = sgd(p, g, buf, float(lr), momentum, wd, nesterov)
                return p1.astype(dtype, copy=False), b1.astype(dtype, copy=False)

            return _update(sgd_momentum)

        def sgd_plain(p, g, lr, out=None):
            if out is not None:
                sgd_into(p, g, None, float(lr), 0.0, wd, False, (out,))
                return out
            return sgd(p, g, None, float(lr), 0.0, wd, False)[0].astype(dtype, copy=False)

        return _update(sgd_plain)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        momentum, wd = prop(self, "momentum"), prop(self, "weight_decay")
        nesterov = bool(self.nesterov.value.data)
        p, g, r = a[0], a[1], out[0]
        lr = a[-1]
        stmts.append(f"const {t} {r}_d0 = {g + ' + ' + lit(wd, t) + ' * ' + p if wd else g};")
        d = f"{r}_d0"
        if momentum:
            buf = a[2]
            stmts.append(f"const {t} {out[1]} = {lit(momentum, t)} * {buf} + {d};")
            d = f"({d} + {lit(momentum, t)} * {out[1]})" if nesterov else out[1]
        put(stmts, t, r, f"{p} - ({t})({lr}) * {d}")


@irdl_op_definition
class AdamOp(_OptimOp):
    """One `torch.optim.Adam` (or, `decoupled`, `AdamW`) step: `param, grad, m, v, lr, bc1, bc2 -> param', m', v'`.

        param = param * (1 - lr * weight_decay)    if decoupled (AdamW)
        grad = grad + weight_decay * param         if not decoupled (Adam's L2 penalty)
        m' = beta1 * m + (1 - beta1) * grad
        v' = beta2 * v + (1 - beta2) * grad * grad
        param' = param - (lr / bc1) * m' / (sqrt(v') / sqrt(bc2) + eps)

    `bc1`, `bc2` are the bias corrections `1 - beta1**t`, `1 - beta2**t` of step t >= 1.
    """

    name = "optim.adam"
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    param = operand_def(TensorType)
    grad = operand_def(TensorType)
    exp_avg = operand_def(TensorType)
    exp_avg_sq = operand_def(TensorType)
    lr = operand_def(TensorType)
    bias_correction1 = operand_def(TensorType)
    bias_correction2 = operand_def(TensorType)
    new_param = result_def(TensorType)
    new_exp_avg = result_def(TensorType)
    new_exp_avg_sq = result_def(TensorType)
    beta1 = prop_def(FloatAttr)
    beta2 = prop_def(FloatAttr)
    eps = prop_def(FloatAttr)
    weight_decay = prop_def(FloatAttr)
    decoupled = prop_def(BoolAttr)
    traits = traits_def(Pure())

    def __init__(
        self,
        param: SSAValue,
        grad: SSAValue,
        exp_avg: SSAValue,
        exp_avg_sq: SSAValue,
        lr: SSAValue,
        bias_correction1: SSAValue,
        bias_correction2: SSAValue,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ):
        super().__init__(
            operands=[param, grad, exp_avg, exp_avg_sq, lr, bias_correction1, bias_correction2],
            result_types=[param.type, param.type, param.type],
            properties={
                "beta1": f64_attr(beta1),
                "beta2": f64_attr(beta2),
                "eps": f64_attr(eps),
                "weight_decay": f64_attr(weight_decay),
                "decoupled": bool_attr(decoupled),
            },
        )

    def verify_(self) -> None:
        _float_tensor(self, "the parameter", self.param)
        _like(
            self, self.param, gradient=self.grad, m=self.exp_avg, v=self.exp_avg_sq,
            result=self.new_param, **{"new m": self.new_exp_avg, "new v": self.new_exp_avg_sq},
        )
        for what, value in (("lr", self.lr), ("bc1", self.bias_correction1), ("bc2", self.bias_correction2)):
            _scalar(self, what, value)
        _in_range(self, "beta1", self.beta1.value.data, 0.0, 1.0)
        _in_range(self, "beta2", self.beta2.value.data, 0.0, 1.0)
        _in_range(self, "eps", self.eps.value.data, 0.0)
        _in_range(self, "weight_decay", self.weight_decay.value.data, 0.0)

    def sharding_rule(self) -> OpRule:
        """Elementwise over the parameter's dims; scalars replicated; not linear in the gradient."""
        return _elementwise_rule(self.param, 4, 3, 3)

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        consts = [_f(self, k) for k in ("beta1", "beta2", "eps", "weight_decay")]
        decoupled = bool(self.decoupled.value.data)
        dtype = np.dtype(dtype_name(self.param.type))

        def adam_step(p, g, m, v, lr, bc1, bc2, out=None):
            if out is not None:
                adam_into(p, g, m, v, float(lr), float(bc1), float(bc2), *consts, decoupled, out)
                return out
            res = adam(p, g, m, v, float(lr), float(bc1), float(bc2), *consts, decoupled)
            return tuple(x.astype(dtype, copy=False) for x in res)

        return _update(adam_step)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        p, g, m, v, lr, bc1, bc2 = a
        r = out[0]
        b1, b2, eps, wd = (prop(self, k) for k in ("beta1", "beta2", "eps", "weight_decay"))
        decoupled = bool(self.decoupled.value.data)
        if wd and decoupled:
            stmts.append(f"const {t} {r}_p = {p} * ({t})(1.0 - ({lr}) * {wd!r});")
            p = f"{r}_p"
        elif wd:
            stmts.append(f"const {t} {r}_g = {g} + {lit(wd, t)} * {p};")
            g = f"{r}_g"
        stmts.append(f"const {t} {out[1]} = {lit(b1, t)} * {m} + {lit(1.0 - b1, t)} * {g};")
        stmts.append(f"const {t} {out[2]} = {lit(b2, t)} * {v} + {lit(1.0 - b2, t)} * ({g} * {g});")
        stmts.append(f"const {t} {r}_den = hs_sqrt({out[2]}) / ({t})sqrt((double)({bc2})) + {lit(eps, t)};")
        put(stmts, t, r, f"{p} - ({t})(({lr}) / ({bc1})) * ({out[1]} / {r}_den)")


@irdl_op_definition
class SumSquaresOp(_OptimOp):
    """`sum(x * x)` over every element, as a 0-d tensor (accumulated in the result's type).

    Every dim is a reduction factor: a split operand gives a partial sum, which is right; a
    partial operand would not (squares of partial sums), so the op is not linear.
    """

    name = "optim.sum_squares"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, input: SSAValue, result_type: Attribute):
        super().__init__(operands=[input], result_types=[result_type])

    def verify_(self) -> None:
        _float_tensor(self, "the operand", self.input)
        _scalar(self, "the result", self.result)

    def sharding_rule(self) -> OpRule:
        return OpRule((tuple(f"d{i}" for i in range(len(tensor_shape(self.input)))),), ((),))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dtype = result_dtype(self)
        native = ctx.native

        def sum_squares(x):
            if dtype == np.float64 and native is not None:  # in one C++ pass, no float64 copy (other last bits than BLAS's dot)
                total = native.sum_squares(x) if isinstance(x, np.ndarray) else None
                if total is not None:
                    return np.asarray(total, dtype=dtype)
            flat = np.asarray(x, dtype=np.result_type(x.dtype, dtype)).ravel()
            return np.asarray(np.dot(flat, flat), dtype=dtype)

        return sum_squares

    def cuda_kernel(self, name: str) -> KernelCode:
        """Two launches: a block per chunk of `SUM_CHUNK` elements summing its squares into a
        scratch slot (every SM busy on a large gradient), then one block summing the slots; in
        the result's type."""
        n = max(math.prod(tensor_shape(self.input)), 1)
        parts = -(-n // SUM_CHUNK)
        params = ", ".join(kernel_params(self, scratch=1))
        src = (f"// {name}: optim.sum_squares, by chunks then their partial sums\n"
               f"HS_KERNEL void {name}_part({params}) {{\n"
               f"  HS_ROWS(r, n0) {{\n"
               f"    const long lo = r * n1, len = ({n}L - lo) < n1 ? ({n}L - lo) : n1;\n"
               f"    T acc = 0;\n"
               f"    HS_COLS_SUM(j, len, acc) {{ const T v = (T)in0[lo + j]; acc += v * v; }}\n"
               f"    acc = hs_block_sum(acc);\n"
               f"    if (threadIdx.x == 0) scratch0[r] = acc;\n"
               f"  }}\n}}\n"
               f"HS_KERNEL void {name}_total({params}) {{\n"
               f"  HS_ROWS(r, n0) {{\n"
               f"    T acc = 0;\n"
               f"    HS_COLS_SUM(j, n1, acc) acc += scratch0[j];\n"
               f"    acc = hs_block_sum(acc);\n"
               f"    if (threadIdx.x == 0) out0[0] = acc;\n"
               f"  }}\n}}\n")
        return KernelCode(retype(src, c_type(self.result.type)),
                          [f"row {name}_part {parts} {min(n, SUM_CHUNK)}", f"row {name}_total 1 {parts}"], [parts])


@irdl_op_definition
class ClipCoefOp(_OptimOp):
    """`min(1, max_norm / (sqrt(total) + 1e-6))` of a sum of squares `total` (PyTorch's clip_grad_norm_)."""

    name = "optim.clip_coef"
    total = operand_def(TensorType)
    result = result_def(TensorType)
    max_norm = prop_def(FloatAttr)
    traits = traits_def(Pure())

    def __init__(self, total: SSAValue, max_norm: float):
        super().__init__(operands=[total], result_types=[total.type], properties={"max_norm": f64_attr(max_norm)})

    def verify_(self) -> None:
        _scalar(self, "the operand", self.total)
        _scalar(self, "the result", self.result)
        if not self.max_norm.value.data > 0:
            raise VerifyException(f"'{self.name}': max_norm = {self.max_norm.value.data} must be > 0")

    def sharding_rule(self) -> OpRule:
        return OpRule(((),), ((),))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        max_norm, dtype = _f(self, "max_norm"), result_dtype(self)
        return lambda total: np.asarray(clip_coef(float(total), max_norm), dtype=dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        """`min(1, max_norm / (sqrt(total) + 1e-6))` in double, as the NumPy kernel's Python floats."""
        max_norm = _f(self, "max_norm")
        body = (f"const double coef = {max_norm!r} / (sqrt((double)in0[0]) + {CLIP_EPS!r});\n"
                f"    out0[0] = (T)(coef < 1.0 ? coef : 1.0);")
        return flat_kernel(name, self, c_type(self.result.type), body, n=1)


@irdl_op_definition
class MulScalarOp(_OptimOp):
    """`x * s` for a 0-d tensor `s` of any float type (cast to x's element type first).

    Not linear: a partial `x` is reduced first, so that the reduction is shared with the
    `sum_squares` of the same gradient instead of repeated after the scaling.
    """

    name = "optim.mul_scalar"
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    input = operand_def(TensorType)
    scalar = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, input: SSAValue, scalar: SSAValue):
        super().__init__(operands=[input, scalar], result_types=[input.type])

    def verify_(self) -> None:
        _float_tensor(self, "the operand", self.input)
        _like(self, self.input, result=self.result)
        _scalar(self, "the scalar", self.scalar)

    def sharding_rule(self) -> OpRule:
        d = tuple(f"d{i}" for i in range(len(tensor_shape(self.input))))
        return OpRule((d, ()), (d,))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dtype = np.dtype(dtype_name(self.input.type))
        return _update(lambda x, s, out=None: np.multiply(x, dtype.type(float(s)), out=out))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[0]} * ({t})({a[1]})")


def _is_finite(x: str) -> str:
    """Return a C test that double expression `x` is finite (no -ffast-math in any build)."""
    return f"(({x}) - ({x}) == 0.0)"


@irdl_op_definition
class WhereFiniteOp(_OptimOp):
    """`new` where the 0-d `total` is finite, else `old`: a step's update kept or skipped.

    Dynamic loss scaling (`dynamic-loss-scale`) passes every state an optimizer writes
    through it, with `total` the gradients' global sum of squares: one inf or nan element
    anywhere makes it non-finite, and the step leaves parameters and optimizer state as they
    were (as `GradScaler.step` skips `optimizer.step()`). Elementwise over `old`'s dims, of
    any element type (`opt.step` is an integer); `total` replicated.
    """

    name = "optim.where_finite"
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    old = operand_def(TensorType)
    new = operand_def(TensorType)
    total = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, old: SSAValue, new: SSAValue, total: SSAValue):
        super().__init__(operands=[old, new, total], result_types=[old.type])

    def verify_(self) -> None:
        _like(self, self.old, new=self.new, result=self.result)
        _scalar(self, "the total", self.total)

    def sharding_rule(self) -> OpRule:
        return _elementwise_rule(self.old, 2, 1, 1)

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        def where_finite(old, new, total, out=None):
            keep = new if math.isfinite(float(total)) else old
            if out is None:
                return np.array(keep, copy=True)
            if out is not keep:
                np.copyto(out, keep)
            return out

        return _update(where_finite)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{_is_finite(f'(double)({a[2]})')} ? ({t})({a[1]}) : ({t})({a[0]})")


@irdl_op_definition
class UpdateLossScaleOp(_OptimOp):
    """Dynamic loss scaling's update (`torch.amp.GradScaler.update`):
    `scale, good_steps, total -> scale', good_steps'` (0-d tensors).

        found_inf = total is inf or nan         (total: the gradients' global sum of squares)
        found_inf:  scale' = scale * backoff_factor, good_steps' = 0
        else:       good = good_steps + 1
                    good >= growth_interval: scale' = scale * growth_factor (if finite, else scale), good_steps' = 0
                    else:                    scale' = scale, good_steps' = good
    """

    name = "optim.update_loss_scale"
    scale = operand_def(TensorType)
    good_steps = operand_def(TensorType)
    total = operand_def(TensorType)
    new_scale = result_def(TensorType)
    new_good_steps = result_def(TensorType)
    growth_factor = prop_def(FloatAttr)
    backoff_factor = prop_def(FloatAttr)
    growth_interval = prop_def(IntegerAttr)
    traits = traits_def(Pure())

    def __init__(self, scale: SSAValue, good_steps: SSAValue, total: SSAValue, growth_factor: float,
                 backoff_factor: float, growth_interval: int):
        super().__init__(
            operands=[scale, good_steps, total],
            result_types=[scale.type, scale.type],
            properties={
                "growth_factor": f64_attr(growth_factor),
                "backoff_factor": f64_attr(backoff_factor),
                "growth_interval": IntegerAttr(int(growth_interval), i64),
            },
        )

    def verify_(self) -> None:
        from hspmd.ir.loss_scaling import check_settings

        _scalar(self, "the scale", self.scale)
        _like(self, self.scale, **{"good steps": self.good_steps, "new scale": self.new_scale,
                                   "new good steps": self.new_good_steps})
        _scalar(self, "the total", self.total)
        try:
            check_settings(1.0, _f(self, "growth_factor"), _f(self, "backoff_factor"), self._interval())
        except ValueError as err:
            raise VerifyException(f"'{self.name}': {err}") from None

    def _interval(self) -> int:
        return int(self.growth_interval.value.data)

    def sharding_rule(self) -> OpRule:
        return OpRule(((), (), ()), ((), ()))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        from hspmd.ir.loss_scaling import next_scale

        growth, backoff, interval = _f(self, "growth_factor"), _f(self, "backoff_factor"), self._interval()
        dtype = np.dtype(dtype_name(self.scale.type))

        def update_loss_scale(scale, good_steps, total):
            s, g = next_scale(float(scale), float(good_steps), math.isfinite(float(total)), growth, backoff,
                              interval, dtype.type)
            return np.asarray(s, dtype), np.asarray(g, dtype)

        return update_loss_scale

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        growth, backoff, interval = prop(self, "growth_factor"), prop(self, "backoff_factor"), self._interval()
        s, r = f"(double)({a[0]})", out[0]
        stmts.append(f"const bool {r}_inf = !{_is_finite(f'(double)({a[2]})')};")
        stmts.append(f"const double {r}_good = (double)({a[1]}) + 1.0;")
        stmts.append(f"const bool {r}_grow = {r}_good >= {float(interval)!r};")
        stmts.append(f"const double {r}_up = (double)({t})({s} * {growth!r});")
        put(stmts, t, r, f"{r}_inf ? ({t})({s} * {backoff!r}) : "
                         f"(({r}_grow && {_is_finite(f'{r}_up')}) ? ({t}){r}_up : ({t})({s}))")
        put(stmts, t, out[1], f"({r}_inf || {r}_grow) ? ({t})0.0 : ({t}){r}_good")


Optim = Dialect("optim", [SGDOp, AdamOp, SumSquaresOp, ClipCoefOp, MulScalarOp, WhereFiniteOp, UpdateLossScaleOp], [])
