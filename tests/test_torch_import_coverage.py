"""The importer covers Core ATen: every Core ATen op has a translator or a reason it has none, and
each translated op computes PyTorch's values and gradients on random inputs.

`python tests/test_torch_import_coverage.py` prints the table (op, translator or reason).

The values are checked in one import: a module whose loss is `sum_k <w_k, f_k(x_k)>`, each
`f_k` one Core ATen op called as `torch.ops.aten.<op>` on its own parameters `x_k` (and
integer inputs from the batch, so that indices are traced too). The gradient of `w_k` is
`f_k`'s value, the gradients of `x_k` its backward: both are compared with PyTorch's autograd,
tensor by tensor. The seed varies from run to run (`HSPMD_TEST_SEED` fixes it) and is printed.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.frontend import aten_complex, translators  # noqa: E402
from hspmd.frontend.decompose import KEPT, NOT_TRANSLATED, core_aten_ops  # noqa: E402

A = torch.ops.aten


def coverage_table() -> list[tuple[str, str]]:
    """Return (Core ATen op, its translator's `module.function`, or why it has none)."""
    rows = []
    for name in core_aten_ops():
        fn = translators.TRANSLATORS.get(name)
        if fn is not None:
            rows.append((name, f"{fn.__module__.rsplit('.', 1)[-1]}.{getattr(fn, '__qualname__', fn.__name__)}"))
        elif name in translators.IDENTITY:
            rows.append((name, "passed on (a copy or an alias of a value)"))
        else:
            rows.append((name, "no translator: " + NOT_TRANSLATED.get(name, "")))
    return rows


def test_every_core_aten_op_has_a_translator_or_a_reason():
    core = core_aten_ops()
    assert len(core) > 150
    for name, what in coverage_table():
        assert what and not what.endswith("no translator: "), f"{name}: neither a translator nor a reason"
        assert not (name in translators.TRANSLATORS and name in NOT_TRANSLATED), name
    assert set(NOT_TRANSLATED) <= set(core), sorted(set(NOT_TRANSLATED) - set(core))
    translated = [n for n in core if n in translators.TRANSLATORS or n in translators.IDENTITY]
    assert len(translated) >= 0.7 * len(core), f"{len(translated)} of {len(core)} Core ATen ops translated"
    assert {f"aten.{k}" for k in KEPT} <= set(translators.TRANSLATORS)  # the ops kept whole, too


# ----------------------------------------------------------------------------- each op against PyTorch

#: (op, shapes of its float arguments, a function of (floats, ints) calling it); the float arguments
#: are parameters (normal samples, made positive / into (-1, 1) / above 1 by the name's suffix)
def _cases(rng):
    n = lambda *s: ("n", s)  # noqa: E731 - a normal sample
    pos = lambda *s: ("p", s)  # noqa: E731 - positive
    unit = lambda *s: ("u", s)  # noqa: E731 - in (-0.9, 0.9)
    big = lambda *s: ("b", s)  # noqa: E731 - above 1.5
    ints = {"idx": rng.integers(0, 5, size=(3, 2)), "row": rng.integers(0, 3, size=(4,)),
            "along": rng.integers(0, 5, size=(3, 2)), "ids": rng.integers(0, 5, size=(4,)),
            "distinct": np.stack([rng.permutation(5)[:2] for _ in range(3)])}
    c = []
    for f in ("abs", "acos", "asin", "atan", "atanh", "ceil", "cos", "cosh", "erf", "exp", "expm1", "floor", "log",
              "log10", "log1p", "log2", "neg", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sin",
              "sinh", "sqrt", "tan", "tanh", "trunc", "asinh", "acosh", "bitwise_not", "logical_not", "isinf",
              "isnan"):
        arg = pos(3, 4) if f in ("log", "log10", "log2", "log1p", "rsqrt", "sqrt", "reciprocal") else \
            unit(3, 4) if f in ("acos", "asin", "atanh") else big(3, 4) if f == "acosh" else n(3, 4)
        if f in ("bitwise_not", "logical_not"):
            c.append((f"aten.{f}.default", [arg], lambda x, i, f=f: getattr(A, f).default(x[0] > 0)))
        else:
            c.append((f"aten.{f}.default", [arg], lambda x, i, f=f: getattr(A, f).default(x[0])))
    for f in ("add", "sub", "mul", "div", "maximum", "minimum", "atan2", "pow", "remainder", "fmod", "eq", "ne", "lt",
              "le", "gt", "ge"):
        over = "default" if f in ("maximum", "minimum", "atan2") else "Tensor_Tensor" if f == "pow" else "Tensor"
        first = pos(3, 4) if f == "pow" else n(3, 4)
        c.append((f"aten.{f}.{over}", [first, n(3, 4)], lambda x, i, f=f, o=over: getattr(getattr(A, f), o)(*x)))
    for f in ("add", "sub", "mul", "div", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge"):
        c.append((f"aten.{f}.Scalar", [n(3, 4)], lambda x, i, f=f: getattr(A, f).Scalar(x[0], 0.7)))
    c += [
        ("aten.pow.Tensor_Scalar", [n(3, 4)], lambda x, i: A.pow.Tensor_Scalar(x[0], 3)),
        ("aten.pow.Scalar", [n(3, 4)], lambda x, i: A.pow.Scalar(1.7, x[0])),
        ("aten.div.Tensor_mode", [n(3, 4), pos(3, 4)], lambda x, i: A.div.Tensor_mode(x[0] * 3, x[1], rounding_mode="floor")),
        ("aten.div.Scalar_mode", [n(3, 4)], lambda x, i: A.div.Scalar_mode(x[0] * 3, 0.7, rounding_mode="trunc")),
        ("aten.clamp.default", [n(3, 4)], lambda x, i: A.clamp.default(x[0], -0.5, 0.5)),
        ("aten.clamp.Tensor", [n(3, 4), n(3, 4)], lambda x, i: A.clamp.Tensor(x[0], x[1] - 1, x[1] + 1)),
        ("aten.hardtanh.default", [n(3, 4)], lambda x, i: A.hardtanh.default(x[0], -0.3, 0.6)),
        ("aten.elu.default", [n(3, 4)], lambda x, i: A.elu.default(x[0], 0.8)),
        ("aten.leaky_relu.default", [n(3, 4)], lambda x, i: A.leaky_relu.default(x[0], 0.1)),
        ("aten.gelu.default", [n(3, 4)], lambda x, i: A.gelu.default(x[0], approximate="tanh")),
        ("aten.where.self", [n(3, 4), n(3, 4), n(3, 4)], lambda x, i: A.where.self(x[0] > 0, x[1], x[2])),
        ("aten.logical_and.default", [n(3, 4), n(3, 4)], lambda x, i: A.logical_and.default(x[0] > 0, x[1] > 0)),
        ("aten.logical_or.default", [n(3, 4), n(3, 4)], lambda x, i: A.logical_or.default(x[0] > 0, x[1] > 0)),
        ("aten.logical_xor.default", [n(3, 4), n(3, 4)], lambda x, i: A.logical_xor.default(x[0] > 0, x[1] > 0)),
        ("aten.bitwise_and.Tensor", [n(3, 4), n(3, 4)], lambda x, i: A.bitwise_and.Tensor(x[0] > 0, x[1] > 0)),
        ("aten.bitwise_or.Tensor", [n(3, 4), n(3, 4)], lambda x, i: A.bitwise_or.Tensor(x[0] > 0, x[1] > 0)),
        ("aten.bitwise_xor.Tensor", [n(3, 4), n(3, 4)], lambda x, i: A.bitwise_xor.Tensor(x[0] > 0, x[1] > 0)),
        ("aten.bitwise_and.Scalar", [n(3, 4)], lambda x, i: A.bitwise_and.Scalar(x[0] > 0, True)),
        ("aten.bitwise_or.Scalar", [n(3, 4)], lambda x, i: A.bitwise_or.Scalar(x[0] > 0, False)),
        ("aten.bitwise_xor.Scalar", [n(3, 4)], lambda x, i: A.bitwise_xor.Scalar(x[0] > 0, True)),
        ("aten.any.default", [n(3, 4)], lambda x, i: A.any.default(x[0] > 1.0)),
        ("aten.any.dim", [n(3, 4)], lambda x, i: A.any.dim(x[0] > 1.0, 1)),
        ("aten.any.dims", [n(3, 4)], lambda x, i: A.any.dims(x[0] > 1.0, [0])),
        ("aten.amax.default", [n(3, 4)], lambda x, i: A.amax.default(x[0], [1])),
        ("aten.amin.default", [n(3, 4)], lambda x, i: A.amin.default(x[0], [0], True)),
        ("aten.max.default", [n(3, 4)], lambda x, i: A.max.default(x[0])),
        ("aten.min.default", [n(2, 5)], lambda x, i: A.min.default(x[0])),
        ("aten.max.default", [n(2, 3)], lambda x, i: x[0] * A.max.default(i["ids"]).to(torch.float32)),
        ("aten.argmax.default", [n(3, 4)], lambda x, i: A.argmax.default(x[0], 1)),
        ("aten.argmin.default", [n(3, 4)], lambda x, i: A.argmin.default(x[0])),
        ("aten.max.dim", [n(3, 4)], lambda x, i: _pair(A.max.dim(x[0], 1))),
        ("aten.min.dim", [n(3, 4)], lambda x, i: _pair(A.min.dim(x[0], 0, True))),
        ("aten.topk.default", [n(3, 5)], lambda x, i: _pair(A.topk.default(x[0], 2))),
        ("aten.sort.default", [n(3, 5)], lambda x, i: _pair(A.sort.default(x[0], 0))),
        ("aten.cumsum.default", [n(3, 4)], lambda x, i: A.cumsum.default(x[0], 1)),
        ("aten.mean.default", [n(3, 4)], lambda x, i: A.mean.default(x[0])),
        ("aten.mean.dim", [n(3, 4)], lambda x, i: A.mean.dim(x[0], [1], True)),
        ("aten.sum.dim_IntList", [n(3, 4)], lambda x, i: A.sum.dim_IntList(x[0], [0])),
        ("aten.var.correction", [n(3, 4)], lambda x, i: A.var.correction(x[0], [1], correction=1)),
        ("aten.linalg_vector_norm.default", [n(3, 4)], lambda x, i: A.linalg_vector_norm.default(x[0], 2, [1], True)),
        ("aten.linalg_vector_norm.default", [n(3, 4)], lambda x, i: A.linalg_vector_norm.default(x[0], 3.0)),
        ("aten.linalg_vector_norm.default", [n(2, 5)], lambda x, i: A.linalg_vector_norm.default(x[0], math.inf, [0])),
        ("aten.var.dim", [n(3, 4)], lambda x, i: A.var.dim(x[0], [0], False)),
        ("aten.addmm.default", [n(4), n(3, 5), n(5, 4)], lambda x, i: A.addmm.default(*x, beta=0.5, alpha=2.0)),
        ("aten.mm.default", [n(3, 5), n(5, 4)], lambda x, i: A.mm.default(*x)),
        ("aten.bmm.default", [n(2, 3, 5), n(2, 5, 4)], lambda x, i: A.bmm.default(*x)),
        ("aten._softmax.default", [n(3, 4)], lambda x, i: A._softmax.default(x[0], 1, False)),
        ("aten._log_softmax.default", [n(3, 4)], lambda x, i: A._log_softmax.default(x[0], 0, False)),
        ("aten.native_layer_norm.default", [n(3, 4), n(4), n(4)],
         lambda x, i: A.native_layer_norm.default(x[0], [4], x[1], x[2], 1e-5)[0]),
        ("aten.native_dropout.default", [n(3, 4)], lambda x, i: A.native_dropout.default(x[0], 0.0, True)[0]),
        ("aten.embedding.default", [n(5, 4)], lambda x, i: A.embedding.default(x[0], i["ids"])),
        ("aten.index.Tensor", [n(5, 4)], lambda x, i: A.index.Tensor(x[0], [i["idx"]])),
        ("aten.index_select.default", [n(4, 5)], lambda x, i: A.index_select.default(x[0], 1, i["ids"])),
        ("aten.gather.default", [n(3, 5)], lambda x, i: A.gather.default(x[0], 1, i["along"])),
        ("aten.index_put.default", [n(5, 4), n(4, 4)],
         lambda x, i: A.index_put.default(x[0], [i["ids"]], x[1], True)),
        ("aten.scatter.src", [n(3, 5), n(3, 2)], lambda x, i: A.scatter.src(x[0], 1, i["distinct"], x[1])),
        ("aten.scatter.value", [n(3, 5)], lambda x, i: A.scatter.value(x[0], 1, i["along"], 0.5)),
        ("aten.scatter_add.default", [n(3, 5), n(3, 2)], lambda x, i: A.scatter_add.default(x[0], 1, i["along"], x[1])),
        ("aten.scatter_reduce.two", [n(3, 5), n(3, 2)],
         lambda x, i: A.scatter_reduce.two(x[0], 1, i["along"], x[1], "sum")),
        ("aten.select.int", [n(3, 4)], lambda x, i: A.select.int(x[0], 1, -1)),
        ("aten.slice.Tensor", [n(3, 9)], lambda x, i: A.slice.Tensor(x[0], 1, 1, 8, 3)),
        ("aten.slice.Tensor", [n(3, 4)],  # an empty piece, dropped by cat (Phi-3's rotary pass-through)
         lambda x, i: A.cat.default([A.slice.Tensor(x[0], 1, 0, 4), A.slice.Tensor(x[0], 1, 4, 9)], 1)),
        ("aten.slice_scatter.default", [n(3, 8), n(3, 3)], lambda x, i: A.slice_scatter.default(x[0], x[1], 1, 1, 8, 3)),
        ("aten.select_scatter.default", [n(3, 4), n(4)], lambda x, i: A.select_scatter.default(x[0], x[1], 0, 1)),
        ("aten.constant_pad_nd.default", [n(3, 4)], lambda x, i: A.constant_pad_nd.default(x[0], [1, -1, 2, 0], 0.5)),
        ("aten.repeat.default", [n(2, 3)], lambda x, i: A.repeat.default(x[0], [2, 1, 2])),
        ("aten.flip.default", [n(3, 4)], lambda x, i: A.flip.default(x[0], [0, 1])),
        ("aten.diagonal.default", [n(4, 5)], lambda x, i: A.diagonal.default(x[0], 1)),
        # not Core ATen, but the decompositions keep it (Inkling-2's short convolutions)
        ("aten.unfold.default", [n(2, 11, 3)], lambda x, i: A.unfold.default(x[0], 1, 4, 2)),
        ("aten.unfold.default", [n(6, 2)], lambda x, i: A.unfold.default(x[0], -2, 3, 1)),
        ("aten.cat.default", [n(3, 4), n(2, 4)], lambda x, i: A.cat.default(x, 0)),
        ("aten.convolution.default", [n(2, 4, 7), n(4, 1, 3), n(4), n(6, 2, 2)],  # depthwise, padded; grouped
         lambda x, i: torch.cat([A.convolution.default(x[0], x[1], x[2], [1], [2], [1], False, [0], 4).flatten(),
                                 A.convolution.default(x[0], x[3], None, [2], [1], [2], False, [0], 2).flatten()])),
        ("aten.split_with_sizes.default", [n(3, 5)], lambda x, i: A.split_with_sizes.default(x[0], [2, 3], 1)[1]),
        ("aten.permute.default", [n(2, 3, 4)], lambda x, i: A.permute.default(x[0], [2, 0, 1])),
        ("aten.expand.default", [n(3, 1)], lambda x, i: A.expand.default(x[0], [2, 3, 4])),
        ("aten.view.default", [n(3, 4)], lambda x, i: A.view.default(x[0], [4, 3])),
        ("aten.squeeze.dims", [n(3, 1, 4)], lambda x, i: A.squeeze.dims(x[0], [1])),
        ("aten.squeeze.dim", [n(3, 4, 1)], lambda x, i: A.squeeze.dim(x[0], -1)),
        ("aten.unsqueeze.default", [n(3, 4)], lambda x, i: A.unsqueeze.default(x[0], 1)),
        ("aten._to_copy.default", [n(3, 4)], lambda x, i: A._to_copy.default(x[0], dtype=torch.float64)),
        ("aten.full_like.default", [n(3, 4)], lambda x, i: A.full_like.default(x[0], 0.25) * x[0]),
        ("aten.fill.Scalar", [n(3, 4)], lambda x, i: A.fill.Scalar(x[0], 1.5) + x[0]),
        ("aten.copy.default", [n(3, 4), n(4)], lambda x, i: A.copy.default(x[0].detach(), x[1].detach())),
        ("aten.alias.default", [n(3, 4)], lambda x, i: A.alias.default(x[0])),
        ("aten.clone.default", [n(3, 4)], lambda x, i: A.clone.default(x[0])),
    ]
    return c + _complex_cases(n, pos), ints


def _complex_cases(n, pos):
    """Ops on complex values (`aten_complex`: traced as (real, imaginary) pairs), each made complex
    from its float parameters (`view_as_complex`, `complex`, `polar`) and back (`view_as_real`)."""
    C, R = A.view_as_complex.default, A.view_as_real.default  # noqa: N806
    table = torch.polar(torch.linspace(0.5, 1.5, 4), torch.arange(4.0))  # a concrete complex tensor
    return [(f"complex {name}", args, fn) for name, args, fn in [
        ("aten.view_as_complex.default", [n(3, 2)], lambda x, i: R(C(x[0]))),
        ("aten.view_as_real.default", [n(3, 4, 2)], lambda x, i: R(C(x[0])) * 2.0),
        ("aten.mul.Tensor", [n(3, 4, 2), n(4, 2), n(3, 4)],
         lambda x, i: torch.cat([R(A.mul.Tensor(C(x[0]), C(x[1]))), R(A.mul.Tensor(C(x[0]), table)),
                                 R(A.mul.Tensor(x[2], C(x[0]))), R(C(x[0]) * 1j)])),
        ("aten.mul.Scalar", [n(3, 2)], lambda x, i: R(A.mul.Scalar(C(x[0]), -0.5))),
        ("aten.div.Tensor", [n(3, 4, 2), n(3, 4, 2), pos(4)],
         lambda x, i: torch.cat([R(A.div.Tensor(C(x[0]), C(x[1]))), R(A.div.Tensor(C(x[0]), x[2])),
                                 R(A.div.Tensor(x[2], C(x[1]))), R(C(x[0]) / (1 + 2j))])),
        ("aten.div.Scalar", [n(3, 2)], lambda x, i: R(A.div.Scalar(C(x[0]), 4.0))),
        ("aten.add.Tensor", [n(3, 4, 2), n(4, 2), n(3, 4)],
         lambda x, i: torch.cat([R(A.add.Tensor(C(x[0]), C(x[1]), alpha=0.5)), R(A.add.Tensor(x[2], C(x[0]))),
                                 R(C(x[0]) + 2j)])),
        ("aten.add.Scalar", [n(3, 2)], lambda x, i: R(A.add.Scalar(C(x[0]), 0.25))),
        ("aten.sub.Tensor", [n(3, 4, 2), n(3, 4, 2), n(4)],
         lambda x, i: torch.cat([R(A.sub.Tensor(C(x[0]), C(x[1]))), R(A.sub.Tensor(C(x[0]), x[2], alpha=2))])),
        ("aten.sub.Scalar", [n(3, 2)], lambda x, i: R(A.sub.Scalar(C(x[0]), 1.5))),
        ("aten.rsub.Scalar", [n(3, 2)], lambda x, i: R(A.rsub.Scalar(C(x[0]), 1.0))),
        ("aten.rsub.Tensor", [n(3, 2), n(3, 2)], lambda x, i: R(A.rsub.Tensor(C(x[0]), C(x[1]), alpha=3))),
        ("aten.neg.default", [n(3, 2)], lambda x, i: R(A.neg.default(C(x[0])))),
        ("aten._conj.default", [n(3, 2)], lambda x, i: R(A._conj.default(C(x[0])) * 1.0)),
        ("aten.conj_physical.default", [n(3, 2)], lambda x, i: R(A.conj_physical.default(C(x[0])))),
        ("aten.sum.dim_IntList", [n(3, 4, 2)], lambda x, i: R(A.sum.dim_IntList(C(x[0]), [-1], True))),
        ("aten.polar.default", [pos(3, 4), n(3, 4)], lambda x, i: R(A.polar.default(x[0], x[1]))),
        ("aten.complex.default", [n(3, 4), n(4)], lambda x, i: R(A.complex.default(x[0], x[1].expand(3, 4)))),
        ("aten._to_copy.default", [n(3, 4, 2), n(3, 4)],
         lambda x, i: torch.cat([R(A._to_copy.default(C(x[0]), dtype=torch.complex128)).float(),
                                 R(A._to_copy.default(x[1], dtype=torch.complex64)),
                                 A._to_copy.default(C(x[0]), dtype=torch.float32)[..., None].expand(3, 4, 2)])),
        ("aten.view.default", [n(2, 6, 2)], lambda x, i: R(A.view.default(C(x[0]), [3, 2, 2]))),
        ("aten.unsqueeze.default", [n(3, 2)], lambda x, i: R(A.unsqueeze.default(C(x[0]), -1))),
        ("aten.expand.default", [n(3, 1, 2)], lambda x, i: R(A.expand.default(C(x[0]), [2, 3, 4]))),
        ("aten.permute.default", [n(2, 3, 4, 2)], lambda x, i: R(A.permute.default(C(x[0]), [2, 0, -2]))),
        ("aten.transpose.int", [n(2, 3, 4, 2)], lambda x, i: R(A.transpose.int(C(x[0]), 0, -1))),
        ("aten.t.default", [n(3, 4, 2)], lambda x, i: R(A.t.default(C(x[0])))),
        ("aten.select.int", [n(3, 4, 2)], lambda x, i: R(A.select.int(C(x[0]), -1, 2))),
        ("aten.slice.Tensor", [n(3, 9, 2)], lambda x, i: R(A.slice.Tensor(C(x[0]), -1, 1, 8, 2))),
        ("aten.split.Tensor", [n(3, 5, 2)], lambda x, i: R(A.split.Tensor(C(x[0]), 2, -1)[2])),
        ("aten.split_with_sizes.default", [n(3, 5, 2)],
         lambda x, i: R(A.split_with_sizes.default(C(x[0]), [1, 2], 0)[1])),
        ("aten.cat.default", [n(3, 4, 2)], lambda x, i: R(A.cat.default([C(x[0]), table[None]], 0))),
    ]]


def _pair(values_indices):
    values, indices = values_indices
    return values + indices.to(values.dtype)


def _sample(kind: str, shape, rng) -> np.ndarray:
    x = rng.standard_normal(shape)
    return {"n": x, "p": np.abs(x) + 0.5, "u": np.tanh(x) * 0.9, "b": x * x + 1.5}[kind].astype(np.float32)


class _Ops(torch.nn.Module):
    """Every case's parameters and weights; the loss is the sum of <w_k, f_k(x_k)>."""

    def __init__(self, cases, rng):
        super().__init__()
        self.fns = [fn for _, _, fn in cases]
        self.xs = torch.nn.ParameterList()
        self.ws = torch.nn.ParameterList()
        self.counts = []
        for k, (_, args, fn) in enumerate(cases):
            for kind, shape in args:
                self.xs.append(torch.nn.Parameter(torch.as_tensor(_sample(kind, shape, rng))))
            self.counts.append(len(args))
        self.outs = []

    def shapes(self, ints):
        with torch.no_grad():
            return [tuple(v.shape) for v in self.values(ints)]

    def values(self, ints):
        out, at = [], 0
        for fn, count in zip(self.fns, self.counts):
            out.append(fn(list(self.xs[at:at + count]), ints))
            at += count
        return out

    def forward(self, batch):
        ints = {k: v for k, v in batch.items()}
        total = 0.0
        for y, w in zip(self.values(ints), self.ws):
            total = total + (y.to(torch.float32) * w).sum()
        return total


def test_each_translated_core_op_equals_pytorch():
    seed = int(os.environ.get("HSPMD_TEST_SEED", time.time_ns() % 100_000))
    print(f"seed {seed} (HSPMD_TEST_SEED={seed} repeats it)")
    rng = np.random.default_rng(seed)
    cases, ints = _cases(rng)
    model = _Ops(cases, rng)
    batch = {k: torch.as_tensor(v) for k, v in ints.items()}
    for shape in model.shapes(batch):
        model.ws.append(torch.nn.Parameter(torch.as_tensor(rng.standard_normal(shape).astype(np.float32))))
    covered = {name for name, _, _ in cases}
    core = set(core_aten_ops())
    translated = {n for n in core if n in translators.TRANSLATORS or n in translators.IDENTITY}
    untested = translated - covered
    assert not untested, f"translated Core ATen ops without a case here: {sorted(untested)}"
    checked = {aten_complex.TRANSLATORS[name[len("complex "):]] for name in covered if name.startswith("complex ")}
    untested = {name for name, fn in aten_complex.TRANSLATORS.items()
                if fn not in checked and name != "operator.getitem"}  # split's cases take pieces
    assert not untested, f"translators of complex values without a case here: {sorted(untested)}"

    program = hs.from_torch(model, ints, lambda m, b: m(b))
    out = run_imported(program, ints)

    loss = model(batch)
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
    names = dict(model.named_parameters())
    owner = {}
    at = 0
    for (name, args, _), k in zip(cases, range(len(cases))):
        for j in range(len(args)):
            owner[f"xs.{at + j}"] = name
        at += len(args)
        owner[f"ws.{k}"] = name
    bad = []
    for pname, p in names.items():
        ours = out.get(f"grad:{pname}")
        theirs = p.grad.numpy() if p.grad is not None else np.zeros(p.shape, np.float32)
        if ours is None:
            ours = np.zeros_like(theirs)  # a parameter the loss does not use: no gradient
        err = float(np.linalg.norm(ours - theirs) / (np.linalg.norm(theirs) + 1e-6))
        if err > 1e-4:
            bad.append(f"{owner[pname]} ({pname}): relative error {err:.2e}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    table = coverage_table()
    width = max(len(n) for n, _ in table)
    for name, what in table:
        print(f"{name.ljust(width)}  {what}")
