"""Code generation below the physical IR: CUDA C kernels from `kernel.fused` ops.

`emit_cuda` writes the kernels' source against a small portability layer
(`hs_common.cuh` + `cuda_preamble.cuh` for GPUs, `cuda_emu.h` for CPUs); `cpu_compile`
builds a program's kernels with the host C++ compiler into one cached shared library;
`nvrtc_check` compiles them with NVRTC without a GPU; `cupy_backend` runs them with CuPy;
`dump` writes them out for `hspmd compile --emit kernels`. See docs/kernels.md.
"""
