"""Check generated kernels with NVRTC, the CUDA runtime compiler, without a GPU.

`check_source(source, arch)` compiles one kernel's source, with the CUDA portability layer
(`cuda_preamble.cuh` + `hs_common.cuh`) in front, to PTX for `arch` (sm_80, sm_90, ...) and
raises NvrtcError with NVRTC's log if it does not compile. `check_module` checks every
`kernel.fused` of a module. NVRTC comes from the `cuda-bindings` and
`nvidia-cuda-nvrtc-cu12` wheels (the `test` extra); `nvrtc_status()` says whether it loads.
"""

from __future__ import annotations

import functools
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90")
#: NVRTC options of every GPU build (also CuPy's): no FMA contraction, as on the CPU
GPU_OPTIONS = ("--std=c++17", "--fmad=false")


class NvrtcError(Exception):
    """NVRTC is missing, or it rejected a kernel (the message holds its log)."""


def gpu_text(source: str) -> str:
    """Return the complete CUDA C text of a kernel source, as NVRTC or CuPy compile it."""
    return "".join((HERE / h).read_text() for h in ("cuda_preamble.cuh", "hs_float16.cuh", "hs_common.cuh")) + source


@functools.cache
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:  # the wheel is not installed
        raise NvrtcError(f"NVRTC is not available ({err}); install the 'test' extra") from None
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"NVRTC does not load: {err}")
    return nvrtc


def nvrtc_status() -> tuple[bool, str]:
    """Return (available, a few words saying why not / which version)."""
    try:
        nv = _nvrtc()
    except NvrtcError as err:
        return False, str(err)
    _, major, minor = nv.nvrtcVersion()
    return True, f"NVRTC {major}.{minor}"


def check_source(source: str, arch: str = "sm_80", name: str = "kernel.cu") -> int:
    """Compile `source` (with the portability layer) for `arch`; return the PTX size in bytes."""
    nv = _nvrtc()
    ok = nv.nvrtcResult.NVRTC_SUCCESS
    err, prog = nv.nvrtcCreateProgram(gpu_text(source).encode(), name.encode(), 0, [], [])
    if err != ok:
        raise NvrtcError(f"{name}: nvrtcCreateProgram failed: {err}")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in GPU_OPTIONS)]
        (err,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            _, size = nv.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nv.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"{name} ({arch}):\n{log.decode(errors='replace').strip()}")
        _, size = nv.nvrtcGetPTXSize(prog)
        return int(size)
    finally:
        nv.nvrtcDestroyProgram(prog)


def check_module(module, archs: tuple[str, ...] = ARCHS) -> dict[str, int]:
    """Compile all kernel.fused sources of `module` as one program per arch (kernels with
    one name are one kernel); return {arch: PTX bytes}."""
    from hspmd.dialects.kernel import FusedOp

    sources: dict[str, str] = {}
    for op in module.walk():
        if isinstance(op, FusedOp):
            sources.setdefault(op.kernel.data, op.source.data)
    text = "\n".join(sources.values())
    return {arch: check_source(text, arch, "program.cu") for arch in archs}
