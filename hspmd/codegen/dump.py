"""Write the kernel level of a compiled program: `hspmd compile --emit kernels --dump-dir D`.

For each device group's physical module, a fused copy (`fuse-kernels`) is written as
`D/kernel_group<i>.mlir` (it parses back with `parse_module`) and every kernel's complete
CUDA C text (portability layer + source, as NVRTC and CuPy compile it) as
`D/kernels/<name>.cu`; kernels with one name in several groups are one kernel.
"""

from __future__ import annotations

import os

from xdsl.dialects.builtin import ModuleOp

from hspmd.codegen.nvrtc_check import gpu_text
from hspmd.dialects.kernel import FusedOp
from hspmd.dialects.context import module_text
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.bundle import atomic_write_text


def write_kernels(physical: ModuleOp, directory: str) -> list[str]:
    """Write the kernel-level IR and .cu files of `physical` under `directory`; return the
    written paths relative to it."""
    from hspmd.transforms.fuse_kernels import fuse_module

    os.makedirs(os.path.join(directory, "kernels"), exist_ok=True)
    written: list[str] = []
    sources: dict[str, str] = {}
    for gi, (_, module) in enumerate(physical_groups(physical)):
        fused = module.clone()
        fuse_module(fused)
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
