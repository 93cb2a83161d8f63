"""Forward values of the transformer op set against independent NumPy formulas.

Each op runs through the whole compiler (trace, annotate, physical, plan) on one device and
is compared with a formula written here from its definition (and with SciPy where it is
installed). The dropout hash is checked against a pure-Python splitmix64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd as hs
from hspmd.frontend.tracing import Tracer
from hspmd.dialects.levels import physical_groups
from hspmd.dialects.graph import activations, embedding, positions, reductions
from hspmd.runtime.cpu import native as native_module
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.plan import build_plan
from hspmd.compiler import annotate, to_physical

TOL = dict(rtol=1e-12, atol=1e-13)
small = st.integers(1, 4)


def run_forward(fn, **arrays):
    """Trace `y = fn(*inputs)` over inputs named and typed after `arrays`; return y run on one device."""
    t = Tracer()
    inputs = [t.input(name, a.shape, a.dtype.name) for name, a in arrays.items()]
    t.output("y", fn(*inputs))
    module = t.finish()
    annotate(module, "[0]: dp=1")
    to_physical(module)
    (_, group), = physical_groups(module)
    fn_op = next(o for o in group.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
    (comm,) = InProcessCommunicator.create_world(1)
    plan = build_plan(fn_op, 0, comm)
    return plan.run({}, plan.local_batch(arrays))["y"]


def normal(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


shapes = st.lists(small, min_size=1, max_size=3).map(tuple)


# ----------------------------------------------------------------------------- elementwise


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_elementwise(shape, seed):
    x = normal(seed, shape, 2.0)
    pos = np.abs(x) + 0.1
    erf = np.vectorize(math.erf)
    cases = {
        "exp": (hs.exp, x, np.exp(x)),
        "log": (hs.log, pos, np.log(pos)),
        "sqrt": (hs.sqrt, pos, np.sqrt(pos)),
        "rsqrt": (hs.rsqrt, pos, 1 / np.sqrt(pos)),
        "tanh": (hs.tanh, x, np.tanh(x)),
        "sigmoid": (hs.sigmoid, x, 1 / (1 + np.exp(-x))),
        "bce": (lambda v: hs.binary_cross_entropy_with_logits(v, v * 0.0 + 0.25), x,
                np.mean(np.logaddexp(0, x) - 0.25 * x)),
        "silu": (hs.silu, x, x / (1 + np.exp(-x))),
        "gelu": (hs.gelu, x, 0.5 * x * (1 + erf(x / math.sqrt(2)))),
        "gelu_tanh": (lambda v: hs.gelu(v, approximate="tanh"), x,
                      0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
        "pow3": (lambda v: v**3, x, x**3),
        "pow-1.5": (lambda v: v**-1.5, pos, pos**-1.5),
        "neg": (lambda v: -v, x, -x),
        "rdiv": (lambda v: 2.0 / v, pos, 2.0 / pos),
    }
    for name, (fn, value, expect) in cases.items():
        np.testing.assert_allclose(run_forward(fn, x=value), expect, **TOL, err_msg=name)


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), bcast=st.booleans())
def test_divide_broadcasts(shape, seed, bcast):
    a = normal(seed, shape)
    b = np.abs(normal(seed + 1, shape[-1:] if bcast else shape)) + 0.5
    np.testing.assert_allclose(run_forward(lambda x, y: x / y, a=a, b=b), a / b, **TOL)


def test_erf_fallback_is_float64_accurate():
    """The erf used without SciPy agrees with math.erf to ~1e-15 over the whole range."""
    x = np.concatenate([np.linspace(-9, 9, 20001), [0.0, 1e-300, -1e-8, 2.9999999, 3.0, 3.0000001]])
    expect = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(activations.erf_series(x), expect, rtol=0, atol=2e-15)


def test_erf_agrees_with_scipy():
    special = pytest.importorskip("scipy.special", reason="SciPy is not installed")
    x = np.linspace(-7, 7, 1001)
    np.testing.assert_allclose(activations.erf_values(x), special.erf(x), rtol=0, atol=1e-15)
    np.testing.assert_allclose(activations.erf_series(x), special.erf(x), rtol=0, atol=2e-15)


def test_casts():
    x = normal(0, (3, 5), 100.0)
    np.testing.assert_array_equal(run_forward(lambda v: hs.cast(v, "float32"), x=x), x.astype(np.float32))
    np.testing.assert_array_equal(run_forward(lambda v: hs.cast(v, "float16"), x=x), x.astype(np.float16))
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (no bfloat16)")
    y = run_forward(lambda v: hs.cast(hs.cast(v, "bfloat16"), "float64"), x=x)
    np.testing.assert_array_equal(y, x.astype(ml_dtypes.bfloat16).astype(np.float64))


# ----------------------------------------------------------------------------- products, reductions


@settings(max_examples=10, deadline=None)
@given(batch=st.lists(small, max_size=2).map(tuple), m=small, k=small, n=small, two_d=st.booleans(),
       seed=st.integers(0, 2**16))
def test_batched_matmul(batch, m, k, n, two_d, seed):
    a = normal(seed, (*batch, m, k))
    b = normal(seed + 1, (k, n) if two_d else (*batch, k, n))
    expect = np.einsum("...mk,kn->...mn", a, b) if two_d else np.einsum("...mk,...kn->...mn", a, b)
    np.testing.assert_allclose(run_forward(lambda x, y: x @ y, a=a, b=b), expect, **TOL)


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_max(shape, seed, data):
    x = normal(seed, shape)
    dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    expect = np.max(x, axis=tuple(sorted({d % len(shape) for d in dims})))
    np.testing.assert_array_equal(run_forward(lambda v: v.max(dims), x=x), expect)


def test_max_gradient_splits_ties_evenly():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, -1.0]])
    np.testing.assert_array_equal(reductions.reduce_max_grad_values(x, x.max(1), np.array([1.0, 4.0]), (1,)), [[0, 0.5, 0.5], [4.0, 0, 0]])


# ----------------------------------------------------------------------------- normalisation


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_softmax(shape, seed, data):
    x = normal(seed, shape, 3.0)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    e = np.exp(x)
    np.testing.assert_allclose(run_forward(lambda v: hs.softmax(v, dim), x=x), e / e.sum(axis=dim, keepdims=True),
                               **TOL)


@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_layer_norm_and_rms_norm(shape, seed):
    x, w, b = normal(seed, shape, 2.0) + 1.0, normal(seed + 1, shape[-1:]), normal(seed + 2, shape[-1:])
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(run_forward(lambda *v: hs.layer_norm(*v, eps=1e-5), x=x, w=w, b=b),
                               (x - mean) / np.sqrt(var + 1e-5) * w + b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(run_forward(lambda v: hs.layer_norm(v), x=x), (x - mean) / np.sqrt(var + 1e-5),
                               rtol=1e-10, atol=1e-12)
    ms = (x * x).mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(run_forward(lambda v, g: hs.rms_norm(v, g, eps=1e-6), x=x, w=w),
                               x / np.sqrt(ms + 1e-6) * w, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- indexing


@settings(max_examples=10, deadline=None)
@given(ids_shape=shapes, vocab=small, dim=small, seed=st.integers(0, 2**16))
def test_embedding_and_its_gradient(ids_shape, vocab, dim, seed):
    table = normal(seed, (vocab, dim))
    ids = np.random.default_rng(seed).integers(0, vocab, size=ids_shape)
    expect = np.array([table[i] for i in ids.reshape(-1)]).reshape(*ids_shape, dim)
    np.testing.assert_array_equal(run_forward(hs.embedding, table=table, ids=ids), expect)
    dy = normal(seed + 1, (*ids_shape, dim))
    scatter = np.zeros((vocab, dim))
    for i, row in zip(ids.reshape(-1), dy.reshape(-1, dim)):
        scatter[i] += row
    np.testing.assert_allclose(embedding.embedding_grad_values(ids, dy, vocab), scatter, **TOL)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), vocab=st.integers(1, 40), dim=small, seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float32, np.float64]), index_dtype=st.sampled_from([np.int32, np.int64]),
       native=st.booleans())
def test_scatter_add_rows_is_add_at_bit_for_bit(n, vocab, dim, seed, dtype, index_dtype, native):
    """The scatter-add adds each row's contributions in the same order as np.add.at (same
    bits): in C++ (`native`), and grouped in NumPy below and above the repeat count where it
    hands over to np.add.at."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, vocab, size=n).astype(index_dtype)
    rows = rng.standard_normal((n, dim)).astype(dtype) * 10.0 ** rng.integers(-3, 4, size=(n, 1))
    start = rng.standard_normal((vocab, dim)).astype(dtype)
    expect = start.copy()
    np.add.at(expect, index, rows)
    got = embedding.scatter_add_rows(start.copy(), index, rows, native=native_module if native else None)
    np.testing.assert_array_equal(got.view(np.uint8), expect.view(np.uint8))


