"""Check generated kernels with NVRTC, the CUDA runtime compiler, without a GPU.

`check_source(source, arch)` compiles one kernel's source, with the CUDA portability layer
(`cuda_preamble.cuh` + `hs_common.cuh`) in front, to PTX for `arch` (sm_80, sm_90, ...) and
raises NvrtcError with NVRTC's log if it does not compile. `check_module` checks every
`kernel.fused` of a module for sm_80 and sm_90. Two NVRTCs check (`NVRTC_MAJORS`): CUDA 12's
compiles for sm_80 and CUDA 13's (the GPU machine's: an H100 or H200 under CUDA 13) for sm_90
(`ARCH_NVRTC`), so a module is checked with both versions and both archs at the cost of one
compile per arch. NVRTC comes from the `nvidia-cuda-nvrtc-cu12` and
`nvidia-cuda-nvrtc` (13) wheels of the `test` extra, which install side by side
(`nvidia/cuda_nvrtc/lib/libnvrtc.so.12`, `nvidia/cu13/lib/libnvrtc.so.13`); each is loaded by its
own path through ctypes, so neither hides the other (a loader that picks "the" libnvrtc would
take one for both), the one `cuda.pathfinder` picks first where it is of the major asked for (on
a GPU machine: CuPy's own, with the same builtins). `nvrtc_status()` says which load.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90")
#: the NVRTC major versions a check compiles with: CUDA 12's, and CUDA 13's (the GPU machine's)
NVRTC_MAJORS = (12, 13)
#: the NVRTC each architecture is checked with (another that is available where that one is not)
ARCH_NVRTC = {"sm_80": 12, "sm_90": 13}
#: where each major's wheel puts its library, under a `sys.path` entry
WHEEL_DIRS = {12: ("nvidia", "cuda_nvrtc", "lib"), 13: ("nvidia", "cu13", "lib")}
#: NVRTC options of every GPU build (also CuPy's): no FMA contraction, as on the CPU
GPU_OPTIONS = ("--std=c++17", "--fmad=false")


class NvrtcError(Exception):
    """NVRTC is missing, or it rejected a kernel (the message holds its log)."""


def gpu_text(source: str) -> str:
    """Return the complete CUDA C text of a kernel source, as NVRTC or CuPy compile it."""
    return "".join((HERE / h).read_text() for h in ("cuda_preamble.cuh", "hs_float16.cuh", "hs_common.cuh")) + source


class Nvrtc:
    """One NVRTC library (`libnvrtc.so.<major>`) through its C API: version, compile, log, PTX size."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib, self.path = lib, path
        c_char_pp = ctypes.POINTER(ctypes.c_char_p)
        for name, args in (("nvrtcVersion", [ctypes.POINTER(ctypes.c_int)] * 2),
                           ("nvrtcCreateProgram", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                                   ctypes.c_int, c_char_pp, c_char_pp]),
                           ("nvrtcCompileProgram", [ctypes.c_void_p, ctypes.c_int, c_char_pp]),
                           ("nvrtcGetProgramLogSize", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
                           ("nvrtcGetProgramLog", [ctypes.c_void_p, ctypes.c_char_p]),
                           ("nvrtcGetPTXSize", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
                           ("nvrtcDestroyProgram", [ctypes.POINTER(ctypes.c_void_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    @property
    def name(self) -> str:
        return f"NVRTC {self.version[0]}.{self.version[1]}"

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NvrtcError(f"{what} failed: {self.lib.nvrtcGetErrorString(status).decode(errors='replace')}")

    def compile(self, text: str, arch: str, name: str) -> int:
        """Compile CUDA C `text` for `arch`; return the PTX size in bytes (NvrtcError with the log)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None),
                    f"{name}: nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in GPU_OPTIONS)]
            status = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if status != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(max(size.value, 1))
                self.lib.nvrtcGetProgramLog(prog, log)
                raise NvrtcError(f"{name} ({arch}, {self.name}):\n{log.value.decode(errors='replace').strip()}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            return int(size.value)
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _pathfinder_nvrtc() -> str | None:
    """Return the path of the libnvrtc `cuda.pathfinder` loads (CuPy 14's loader: where CuPy is
    installed, the check then compiles with CuPy's own NVRTC and its builtins), or None."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return None
    try:
        return load_nvidia_dynamic_lib("nvrtc").abs_path or None
    except Exception:  # noqa: BLE001 - not found: the other places are tried
        return None


def library_candidates(major: int) -> list[str]:
    """Return where `libnvrtc.so.<major>` is looked for, in order: the one `cuda.pathfinder`
    loads where it is of that major, the wheel's directory under each `sys.path` entry, the
    toolkit's (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`), then the bare name the loader resolves."""
    name = f"libnvrtc.so.{major}"
    found = [p for p in [_pathfinder_nvrtc()] if p and os.path.basename(p) == name]
    found += [os.path.join(site or ".", *WHEEL_DIRS[major], name) for site in sys.path]
    found += [os.path.join(base, "lib64", name) for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if base]
    return [*dict.fromkeys(p for p in found if os.path.isfile(p)), name]


@functools.cache
def nvrtc(major: int) -> Nvrtc:
    """Return NVRTC of CUDA `major` (loaded once); NvrtcError where it is not installed."""
    for path in library_candidates(major):
        try:
            # its builtins first: libnvrtc opens them by name, which a wheel's directory does not resolve
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        found = Nvrtc(lib, path)
        if found.version[0] == major:
            return found
    raise NvrtcError(f"NVRTC {major} is not available (libnvrtc.so.{major}); install the 'test' extra")


def available() -> list[Nvrtc]:
    """Return every NVRTC of `NVRTC_MAJORS` that loads, oldest first."""
    out = []
    for major in NVRTC_MAJORS:
        try:
            out.append(nvrtc(major))
        except NvrtcError:
            continue
    return out


def nvrtc_status() -> tuple[bool, str]:
    """Return (any NVRTC available, a few words: which versions load, which do not)."""
    found = available()
    missing = sorted(set(NVRTC_MAJORS) - {n.version[0] for n in found})
    if not found:
        names = " or ".join(f"libnvrtc.so.{m}" for m in missing)
        return False, f"NVRTC is not available (no {names}); install the 'test' extra"
    return True, ", ".join(n.name for n in found) + "".join(f"; NVRTC {m} not found" for m in missing)


def check_source(source: str, arch: str = "sm_80", name: str = "kernel.cu", major: int | None = None) -> int:
    """Compile `source` (with the portability layer) for `arch` with NVRTC `major` (default:
    `ARCH_NVRTC`'s for the arch, or the newest available where that one is not); return the PTX
    size in bytes."""
    if major is not None:
        compiler = nvrtc(major)
    else:
        found = {n.version[0]: n for n in available()}
        if not found:
            raise NvrtcError(nvrtc_status()[1])
        compiler = found.get(ARCH_NVRTC.get(arch, 0)) or found[max(found)]
    return compiler.compile(gpu_text(source), arch, name)


def check_module(module, archs: tuple[str, ...] = ARCHS) -> dict[str, int]:
    """Compile all kernel.fused sources of `module` as one program per arch (kernels with
    one name are one kernel), each arch with its NVRTC (`ARCH_NVRTC`); return {arch: PTX bytes}."""
    from hspmd.dialects.kernel import FusedOp

    sources: dict[str, str] = {}
    for op in module.walk():
        if isinstance(op, FusedOp):
            sources.setdefault(op.kernel.data, op.source.data)
    text = "\n".join(sources.values())
    return {arch: check_source(text, arch, "program.cu") for arch in archs}
