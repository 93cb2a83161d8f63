"""Batches of small products by halves on two threads (`runtime/cpu/batch_split.py`): the same bits as
one `np.matmul` call, BLAS's thread count restored, nothing split where BLAS has one thread."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from hspmd.runtime.cpu.batch_split import BatchSplit, small_batched
from hspmd.runtime.cpu.blas_threads import OneThreadBits, same_bits
from hspmd.runtime.cpu.triangular_matmul import triangular_matmul


def _attention_operands(rng, dtype=np.float32):
    """q, k^T, v as attention sees them: strided views of one qkv product (16 x 4 heads, 128 x 64)."""
    qkv = rng.standard_normal((16, 128, 768)).astype(dtype).reshape(16, 128, 4, 192)
    q, k, v = (qkv[..., i * 64:(i + 1) * 64].transpose(0, 2, 1, 3) for i in range(3))
    return q, k.transpose(0, 1, 3, 2), v


def _blas_threads() -> int:
    return min(lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers)


@pytest.mark.parametrize("threads", [1, 2])
def test_halves_give_the_bits_of_one_call(threads):
    """The scores q @ k^T and the block product att @ v, into a transposed out= as the schedule
    lays attention's output out, split or not: the bits of `np.matmul` on the same BLAS threads;
    BLAS's count restored; split exactly where one thread keeps the bits (`OneThreadBits`)."""
    rng = np.random.default_rng(0)
    q, kt, v = _attention_operands(rng)
    att = np.tril(rng.random((16, 4, 128, 128), dtype=np.float32))
    split = BatchSplit()
    with threadpool_limits(threads, user_api="blas"):
        before = _blas_threads()
        scores = split.wrap(np.matmul)(q, kt)
        assert split.last_split == (before > 1 and _one_thread_keeps_bits(np.matmul, q, kt))
        out = np.empty((16, 128, 4, 64), np.float32).transpose(0, 2, 1, 3)
        product = triangular_matmul("lhs-lower")
        assert split.wrap(product)(att, v, out=out) is out
        assert _blas_threads() == before
        whole_scores = np.matmul(q, kt)
        whole = np.empty_like(out)
        product(att, v, out=whole)
    np.testing.assert_array_equal(scores, whole_scores)
    np.testing.assert_array_equal(out, whole)


def _one_thread_keeps_bits(kernel, a, b) -> bool:
    threads = _blas_threads()
    with threadpool_limits(1, user_api="blas"):
        one = kernel(a, b)
    with threadpool_limits(threads, user_api="blas"):
        return same_bits(one, kernel(a, b))


def test_a_call_whose_bits_change_on_one_thread_runs_whole(monkeypatch):
    """Where one BLAS thread would give other bits (as OpenBLAS does on some CPUs and shapes), the
    batch is not split: the call runs whole on BLAS's threads."""
    monkeypatch.setattr(OneThreadBits, "same", lambda self, kernel, args, out, threads: False)
    rng = np.random.default_rng(1)
    q, kt, _ = _attention_operands(rng)
    split = BatchSplit()
    with threadpool_limits(2, user_api="blas"):
        scores = split.wrap(np.matmul)(q, kt)
        assert not split.last_split
        np.testing.assert_array_equal(scores, np.matmul(q, kt))


def test_a_kernel_error_restores_blas_threads():
    split = BatchSplit()
    before = _blas_threads()

    def broken(a, b, out=None):
        raise RuntimeError("kernel failed")

    with threadpool_limits(max(2, before), user_api="blas"):
        expect = _blas_threads()
        with pytest.raises(RuntimeError, match="kernel failed"):
            split.wrap(broken)(np.ones((2, 3, 3)), np.ones((2, 3, 3)))
        assert _blas_threads() == expect


@pytest.mark.parametrize("a, b, small", [
    ((16, 4, 128, 64), (16, 4, 64, 128), True),   # attention's scores
    ((16, 128, 256), (256, 1024), False),          # a weight: not a batch
    ((1, 128, 64), (1, 64, 128), False),           # a batch of one
    ((4, 512, 512), (4, 512, 512), False),         # large products: BLAS's threads pay
    ((4, 8, 8), (2, 8, 8), False),                 # broadcast batch
])
def test_small_batched(a, b, small):
    assert small_batched(a, b) is small
