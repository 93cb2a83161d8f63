"""BLAS threads chosen by measurement (`hspmd.runtime.cpu.blas_threads`)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from hspmd.runtime.cpu.blas_threads import BlasCount, BlasThreads, OneThreadBits, same_bits


def _blas_threads() -> int:
    return max(lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info())


# GPT-tiny's products (step_vs_torch.py): rows x d_model @ d_model x 4 d_model, its weight
# gradient, and attention's batched products
GPT_TINY = [((2048, 256), (256, 1024)), ((256, 2048), (2048, 1024)), ((64, 128, 64), (64, 64, 128)),
            ((64, 128, 128), (64, 128, 64))]


@pytest.mark.parametrize("shape", GPT_TINY)
def test_one_thread_bits_are_checked_on_the_call_itself(shape):
    """`OneThreadBits` says whether GPT-tiny's products keep their bits on one BLAS thread (true of
    OpenBLAS on many CPUs, not on all: an AMD EPYC's attention products differ): what it says is
    what the two products show, once per kind of call, with BLAS's count restored."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s, dtype=np.float32) for s in shape)
    controller = ThreadpoolController().select(user_api="blas")
    with controller.limit(limits=2):
        two = np.matmul(a, b)
    with controller.limit(limits=1):
        one = np.matmul(a, b)
    blas = BlasCount()
    check = OneThreadBits(blas)
    with controller.limit(limits=2):
        out = np.empty_like(two)
        assert check.same(np.matmul, (a, b), out, 2) == same_bits(one, two)
        assert blas.get() == 2
        check._blas = None  # a second call of the same kind runs nothing
        assert check.same(np.matmul, (a, b), out, 2) == same_bits(one, two)


def test_same_bits_sees_signed_zeros_and_nans():
    x = np.array([0.0, 1.0, np.nan], np.float32)
    assert same_bits(x, x.copy())
    assert not same_bits(x, np.array([-0.0, 1.0, np.nan], np.float32))
    assert not same_bits(x, x.astype(np.float64))
    assert not same_bits(x[:2], x[1:])


def test_each_choice_is_tried_then_the_faster_runs():
    blas = BlasThreads(most=2, probe_every=100)
    assert blas.choices == (1, 2)
    assert blas.pick() == 2
    blas.record(2, 1.0)
    assert blas.pick() == 1
    blas.record(1, 3.0)
    assert [blas.pick() for _ in range(5)] == [2] * 5


def test_a_slowed_choice_makes_the_other_be_tried_again_once():
    blas = BlasThreads(most=2, probe_every=100)
    blas.record(2, 1.0)
    blas.record(1, 2.0)
    assert blas.pick() == 2
    blas.record(2, 4.0)  # the machine got busy
    assert blas.pick() == 1  # tried again
    blas.record(1, 1.5)
    assert blas.pick() == 1  # now the faster
    blas.record(1, 1.6)
    assert blas.pick() == 1  # not slowed beyond 1.3x its best: no probe
    blas.record(1, 1.55)
    blas.record(2, 4.0)
    assert blas.pick() == 1


def test_probes_the_other_every_so_many_steps():
    blas = BlasThreads(most=2, probe_every=3)
    blas.record(2, 1.0)
    blas.record(1, 2.0)
    picks = []
    for _ in range(8):
        n = blas.pick()
        picks.append(n)
        blas.record(n, 1.0 if n == 2 else 2.0)
    assert picks == [2, 2, 2, 1, 2, 2, 2, 1]


def test_the_thread_count_is_restored_after_each_step():
    before = _blas_threads()
    blas = BlasThreads(most=2)
    seen = []
    for _ in range(3):
        with blas.around_step() as n:
            seen.append((n, _blas_threads()))
        assert _blas_threads() == before
    assert all(n == inside for n, inside in seen)
    assert {n for n, _ in seen} == {1, 2}


def test_one_thread_is_one_choice():
    blas = BlasThreads(most=1)
    assert blas.choices == (1,)
    with blas.around_step() as n:
        assert n == 1
