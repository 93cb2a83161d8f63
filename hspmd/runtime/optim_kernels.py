"""NumPy kernels of the `optim` ops: PyTorch's optimizer formulas on local pieces.

Arrays are computed in the parameter's dtype; the 0-d scalar operands (lr, bias corrections,
clip coefficients) are read as Python floats, and the scalars derived from them (`lr / bc1`,
`sqrt(bc2)`) are formed in float64 before they meet the arrays, as PyTorch's single-tensor
Adam does with its Python-float step size. Without `out=` every kernel returns new arrays; the
update kernels (SGD, Adam) and `mul_scalar` also take `out=` (one array per result) and
compute the same bits into it, and `out` may be the operands themselves (`p, m, v` updated
in place: the plan does that when the old values are not read afterwards).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from xdsl.ir import Operation

from hspmd.dialects import optim
from hspmd.ir.types import dtype_name
from hspmd.runtime import native

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


def sgd_into(param, grad, buf, lr: float, momentum: float, weight_decay: float, nesterov: bool, out) -> None:
    """Write `sgd(...)`'s (param', buf') into `out` ((param', ) without momentum); `out` may be the operands."""
    d = grad + weight_decay * param if weight_decay else grad
    if momentum:
        new_buf = momentum * buf + d
        d = d + momentum * new_buf if nesterov else new_buf
        d = d * lr
        np.subtract(param, d, out=out[0])
        np.copyto(out[1], new_buf)
    else:
        np.subtract(param, lr * d, out=out[0])


def adam_into(param, grad, m, v, lr: float, bc1: float, bc2: float, beta1, beta2, eps, weight_decay,
              decoupled: bool, out) -> None:
    """Write `adam(...)`'s (param', m', v') into the arrays `out`, with one temporary; `out` may
    be (param, m, v) themselves."""
    po, mo, vo = out
    if weight_decay and decoupled:
        param = np.multiply(param, 1.0 - lr * weight_decay, out=po)
    elif weight_decay:
        grad = grad + weight_decay * param
    tmp = np.multiply(grad, 1.0 - beta1)
    np.multiply(m, beta1, out=mo)
    mo += tmp
    np.multiply(grad, grad, out=tmp)
    tmp *= 1.0 - beta2
    np.multiply(v, beta2, out=vo)
    vo += tmp
    np.sqrt(vo, out=tmp)  # denom = sqrt(v) / sqrt(bc2) + eps
    tmp /= math.sqrt(bc2)
    tmp += eps
    np.divide(mo, tmp, out=tmp)
    tmp *= lr / bc1
    np.subtract(param, tmp, out=po)


def clip_coef(total: float, max_norm: float) -> float:
    """Return min(1, max_norm / (sqrt(total) + 1e-6)): the factor clip_grad_norm_ scales by."""
    return min(1.0, max_norm / (math.sqrt(total) + CLIP_EPS))


def _update(fn: Callable) -> Callable:
    """Mark `fn` as taking `out=` that may be its own operands (elementwise): see
    `hspmd.codegen.schedule.kernel_facts`, whose table must say the same of its op."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    fn.inplace_safe = True  # type: ignore[attr-defined]
    fn.rowwise = True  # type: ignore[attr-defined]  (elementwise: the plan may run it by blocks)
    return fn


def _f(op: Operation, prop: str) -> float:
    return float(op.properties[prop].value.data)  # type: ignore[attr-defined]


def kernel_for(op: Operation, rank: int = 0) -> Callable:
    """Return the NumPy function that computes `op` from its operand arrays (results as a tuple)."""
    own = getattr(op, "numpy_kernel", None)
    if callable(own):
        from hspmd.dialects.interfaces import KernelContext

        return own(KernelContext(rank, native))
    match op:
        case optim.SGDOp():
            momentum, wd, nesterov = _f(op, "momentum"), _f(op, "weight_decay"), bool(op.nesterov.value.data)
            dtype = np.dtype(dtype_name(op.param.type))
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
        case optim.AdamOp():
            consts = [_f(op, k) for k in ("beta1", "beta2", "eps", "weight_decay")]
            decoupled = bool(op.decoupled.value.data)
            dtype = np.dtype(dtype_name(op.param.type))

            def adam_step(p, g, m, v, lr, bc1, bc2, out=None):
                if out is not None:
                    adam_into(p, g, m, v, float(lr), float(bc1), float(bc2), *consts, decoupled, out)
                    return out
                res = adam(p, g, m, v, float(lr), float(bc1), float(bc2), *consts, decoupled)
                return tuple(x.astype(dtype, copy=False) for x in res)

            return _update(adam_step)
        case optim.SumSquaresOp():
            dtype = np.dtype(dtype_name(op.result.type))

            def sum_squares(x):
                if dtype == np.float64:  # in one C++ pass, no float64 copy (other last bits than BLAS's dot)
                    total = native.sum_squares(x) if isinstance(x, np.ndarray) else None
                    if total is not None:
                        return np.asarray(total, dtype=dtype)
                flat = np.asarray(x, dtype=np.result_type(x.dtype, dtype)).ravel()
                return np.asarray(np.dot(flat, flat), dtype=dtype)

            return sum_squares
        case optim.ClipCoefOp():
            max_norm, dtype = _f(op, "max_norm"), np.dtype(dtype_name(op.result.type))
            return lambda total: np.asarray(clip_coef(float(total), max_norm), dtype=dtype)
        case optim.MulScalarOp():
            dtype = np.dtype(dtype_name(op.input.type))
            return _update(lambda x, s, out=None: np.multiply(x, dtype.type(float(s)), out=out))
    raise NotImplementedError(f"no NumPy kernel for '{op.name}'")
