"""The GPU kernel of `graph.embedding_grad` (ids sorted with their positions, then a block per
table row summing its ids' rows in order) against the NumPy scatter, bit for bit, built for the
CPU under `cuda_emu.h`: repeated ids, unused rows, a piece of a vocabulary split over ranks."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, f32, i64

from hspmd.dialects import graph
from hspmd.dialects.kernel import FusedOp
from hspmd.codegen import cpu_compile
from hspmd.runtime.kernel_exec import kernel_for, numpy_call, program_library
from hspmd.transforms.device_kernels import device_module


def _program(ids_shape, vocab, dim):
    """Return a module whose function computes embedding_grad(ids, dy) as one GPU kernel."""
    ids_t, dy_t = TensorType(i64, ids_shape), TensorType(f32, (*ids_shape, dim))
    fn = func.FuncOp("step", ((ids_t, dy_t), (TensorType(f32, (vocab, dim)),)))
    ids, dy = fn.body.block.args
    op = graph.EmbeddingGradOp(ids, dy, TensorType(f32, (vocab, dim)))
    fn.body.block.add_ops([op, func.ReturnOp(op.result)])
    module = ModuleOp([fn])
    device_module(module)
    (kernel,) = [o for o in module.walk() if isinstance(o, FusedOp)]
    return module, kernel


@pytest.mark.parametrize("ids_shape,vocab,dim", [((4, 5), 7, 3), ((3, 37), 50, 16), ((1,), 4, 2), ((2, 64), 1000, 8)])
def test_the_sorted_scatter_gives_the_numpy_scatters_bits(ids_shape, vocab, dim):
    if cpu_compile.find_compiler() is None:
        pytest.skip("needs a C++ compiler (the kernel's CPU build)")
    module, op = _program(ids_shape, vocab, dim)
    assert program_library(module) is not None  # the CUDA C under cuda_emu.h, not NumPy
    launches = op.launch_list
    assert launches[0][1].endswith("_keys") and launches[-1][0] == "row" and launches[-1][2:] == (vocab, dim)
    rng = np.random.default_rng(len(ids_shape) + vocab)
    ids = rng.integers(0, min(vocab, 6), ids_shape)  # few distinct ids: long runs of each
    dy = rng.standard_normal((*ids_shape, dim)).astype(np.float32)
    np.testing.assert_array_equal(kernel_for(op)(ids, dy), numpy_call(op)(ids, dy))
    ids = rng.integers(0, vocab, ids_shape)
    np.testing.assert_array_equal(kernel_for(op)(ids, dy), numpy_call(op)(ids, dy))


def test_the_sort_takes_a_pass_per_step_of_a_bitonic_network():
    _, op = _program((3, 37), 50, 16)  # 111 ids, padded to 128 = 2^7: 7 * 8 / 2 passes
    sorts = [n1 for _, name, _, n1 in op.launch_list if name.endswith("_sort")]
    assert len(sorts) == 28 and len(set(sorts)) == 28
    assert op.scratch_sizes == (128 * 2,)


@pytest.mark.gpu
def test_on_a_gpu_the_sorted_scatter_gives_the_numpy_scatters_bits():
    from hspmd.codegen import cupy_backend

    ok, why = cupy_backend.gpu_status()
    if not ok:
        pytest.skip(f"needs CuPy and a CUDA GPU: {why}")
    import cupy

    rng = np.random.default_rng(0)
    for ids_shape, vocab, dim in (((3, 37), 50, 16), ((8, 1024), 50257, 64)):
        _, op = _program(ids_shape, vocab, dim)
        ids = rng.integers(0, vocab, ids_shape)
        ids[0, :8] = 3  # a run of one id
        dy = rng.standard_normal((*ids_shape, dim)).astype(np.float32)
        got = cupy_backend.kernel_for(op)(cupy.asarray(ids), cupy.asarray(dy))
        np.testing.assert_array_equal(cupy.asnumpy(got), numpy_call(op)(ids, dy))
