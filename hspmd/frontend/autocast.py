"""PyTorch's autocast, op by op, for an imported model (`precision="bfloat16"` or `"float16"`).

`torch.autocast` decides, per ATen op, the dtype it computes in: products (linear, matmul,
attention) in the 16-bit dtype, softmax, norms, the loss and other ops that need the range in
float32, and everything else by PyTorch's type promotion of its inputs. The importer asks
PyTorch itself: it runs each translated op on fake tensors of the dtypes its inputs have in the
program, under `torch.autocast("cpu", dtype)`, and casts the op's floating inputs to the dtype
the result comes out in. The parameters stay float32 master weights, cast where an op takes
them in 16 bits, as under autocast.
"""

from __future__ import annotations

from hspmd.dialects.traced import FLOAT_DTYPES
from hspmd.frontend.tracing import Tensor

__all__ = ["Autocast"]


class Autocast:
    """The dtypes `torch.autocast("cpu", dtype)` gives the ops of an exported graph."""

    def __init__(self, dtype: str) -> None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.dtype = getattr(torch, dtype)
        self.mode = FakeTensorMode()

    def fake(self, x, boolean: bool = False):
        """Return a fake tensor standing for `x` (a traced tensor, a concrete one), or `x` itself."""
        import torch

        if isinstance(x, Tensor):
            dtype = torch.bool if getattr(x, "boolean", False) else getattr(torch, x.dtype)
            with self.mode:
                return torch.empty(x.shape, dtype=dtype)
        if isinstance(x, torch.Tensor):
            return self.mode.from_tensor(x)
        if isinstance(x, (list, tuple)):
            return type(x)(self.fake(v) for v in x)
        if isinstance(x, dict):
            return {k: self.fake(v) for k, v in x.items()}
        return x

    def result(self, target, args, kwargs):
        """Return the fake result of `target(*args, **kwargs)` under autocast (None where PyTorch
        cannot run it on fake tensors: the export's own dtypes stand)."""
        import torch

        try:
            fargs, fkwargs = self.fake(args), self.fake(kwargs)
            with self.mode, torch.autocast("cpu", dtype=self.dtype):
                return target(*fargs, **fkwargs)
        except Exception:  # noqa: BLE001 - an op fake tensors do not run: keep the export's dtypes
            return None

    def cast_inputs(self, result, args, kwargs):
        """Return `args`, `kwargs` with every floating tensor, traced or concrete (masks aside), in
        the floating dtype of `result` (autocast's cast of a product's inputs, or type promotion's)."""
        import torch

        from hspmd.dialects.graph.arithmetic import cast

        want = _float_dtype(result)
        if want is None:
            return args, kwargs
        dtype = getattr(torch, want)

        def convert(x):
            if isinstance(x, Tensor):
                if getattr(x, "boolean", False) or x.dtype not in FLOAT_DTYPES or x.dtype == want:
                    return x
                return cast(x, want)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)  # a concrete input (a buffer, a value made from buffers alone) as well
            if isinstance(x, (list, tuple)):
                return type(x)(convert(v) for v in x)
            if isinstance(x, dict):
                return {k: convert(v) for k, v in x.items()}
            return x

        return convert(args), convert(kwargs)


def _float_dtype(result) -> str | None:
    """Return the dtype name of the first floating tensor in `result` (a tensor or a tuple)."""
    items = result if isinstance(result, (list, tuple)) else [result]
    for r in items:
        dtype = getattr(r, "dtype", None)
        if dtype is not None and dtype.is_floating_point:
            return str(dtype).replace("torch.", "")
    return None
