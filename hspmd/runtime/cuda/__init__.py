"""The GPU backend: a finished schedule bound to one device's memory, kernels and GEMMs.

A device program (the kernel level after `device-kernels`: every op a `kernel.fused` CUDA C
kernel, a GEMM or a view) is scheduled as on the CPU (`codegen/schedule/`, `device=True`:
buffers by liveness, in-place updates, every result in a buffer allocated once) and bound to
a `Device` (`device.py`): one arena of device memory per rank holds the parameters and
optimizer states (from initialization to the end of the run), the inputs, the constants and
the buffers; every value is a view into it, so every pointer of every launch is known when
the plan is built (`plan.py`), and a step is a fixed list of launches and GEMMs that a CUDA
graph can capture once and replay. Only the inputs go in and the outputs (the loss) come back.

Two devices implement the one narrow interface: `CupyDevice` (`cupy_device.py`: a CUDA GPU
through CuPy, kernels as RawModules, cuBLAS through its C API on the plan's stream, CUDA
graphs) and `EmulatedDevice` (`emulated.py`: host memory as device memory, the kernels' CPU
build under `cuda_emu.h`, a GEMM with cuBLAS's conventions in NumPy), which runs the whole
CUDA plan in CI, on machines without a GPU, to catch wrong offsets, strides and launches
before a GPU sees them.
"""
