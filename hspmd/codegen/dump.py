"""Write the kernel level of a compiled program: `hspmd compile --emit kernels --dump-dir D`.

For each device group's kernel-level module (the physical one fused by the compiler,
`fuse-kernels`), the module is written as `D/kernel_group<i>.mlir` (it parses back with
`parse_module`) and every kernel's complete CUDA C text (portability layer + source, as
NVRTC and CuPy compile it) as `D/kernels/<name>.cu`; kernels with one name in several groups
are one kernel.
"""

from __future__ import annotations

import os

from collections.abc import Sequence

from xdsl.dialects.builtin import ModuleOp

from hspmd.codegen.bundle import atomic_write_text
from hspmd.codegen.nvrtc_check import gpu_text
from hspmd.dialects.kernel import FusedOp
from hspmd.ir.context import module_text


def write_kernels(kernel_groups: Sequence[ModuleOp], directory: str) -> list[str]:
    """Write the kernel-level IR of every group (in group order) and its .cu files under
    `directory`; return the written paths relative to it."""
    os.makedirs(os.path.join(directory, "kernels"), exist_ok=True)
    written: list[str] = []
    sources: dict[str, str] = {}
    for gi, fused in enumerate(kernel_groups):
        name = f"kernel_group{gi}.mlir"
        atomic_write_text(os.path.join(directory, name), module_text(fused))
        written.append(name)
        for op in fused.walk():
            if isinstance(op, FusedOp):
                # names restart per group module: keep the first, suffix a different kernel
                kname, src = op.kernel.data, op.source.data
                if sources.get(kname, src) != src:
                    kname = f"g{gi}_{kname}"
                if kname not in sources:
                    sources[kname] = src
                    path = os.path.join("kernels", f"{kname}.cu")
                    atomic_write_text(os.path.join(directory, path), gpu_text(src))
                    written.append(path)
    return written