def test_scatter_add_rows_refuses_an_index_out_of_range():
    with pytest.raises(IndexError, match="index 5 is out of bounds"):
        embedding.scatter_add_rows(np.zeros((5, 3), np.float32), np.array([0, 5]), np.ones((2, 3), np.float32))


@settings(max_examples=10, deadline=None)
@given(lead=st.lists(small, max_size=2).map(tuple), tq=small, tk=small, seed=st.integers(0, 2**16))
def test_causal_mask(lead, tq, tk, seed):
    s = normal(seed, (*lead, tq, tk))
    masked = run_forward(hs.causal_mask, s=s)
    for i in range(tq):
        for j in range(tk):
            if j > i:
                assert np.all(masked[..., i, j] == -np.inf)
            else:
                np.testing.assert_array_equal(masked[..., i, j], s[..., i, j])
    probs = run_forward(lambda v: hs.softmax(hs.causal_mask(v), -1), s=s)
    assert np.all(probs[..., np.triu_indices(tq, 1, tk)[0], np.triu_indices(tq, 1, tk)[1]] == 0)


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(st.integers(2, 5), min_size=1, max_size=3).map(tuple), seed=st.integers(0, 2**16),
       data=st.data())
def test_split_concat_slice(shape, seed, data):
    x = normal(seed, shape)
    d = data.draw(st.integers(0, len(shape) - 1))
    cut = data.draw(st.integers(1, shape[d] - 1))
    a, b = np.split(x, [cut], axis=d)
    np.testing.assert_array_equal(run_forward(lambda v: hs.split(v, [cut, shape[d] - cut], d)[1], x=x), b)
    np.testing.assert_array_equal(run_forward(lambda v: hs.concat(hs.split(v, [cut, shape[d] - cut], d)[::-1], d), x=x),
                                  np.concatenate([b, a], axis=d))
    stop = data.draw(st.integers(cut, shape[d]))
    start = data.draw(st.integers(0, stop - 1))
    np.testing.assert_array_equal(run_forward(lambda v: hs.slice(v, d, start, stop), x=x),
                                  np.take(x, np.arange(start, stop), axis=d))


