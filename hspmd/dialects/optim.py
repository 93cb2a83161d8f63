"""The `optim` dialect: fused optimizer updates and gradient-clipping pieces.

The optimizer passes (`sgd`, `adam`, `clip-grad-norm`) write these ops into the logical step
after `autodiff`. Each update op reads a parameter, its gradient, its optimizer state and the
per-step scalars, and returns the new parameter and state, which the pass stores with
`graph.assign`. The formulas are PyTorch's (`torch.optim.SGD`, `Adam`, `AdamW`,
`torch.nn.utils.clip_grad_norm_`); see `hspmd/runtime/optim_kernels.py` for the arithmetic.

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

from xdsl.dialects.builtin import BoolAttr, Float64Type, FloatAttr, IntegerAttr, TensorType, i1
from xdsl.ir import Attribute, Dialect, SSAValue
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

from hspmd.dialects.graph import FLOAT_TYPES, tensor_shape
from hspmd.dialects.sharding import OpRule

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


class _OptimOp(IRDLOperation):
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "operands attr-dict `:` functional-type(operands, results)"


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


@irdl_op_definition
class MulScalarOp(_OptimOp):
    """`x * s` for a 0-d tensor `s` of any float type (cast to x's element type first).

    Not linear: a partial `x` is reduced first, so that the reduction is shared with the
    `sum_squares` of the same gradient instead of repeated after the scaling.
    """

    name = "optim.mul_scalar"
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


Optim = Dialect("optim", [SGDOp, AdamOp, SumSquaresOp, ClipCoefOp, MulScalarOp], [])
