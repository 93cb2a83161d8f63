"""Build generated CUDA C kernels for the CPU with the host C++ compiler, cached by content.

All kernels of one program go into ONE shared library (`build_library`): the sources are
compiled under `cuda_emu.h` in the serial block emulation (namespace `hs_serial`: one thread
per block, and the row loop `HS_ROWS` becomes an `omp for` that gives each OpenMP thread a
contiguous range of rows) and, on request (`team=True`, for tests), once more in the team
emulation (namespace `hs_team`: an OpenMP team per block, for blockDim > 1, rows by blockIdx
as on a GPU); an `extern "C"` launcher per launch calls the right one:

    void hs_launch_NAME(void **args, long n0, long n1, int team)

The library is cached under `$HSPMD_CACHE_DIR` (default `~/.cache/hspmd/kernels`) by a hash
of its text, the headers, the compiler's identity and the flags; it is written to a private
temporary name and renamed into place, so ranks compiling the same program at once never
see a half-written file. `find_compiler()` says once per process when there is no compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADERS = ("cuda_emu.h", "hs_float16.cuh", "hs_common.cuh")


class CompileError(Exception):
    """The host compiler rejected a generated library (its log is the message)."""


@dataclass(frozen=True)
class LaunchSpec:
    """One launch of a kernel: its kind, the `__global__` function, and its pointer argument types."""

    kind: str
    function: str
    arg_types: tuple[str, ...]  # C element type of each pointer argument, in call order


@functools.cache
def find_compiler() -> str | None:
    """Return the path of the host C++ compiler (`$CXX`, else g++, else c++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def compiler_identity(cxx: str) -> str:
    """Return a string naming the compiler's version and target (part of the cache key)."""
    out = []
    for flag in ("-dumpfullversion", "-dumpmachine"):
        try:
            out.append(subprocess.run([cxx, flag], capture_output=True, text=True, timeout=30).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            out.append("?")
    return f"{cxx} {' '.join(out)}"


@functools.cache
def compile_flags() -> tuple[str, ...]:
    """Return the flags of every build: -O3, OpenMP, no errno from libm (so sqrt inlines), no loop
    splitting, AVX2+FMA and AVX-512 when this CPU has them, then `$HSPMD_CXXFLAGS`. No -ffast-math and no contraction of a*b+c into one FMA:
    NaN, infinities and the rounding of each operation stay IEEE, as in NumPy."""
    flags = ["-O3", "-std=c++17", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
             "-ffp-contract=off",
             # no splitting of a loop at a condition on its index (a causal mask's j > i): split, the
             # vector loop before the split point left a scalar remainder of up to 15 columns a row,
             # each a scalar exp (a causal softmax took 1.6 ms for GPT-tiny's 8192 rows, 0.95 unsplit)
             "-fno-split-loops"]
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    words = set(cpu.split())
    if {"avx2", "fma"} <= words:
        flags += ["-mavx2", "-mfma"]
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= words:  # 16 floats a vector: exp-heavy loops gain most
        flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
    flags += os.environ.get("HSPMD_CXXFLAGS", "").split()  # extra flags, part of the cache key
    return tuple(flags)


def cache_dir() -> Path:
    """Return the kernel cache folder (`$HSPMD_CACHE_DIR` or `~/.cache/hspmd/kernels`)."""
    root = os.environ.get("HSPMD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "hspmd" / "kernels"


def _launcher(spec: LaunchSpec, team: bool) -> str:
    args = ", ".join(f"({t}*)a[{i}]" for i, t in enumerate(spec.arg_types))
    args = f"{args}, n0, n1" if args else "n0, n1"
    head = f'extern "C" void hs_launch_{spec.function}(void **a, long n0, long n1, int team) {{\n'
    # the serial emulation: the launch in chunks (hs_emu::run_chunks: rows, items by vectors, or
    # a column launch's columns (n1 > 0: a norm's weight gradients) by 128, so that a chunk reads
    # long runs of each row)
    units = "(n1 > 0 ? n0 / 128 : n0 / 16)" if spec.kind == "elementwise" else "n0"
    chunked = (
        f"hs_emu::run_chunks({{+[](void **a, long n0, long n1) {{ (void)a; (void)n1; "
        f"hs_serial::{spec.function}({args}); }}, a, n0, n1, 1}}, {units}, n0 * (n1 > 1 ? n1 : 1));\n"
    )
    if spec.kind == "elementwise":
        body = "  (void)team;\n  " + chunked
    else:
        body = "  if (team <= 1) {\n    " + chunked + "    return;\n  }\n"
        if not team:
            return head + body + "  abort();  // built without the team emulation\n}\n"
        body += (
            "  for (long b = 0; b < n0; ++b) {\n"
            "#pragma omp parallel num_threads(team)\n"
            "    {\n"
            "      hs_emu::blockIdx = {(unsigned)b, 0, 0}; hs_emu::gridDim = {(unsigned)n0, 1, 1};\n"
            "      hs_emu::threadIdx = {(unsigned)omp_get_thread_num(), 0, 0};\n"
            "      hs_emu::blockDim = {(unsigned)omp_get_num_threads(), 1, 1};\n"
            f"      hs_team::{spec.function}({args});\n"
            "    }\n"
            "  }\n"
        )
    return head + body + "}\n"


def library_text(sources: list[str], launches: list[LaunchSpec], team: bool = False) -> str:
    """Return the C++ translation unit holding `sources` in the serial emulation (and, with
    `team`, in the team emulation too) plus the launchers."""
    src = "\n".join(sources)
    serial = (
        '#include "cuda_emu.h"\n'
        '#include "hs_float16.cuh"\n'
        "namespace hs_serial {\n"
        "using hs_emu::blockIdx; using hs_emu::gridDim;\n"
        "static constexpr hs_dim3 threadIdx{0, 0, 0}, blockDim{1, 1, 1};\n"
        "template <class T> static inline T __shfl_down_sync(unsigned, T v, int) { return v; }\n"
        "#define __syncthreads()\n#define HS_SERIAL_BLOCK 1\n"
        "#undef HS_ROWS\n#define HS_ROWS(r, n) HS_ROWS_CHUNK(r, n)\n"
        "#undef HS_FOR\n#define HS_FOR(i, n) HS_FOR_CHUNK(i, n)\n"
        "#undef HS_COLUMN_RANGE\n#define HS_COLUMN_RANGE(c0, c1, n) HS_COLUMN_RANGE_CHUNK(c0, c1, n)\n"
        '#include "hs_common.cuh"\n'
        f"{src}\n"
        "#undef HS_SERIAL_BLOCK\n#undef __syncthreads\n"
        "#undef HS_FOR\n#define HS_FOR(i, n) HS_FOR_OMP(i, n)\n"
        "#undef HS_COLUMN_RANGE\n#define HS_COLUMN_RANGE(c0, c1, n) HS_COLUMN_RANGE_OMP(c0, c1, n)\n"
        "}  // namespace hs_serial\n"
        'extern "C" void hs_set_parallel(hs_emu::parallel_fn f) { hs_emu::parallel = f; }\n'
    )
    team_part = (
        "namespace hs_team {\n"
        "using hs_emu::blockIdx; using hs_emu::gridDim; using hs_emu::threadIdx; using hs_emu::blockDim;\n"
        "template <class T> static inline T __shfl_down_sync(unsigned, T v, int d) { return hs_team_shfl_down(v, d); }\n"
        "#define __syncthreads() HS_PRAGMA(omp barrier)\n"
        "#undef HS_ROWS\n#define HS_ROWS(r, n) for (long r = blockIdx.x; r < (long)(n); r += gridDim.x)\n"
        '#include "hs_common.cuh"\n'
        f"{src}\n"
        "#undef __syncthreads\n"
        "}  // namespace hs_team\n"
        'extern "C" { int hs_has_team = 1; }\n'
    )
    return serial + (team_part if team else "") + "".join(_launcher(s, team) for s in launches)


def library_key(text: str, cxx: str) -> str:
    """Return the cache key of a library: hash of its text, the headers, compiler and flags."""
    h = hashlib.sha256()
    for part in (text, *((HERE / n).read_text() for n in HEADERS), compiler_identity(cxx), " ".join(compile_flags())):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def build_library(sources: list[str], launches: list[LaunchSpec], cxx: str | None = None, team: bool = False) -> Path:
    """Compile (or find in the cache) the library of `sources`; return the .so path.

    `team` also builds the team emulation (blockDim > 1; for tests: it doubles the compile
    time). CompileError if there is no compiler or it rejects the text.
    """
    return _build_cached(library_text(sources, launches, team), cxx)


def build_native(sources: list[Path], cxx: str | None = None) -> Path:
    """Compile (or find in the cache) a plain C++ library of the runtime's own, its `sources`
    (such as `hspmd/runtime/native/parallel.cpp` and `small_matmul.cpp`) one translation unit in
    that order; return the .so path.

    The same flags and cache as the kernels' libraries (`compile_flags`, `cache_dir`).
    CompileError if there is no compiler or it rejects the files.
    """
    return _build_cached("\n".join(Path(s).read_text() for s in sources), cxx)


def _build_cached(text: str, cxx: str | None) -> Path:
    """Return the cached .so of C++ translation unit `text`, compiling it first if needed."""
    cxx = cxx or find_compiler()
    if cxx is None:
        raise CompileError("no C++ compiler found ($CXX, g++, c++ or clang++)")
    key = library_key(text, cxx)
    folder = cache_dir()
    target = folder / f"hs_{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hspmd-build-", dir=folder) as tmp:
        cpp = Path(tmp) / "kernels.cpp"
        cpp.write_text(text)
        out = Path(tmp) / "kernels.so"
        cmd = [cxx, *compile_flags(), f"-I{HERE}", str(cpp), "-o", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as err:
            raise CompileError(f"{cxx} could not run: {err}") from None
        if proc.returncode != 0:
            raise CompileError(f"{cxx} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(out, target)  # atomic on one file system: other ranks see all or nothing
    return target


class Library:
    """A loaded kernel library: `launch(function, arrays, n0, n1, team)` runs one launch."""

    def __init__(self, path: Path):
        self.path = path
        #: the loaded library (ctypes)
        self.dll = ctypes.CDLL(str(path))
        self._fns: dict[str, ctypes._CFuncPtr] = {}
        #: whether the library holds the team emulation (blockDim > 1)
        self.has_team = hasattr(self.dll, "hs_has_team")

    def function(self, name: str):
        """Return the ctypes launcher of `__global__` function `name`."""
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self.dll, f"hs_launch_{name}")
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_long, ctypes.c_long, ctypes.c_int]
            fn.restype = None
            self._fns[name] = fn
        return fn


@functools.cache
def load_library(path: Path) -> Library:
    """Return the loaded library at `path` (loaded once per process).

    Before the first load, OMP_WAIT_POLICY defaults to passive: a kernel's threads sleep as
    soon as it ends instead of busy-waiting for the next one, which (measured) took the cores
    from the BLAS threads of the matmuls between kernels and from other OpenMP runtimes in the
    process (PyTorch's), making a GPT step up to twice as slow. An explicit setting is kept.
    OMP_DYNAMIC is left as it is: the kernels run their chunks on the runtime's own parallel
    loop, not in OpenMP teams, and OMP_DYNAMIC=true in the environment made PyTorch, loaded
    after the kernels in the same process, run its operators on fewer threads (GPT-tiny's eager
    step 609 ms against 331).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    return Library(path)
