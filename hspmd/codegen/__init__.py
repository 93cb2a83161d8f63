"""Code generation below the physical IR: CUDA C kernels from `kernel.fused` ops, execution
schedules, and the bundle a compiled program is written as.

`emit_cuda` writes the kernels' source against a small portability layer
(`hs_common.cuh` + `cuda_preamble.cuh` for GPUs, `cuda_emu.h` for CPUs); `cpu_compile`
builds a program's kernels with the host C++ compiler into one cached shared library;
`nvrtc_check` compiles them with NVRTC without a GPU; `cupy_backend` runs them with CuPy;
`dump` writes them out for `hspmd compile --emit kernels`. See docs/kernels.md.
`schedule` turns a physical step function into a finished schedule (order, buffers, in-place
updates, all-reduce buckets) that `hspmd.runtime.plan` binds and runs (docs/runtime.md);
`bundle` is the format of a compiled program on disk (levels, kernel level, manifest).
"""
