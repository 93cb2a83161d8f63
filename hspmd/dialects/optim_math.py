"""The optimizers' update rules on NumPy arrays, as PyTorch's optimizers compute them: the
reference that the `optim` ops' kernels (`hspmd/dialects/optim.py`) compute and are tested
against."""

from __future__ import annotations

import math

import numpy as np

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
