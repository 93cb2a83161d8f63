"""BLAS threads chosen by measurement (`hspmd.runtime.cpu.blas_threads`)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from hspmd.runtime.cpu.blas_threads import BlasThreads


def _blas_threads() -> int:
    return max(lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info())


# GPT-tiny's products (step_vs_torch.py): rows x d_model @ d_model x 4 d_model, its weight
# gradient, and attention's batched products
GPT_TINY = [((2048, 256), (256, 1024)), ((256, 2048), (2048, 1024)), ((64, 128, 64), (64, 64, 128)),
            ((64, 128, 128), (64, 128, 64))]


@pytest.mark.parametrize("shape", GPT_TINY)
def test_gpt_tiny_products_have_the_same_bits_on_one_thread_and_on_two(shape):
    """What the benchmark's "auto" relies on for the same losses: these shapes' bits do not
    depend on the thread count (not true of every shape: see the module docstring)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s, dtype=np.float32) for s in shape)
    controller = ThreadpoolController().select(user_api="blas")
    with controller.limit(limits=2):
        two = np.matmul(a, b)
    with controller.limit(limits=1):
        one = np.matmul(a, b)
    assert one.tobytes() == two.tobytes()


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
