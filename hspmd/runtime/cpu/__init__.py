"""The CPU backend's own machinery: what only a CPU rank runs.

The runtime's C++ library (`native`: its build, loading and parallel loop; `native/*.cpp`),
batch chains run by slices (`batch_chain`: causal attention's products and softmax), batched
small products in one C++ call (`small_matmul`), products split over the batch or run in pairs
on two threads (`batch_split`, `paired_matmul`), triangular products by blocks
(`triangular_matmul`), large row kernels on blocks of rows (`rows`) and BLAS threads chosen by
measurement (`blas_threads`). The GPU's counterpart is `hspmd/runtime/cuda/`; what both use
(the schedule, the plans' common parts, the communicators) stays in `hspmd/runtime/`.
"""
