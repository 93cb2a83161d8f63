"""`device-kernels`: the kernel level for a GPU, where every compute op is a kernel or a GEMM.

Runs on the kernel level (`fuse-kernels` has made its fused kernels). On a GPU nothing runs on
the host, so every op that is left becomes a `kernel.fused` of its own, from the op's own
CUDA C (`hspmd/dialects/interfaces.py`): an elementwise op (one that did not fuse: a 0-d
scalar's arithmetic) its `cuda_expr` as a one-op chain; a row op its `cuda_row` template (or
its `cuda_kernel` where the template does not serve, a softmax over another dim than the
last); any other op its standalone `cuda_kernel` (a transpose written out, a reduction, an
embedding's gather and its gradient, dropout's mask, a concat...). What stays as it is:

* the products (`CUDA_GEMM`: matmul, matmul_rhs_grad, the experts' products), which the
  device's GEMM computes;
* views (`DEVICE_VIEW`: a reshape of a contiguous array), and transposes of the last two dims
  that only products read (`gemm_transpose`): the GEMM takes them as a transpose flag, so a
  transposed weight or attention's `k^T` is never written out;
* leaves and stores (parameter, input, constant, output, assign), calls, scans, collectives,
  pipeline runs and the kernels `fuse-kernels` made.

An op with no GPU kernel is a compile-time error naming it (a GPU run never falls back to the
host): `PassError`. The GPU runtime (`hspmd/runtime/cuda/`) runs the result; the CPU build of
the same kernels under `cuda_emu.h` runs it on an emulated device in tests.

bfloat16 and float16 values are stored as such (`codegen/hs_float16.cuh`) and computed in float.
Their elementwise chains, which the CPU runs op by op in NumPy, are fused here first, each op's
result rounded to its type where the op computes it: a chain gives its ops' numbers without
storing the values between them. Products of them are cuBLAS GEMMs on tensor cores.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation
from xdsl.passes import ModulePass

from hspmd.codegen.emit_cuda import (
    EmitError,
    KernelCode,
    c_type,
    emit_elementwise,
    emit_row,
    float_kind,
    is_elementwise,
    is_row_op,
    shape,
)
from hspmd.dialects import graph, kernel
from hspmd.transforms.fuse_kernels import KERNEL_NAME, KernelNamer, fuse_elementwise, replace_with_kernel
from hspmd.transforms.util import PassError

#: ops a device runs as they are (see the module docstring)
_AS_THEY_ARE = (graph.ParameterOp, graph.InputOp, graph.ConstantOp, graph.OutputOp, graph.AssignOp, graph.ScanOp,
                func.CallOp, func.ReturnOp, kernel.FusedOp)


def runs_as_it_is(op: Operation) -> bool:
    """Return whether a device runs `op` without a kernel of its own (see the module docstring)."""
    return (isinstance(op, _AS_THEY_ARE) or op.dialect_name() in ("comm", "pipeline")
            or bool(getattr(op, "CUDA_GEMM", False)) or bool(getattr(op, "DEVICE_VIEW", False))
            or gemm_transpose(op))


def gemm_transpose(op: Operation) -> bool:
    """Return whether `op` is a transpose a GEMM takes as a flag: it swaps the last two dims, and
    every use is an operand of a `graph.matmul` or `graph.expert_matmul` (the right operand, or
    a left operand of a product batched like its right one: a left operand times a 2-D weight
    is its rows merged, which a transposed left operand has not)."""
    if not isinstance(op, graph.TransposeOp):
        return False
    perm = list(op.perm.get_values())
    n = len(perm)
    if n < 2 or perm != [*range(n - 2), n - 1, n - 2] or not op.result.uses:
        return False
    for use in op.result.uses:
        user = use.operation
        if user.name not in ("graph.matmul", "graph.expert_matmul"):
            return False
        if use.index == 0 and len(shape(user.operands[1])) == 2 and n > 2:
            return False
    return True


def _kernel_dtype(op: Operation) -> str:
    """Return the float type a kernel of `op` computes in ("f32" where no value is a float)."""
    for v in (*op.results, *op.operands):
        kind = float_kind(v.type, reduced=True)
        if kind is not None:
            return kind
    return "f32"


def device_kernel(op: Operation) -> KernelCode:
    """Return the standalone GPU kernel of `op` (named `KERNEL_NAME`); EmitError where it has none."""
    if is_elementwise(op):
        dtype, ctype = float_kind(op.results[0].type, reduced=True), None
        if dtype is None:  # integer arithmetic (per-layer dropout counters), in its C type
            dtype, ctype = "f32", c_type(op.results[0].type)
        inputs = list(dict.fromkeys(op.operands))
        return emit_elementwise(KERNEL_NAME, [op], inputs, list(op.results), dtype, shape(op.results[0]) or (1,),
                                ctype)
    own = getattr(op, "cuda_kernel", None)
    if is_row_op(op):
        try:
            return emit_row(KERNEL_NAME, op, reduced=True)
        except EmitError:
            if not callable(own):
                raise
    if callable(own):
        return own(KERNEL_NAME)
    raise EmitError(f"'{op.name}' has no GPU kernel (no cuda_expr, cuda_row or cuda_kernel)")


def device_function(fn: func.FuncOp, namer: KernelNamer) -> int:
    """Give every op of `fn`'s body that needs one its own kernel; return how many it made."""
    block: Block = fn.body.block
    made = fuse_elementwise(block, namer, reduced=True)  # 16-bit float chains (the CPU runs them op by op)
    return made + give_kernels(fn, list(block.ops), namer)


def give_kernels(fn: func.FuncOp, ops: list[Operation], namer: KernelNamer) -> int:
    """Give each of `ops` (of `fn`'s body) that needs one its own kernel; return how many it made
    (a pass that puts new ops into a device program, `flash-attention`, calls it for them)."""
    block: Block = fn.body.block
    made = 0
    for op in ops:
        if runs_as_it_is(op):
            continue
        try:
            name, code = namer([op], device_kernel(op))
        except EmitError as err:
            raise PassError(f"device-kernels: no GPU kernel for '{op.name}' in @{fn.sym_name.data}: {err}") from None
        inputs = list(dict.fromkeys(op.operands)) if is_elementwise(op) else list(op.operands)
        replace_with_kernel(block, code, name, _kernel_dtype(op), [op], inputs, list(op.results), [])
        made += 1
    return made


def module_namer(module: ModuleOp) -> KernelNamer:
    """Return a kernel namer whose names follow those `module`'s kernels have."""
    namer = KernelNamer()
    namer.count = _numbers_after(module)
    return namer


def device_module(module: ModuleOp) -> int:
    """Run `device-kernels` on every function of `module`; return the number of kernels made."""
    namer = module_namer(module)  # the new kernels' names follow those fuse-kernels gave
    return sum(device_function(fn, namer) for fn in [op for op in module.walk() if isinstance(op, func.FuncOp)])


def _numbers_after(module: ModuleOp) -> itertools.count:
    """Return a counter of kernel numbers past those `fuse-kernels` used in `module`."""
    used = [int(m.group(1)) for op in module.walk() if isinstance(op, kernel.FusedOp)
            if (m := re.match(r"k(\d+)_", op.kernel.data))]
    return itertools.count(max(used, default=-1) + 1)


@dataclass(frozen=True)
class DeviceKernels(ModulePass):
    """Give every op left after `fuse-kernels` a GPU kernel of its own (see the module doc)."""

    name = "device-kernels"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device_module(op)
