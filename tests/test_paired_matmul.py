"""Two large independent products at once, one BLAS thread each (`runtime/cpu/paired_matmul.py`):
the bits of the two calls one after the other, BLAS's thread count restored, a pair run one
after the other where the second result shares memory with the first's operands, and a GPT
step's parameters bit-identical with and without pairs."""

from __future__ import annotations


import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

from hspmd.dialects.graph.matmul import matmul_rhs_grad_values as matmul_rhs_grad
from hspmd.dialects.graph.matmul import matmul_values as matmul
from hspmd.runtime.cpu.paired_matmul import PAIR_PRODUCT, ProductPairs, product_size

from conftest import gpt_cpu_step, train_plan


def _blas_threads() -> int:
    return min(lib.num_threads for lib in ThreadpoolController().select(user_api="blas").lib_controllers)


def _backward_operands(rng, m=2048, k=256, n=1024):
    """x, w, dy of a layer `x @ w` and the (preallocated) input and weight gradients."""
    x = rng.standard_normal((16, m // 16, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    dy = rng.standard_normal((16, m // 16, n), dtype=np.float32)
    return x, w, dy, np.empty_like(x), np.empty_like(w)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pair_gives_the_bits_of_the_two_calls(threads):
    """GPT-tiny's MLP shapes (256 x 1024): dx = dy @ w^T and dw = x^T dy, paired or not: the bits
    of the two calls on the same BLAS threads (paired only where one thread keeps them)."""
    rng = np.random.default_rng(0)
    x, w, dy, dx, dw = _backward_operands(rng)
    assert product_size("graph.matmul", dy.shape, w.T.shape) >= PAIR_PRODUCT
    pairs = ProductPairs()
    first_kw, second_kw = {"out": dx}, {"out": dw}
    launch, join = pairs.pair(matmul, first_kw, matmul_rhs_grad, second_kw)
    with threadpool_limits(threads, user_api="blas"):
        for _ in range(2):  # the second time, the helper is already off this CPU
            assert launch(dy, w.T, **first_kw) is dx
            assert join(x, dy, **second_kw) is dw
            assert _blas_threads() == threads
        whole_dx, whole_dw = matmul(dy, w.T), matmul_rhs_grad(x, dy)  # on the same BLAS threads
    np.testing.assert_array_equal(dx, whole_dx)
    np.testing.assert_array_equal(dw, whole_dw)


def test_a_second_result_over_the_first_operands_runs_after_it():
    """Where the schedule reuses a buffer of the first product's operand for the second's
    result, the pair runs one after the other (else the first would read what the second writes)."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 32), dtype=np.float32), rng.standard_normal((32, 48), dtype=np.float32)
    expect_first = a @ b
    first_out = np.empty((64, 48), np.float32)
    second_out = a[:32]  # the second product writes into the first's operand
    c, d = rng.standard_normal((32, 16), dtype=np.float32), rng.standard_normal((16, 32), dtype=np.float32)
    pairs = ProductPairs()
    launch, join = pairs.pair(matmul, {"out": first_out}, matmul, {"out": second_out})
    with threadpool_limits(2, user_api="blas"):
        launch(a, b, out=first_out)
        join(c, d, out=second_out)
    np.testing.assert_array_equal(first_out, expect_first)
    np.testing.assert_array_equal(second_out, c @ d)


def test_an_error_in_either_product_restores_blas_threads():
    pairs = ProductPairs()

    def broken(a, b, out=None):
        raise RuntimeError("kernel failed")

    rng = np.random.default_rng(2)
    x, w, dy, dx, dw = _backward_operands(rng, m=64, k=8, n=16)
    for first, second in ((broken, matmul_rhs_grad), (matmul, broken)):
        launch, join = pairs.pair(first, {"out": dx}, second, {"out": dw})
        with threadpool_limits(2, user_api="blas"):
            with pytest.raises(RuntimeError, match="kernel failed"):
                launch(dy, w.T, out=dx)
                join(x, dy, out=dw)
            assert _blas_threads() == 2


@pytest.mark.parametrize("name, a, b, size", [
    ("graph.matmul", (16, 128, 256), (256, 1024), 2048 * 256 * 1024),     # rows times a weight
    ("graph.matmul_rhs_grad", (16, 128, 256), (16, 128, 1024), 2048 * 256 * 1024),
    ("graph.matmul", (16, 4, 128, 64), (16, 4, 64, 128), 0),              # a batch: not paired
    ("graph.add", (4, 4), (4, 4), 0),
])
def test_product_size(name, a, b, size):
    assert product_size(name, a, b) == size


def test_a_gpt_step_is_bit_identical_with_pairs(monkeypatch):
    """A small GPT (every linear layer's gradients paired: the size floor lowered), 3 steps with
    BLAS on two threads: the same losses and parameters, bit for bit, as without pairs."""
    import hspmd.runtime.plan as plan_module
    from hspmd.runtime.comm import InProcessCommunicator

    monkeypatch.setattr(plan_module, "PAIR_PRODUCT", 1)
    script, compiled, fn = gpt_cpu_step({"model.layers": 2, "model.d_model": 64, "model.heads": 2,
                                         "model.seq_len": 32, "data.batch_size": 8, "model.vocab_size": 128})
    results = {}
    with threadpool_limits(2, user_api="blas"):
        for pair in (False, True):
            plan = plan_module.build_plan(fn, 0, InProcessCommunicator.create_world(1)[0], pair_products=pair)
            paired = sum(getattr(f, "__qualname__", "").endswith("pair.<locals>.launch") for f, *_ in plan.steps)
            assert (paired > 0) == pair
            results[pair] = train_plan(plan, script, compiled)
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], value, err_msg=name)