# ----------------------------------------------------------------------------- losses


@settings(max_examples=10, deadline=None)
@given(lead=st.lists(small, min_size=1, max_size=2).map(tuple), classes=st.integers(2, 5),
       seed=st.integers(0, 2**16))
def test_cross_entropy_with_ignore_index(lead, classes, seed):
    rng = np.random.default_rng(seed)
    logits = normal(seed, (*lead, classes), 2.0)
    labels = rng.integers(0, classes, size=lead)
    labels = np.where(rng.random(lead) < 0.4, -100, labels)
    labels.flat[0] = 0
    flat_logits, flat_labels = logits.reshape(-1, classes), labels.reshape(-1)
    losses = [math.log(np.exp(row).sum()) - row[y] for row, y in zip(flat_logits, flat_labels) if y != -100]
    got = run_forward(lambda z, y: hs.cross_entropy(z, y, ignore_index=-100), logits=logits, labels=labels)
    np.testing.assert_allclose(got, np.mean(losses), rtol=1e-12)
    plain = [math.log(np.exp(row).sum()) - row[y] for row, y in zip(flat_logits, np.abs(flat_labels) % classes)]
    got = run_forward(hs.cross_entropy, logits=logits, labels=np.abs(labels) % classes)
    np.testing.assert_allclose(got, np.mean(plain), rtol=1e-12)


