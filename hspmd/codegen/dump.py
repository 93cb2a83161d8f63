"""Write the kernels of a compiled program as CUDA C files: `hspmd compile --emit kernels --dump-dir D`.

The kernel level itself (`D/kernel_group<i>.mlir`, fused by the compiler's `fuse-kernels`) is
part of every bundle; this writes every kernel's complete CUDA C text (portability layer +
source, as NVRTC and CuPy compile it) as `D/kernels/<name>.cu`; kernels with one name in
several groups are one kernel.
"""

from __future__ import annotations

import os

from xdsl.dialects.builtin import ModuleOp

from hspmd.codegen.bundle import atomic_write_text
from hspmd.codegen.nvrtc_check import gpu_text
from hspmd.dialects.kernel import FusedOp


def write_kernel_sources(kernel_groups: list[ModuleOp], directory: str) -> list[str]:
    """Write the .cu file of every `kernel.fused` op of the (fused) group modules under
    `directory/kernels`; return the written paths relative to `directory`."""
    os.makedirs(os.path.join(directory, "kernels"), exist_ok=True)
    written: list[str] = []
    sources: dict[str, str] = {}
    for gi, fused in enumerate(kernel_groups):
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
