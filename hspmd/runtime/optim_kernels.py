"""NumPy kernels of the `optim` ops: PyTorch's optimizer formulas on local pieces.

Arrays are computed in the parameter's dtype; the 0-d scalar operands (lr, bias corrections,
clip coefficients) are read as Python floats, and the scalars derived from them (`lr / bc1`,
`sqrt(bc2)`) are formed in float64 before they meet the arrays, as PyTorch's single-tensor
Adam does with its Python-float step size. Every kernel returns new arrays (the plan stores
them with `graph.assign`); none writes into its operands.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from xdsl.ir import Operation

from hspmd.dialects import optim
from hspmd.ir.types import dtype_name

#: added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does
CLIP_EPS = 1e-6


def sgd(param, grad, buf, lr: float, momentum: float, weight_decay: float, nesterov: bool):
    """Return (param', buf') of one torch.optim.SGD step (buf None when momentum is 0)."""
    d = grad + weight_decay * param if weight_decay else grad
    if momentum:
        buf = momentum * buf + d
        d = d + momentum * buf if nesterov else buf
    return param - lr * d, buf


def adam(param, grad, m, v, lr: float, bc1: float, bc2: float, beta1, beta2, eps, weight_decay, decoupled: bool):
    """Return (param', m', v') of one torch.optim.Adam / AdamW step with bias corrections bc1, bc2."""
    if weight_decay and decoupled:
        param = param * (1.0 - lr * weight_decay)
    elif weight_decay:
        grad = grad + weight_decay * param
    m = beta1 * m + (1.0 - beta1) * grad
    v = beta2 * v + (1.0 - beta2) * (grad * grad)
    denom = np.sqrt(v) / math.sqrt(bc2) + eps
    return param - (lr / bc1) * (m / denom), m, v


def clip_coef(total: float, max_norm: float) -> float:
    """Return min(1, max_norm / (sqrt(total) + 1e-6)): the factor clip_grad_norm_ scales by."""
    return min(1.0, max_norm / (math.sqrt(total) + CLIP_EPS))


def _f(op: Operation, prop: str) -> float:
    return float(op.properties[prop].value.data)  # type: ignore[attr-defined]


def kernel_for(op: Operation, rank: int = 0) -> Callable:
    """Return the NumPy function that computes `op` from its operand arrays (results as a tuple)."""
    match op:
        case optim.SGDOp():
            momentum, wd, nesterov = _f(op, "momentum"), _f(op, "weight_decay"), bool(op.nesterov.value.data)
            dtype = np.dtype(dtype_name(op.param.type))
            if momentum:

                def sgd_momentum(p, g, buf, lr):
                    p1, b1 = sgd(p, g, buf, float(lr), momentum, wd, nesterov)
                    return p1.astype(dtype, copy=False), b1.astype(dtype, copy=False)

                return sgd_momentum
            return lambda p, g, lr: sgd(p, g, None, float(lr), 0.0, wd, False)[0].astype(dtype, copy=False)
        case optim.AdamOp():
            consts = [_f(op, k) for k in ("beta1", "beta2", "eps", "weight_decay")]
            decoupled = bool(op.decoupled.value.data)
            dtype = np.dtype(dtype_name(op.param.type))

            def adam_step(p, g, m, v, lr, bc1, bc2):
                out = adam(p, g, m, v, float(lr), float(bc1), float(bc2), *consts, decoupled)
                return tuple(x.astype(dtype, copy=False) for x in out)

            return adam_step
        case optim.SumSquaresOp():
            dtype = np.dtype(dtype_name(op.result.type))

            def sum_squares(x):
                flat = np.asarray(x, dtype=np.result_type(x.dtype, dtype)).ravel()
                return np.asarray(np.dot(flat, flat), dtype=dtype)

            return sum_squares
        case optim.ClipCoefOp():
            max_norm, dtype = _f(op, "max_norm"), np.dtype(dtype_name(op.result.type))
            return lambda total: np.asarray(clip_coef(float(total), max_norm), dtype=dtype)
        case optim.MulScalarOp():
            dtype = np.dtype(dtype_name(op.input.type))
            return lambda x, s: x * dtype.type(float(s))
    raise NotImplementedError(f"no NumPy kernel for '{op.name}'")