# ----------------------------------------------------------------------------- rope, dropout


def hf_rope(x, base):
    """The HuggingFace LLaMA formula, written out: q * cos + rotate_half(q) * sin."""
    _, t, _, dh = x.shape
    inv_freq = 1.0 / (base ** (np.arange(0, dh, 2) / dh))
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


@settings(max_examples=10, deadline=None)
@given(b=small, t=small, h=small, half=small, seed=st.integers(0, 2**16), base=st.sampled_from([10000.0, 500.0]))
def test_rope(b, t, h, half, seed, base):
    x = normal(seed, (b, t, h, 2 * half))
    y = run_forward(lambda v: hs.rope(v, base), x=x)
    np.testing.assert_allclose(y, hf_rope(x, base), **TOL)
    # a rotation: norms of each (i, i + Dh/2) pair are kept; position 0 is unchanged
    pair = lambda z: z[..., :half] ** 2 + z[..., half:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair(y), pair(x), rtol=1e-12)
    np.testing.assert_allclose(y[:, 0], x[:, 0], **TOL)


def _splitmix_uniform(seed, salt, step, index):
    """The documented dropout hash in plain Python integers."""
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    k = seed & mask
    for word in (salt, step):
        k = mix((k + golden) & mask) ^ (word & mask)
    key = mix((k + golden) & mask)
    return (mix((key + (index + 1) * golden) & mask) >> 11) / 2.0**53


def test_dropout_hash_matches_reference():
    key = positions.dropout_key(5, 2, 11)
    idx = np.array([0, 1, 2, 1000, 2**40 + 3], dtype=np.uint64)
    got = positions.dropout_uniform(key, idx)
    np.testing.assert_array_equal(got, [_splitmix_uniform(5, 2, 11, int(i)) for i in idx])


def test_dropout_mask_and_scale():
    x = np.abs(normal(0, (64, 128))) + 1.0
    for rate in (0.1, 0.5):
        y = run_forward(lambda v, s: hs.dropout(v, rate, seed=1), x=x, step=np.array(3))
        kept = y != 0
        assert abs(kept.mean() - (1 - rate)) < 0.02
        np.testing.assert_allclose(y[kept], x[kept] / (1 - rate), rtol=1e-15)
        again = run_forward(lambda v, s: hs.dropout(v, rate, seed=1), x=x, step=np.array(3))
        np.testing.assert_array_equal(again, y)
        other_step = run_forward(lambda v, s: hs.dropout(v, rate, seed=1), x=x, step=np.array(4))
        other_seed = run_forward(lambda v, s: hs.dropout(v, rate, seed=2), x=x, step=np.array(3))
        assert (other_step != 0).tolist() != kept.tolist() and (other_seed != 0).tolist() != kept.tolist()
    # two dropouts of one step get different masks (their salts differ)
    both = run_forward(lambda v, s: hs.concat([hs.dropout(v, 0.5), hs.dropout(v, 0.5)], 0), x=x, step=np.array(3))
    assert ((both[:64] != 0) != (both[64:] != 0)).any()
    np.testing.assert_array_equal(run_forward(lambda v: hs.dropout(v, 0.0), x=x), x)


def test_dropout_uses_the_step_input():
    t = Tracer()
    x = t.input("x", (2, 2), "float64")
    hs.dropout(x, 0.5)
    hs.dropout(x, 0.5)
    steps = [op for op in t.block.ops if op.name == "graph.input" and op.tensor_name.data == "step"]
    assert len(steps) == 1 and steps[0].result.type.get_shape() == ()
