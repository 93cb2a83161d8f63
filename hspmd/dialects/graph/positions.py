"""Ops whose values depend on positions: rotary position embeddings and counter-based dropout."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
    FloatAttr,
    IntegerAttr,
    TensorType,
    TypeAttribute,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.dist import layout_of
from hspmd.dialects.cuda_c import (
    KernelCode,
    c_type,
    flat_kernel,
    global_index,
    microbatch_default,
    microbatch_macro,
    rank_defaults,
    rank_value,
)
from hspmd.dialects.graph.base import (
    TensorOp,
    UnaryOp,
    check_float,
    check_integer,
    check_same_shape,
    float_attr,
    int_attr,
    piece_starts,
    result_shape,
    tensor_shape,
)
from hspmd.dialects.graph.leaves import InputOp
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, require_float
from hspmd.ir.types import element_type

__all__ = [
    "RopeOp",
    "RopeGradOp",
    "DropoutOp",
]


# ----------------------------------------------------------------------------- rotary embeddings


def rope_tables(positions: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Return cos and sin [T, 1, Dh] (float64) of the HuggingFace LLaMA rotary embedding."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return np.cos(emb), np.sin(emb)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_kernel(base: float, sign: float) -> Kernel:
    """`x * cos + sign * rotate_half(x) * sin` (sign -1: the transposed rotation)."""
    cache: dict[tuple[int, int, np.dtype], tuple[np.ndarray, np.ndarray]] = {}

    def apply(x: np.ndarray) -> np.ndarray:
        key = (x.shape[-3], x.shape[-1], x.dtype)
        if key not in cache:
            cos, sin = rope_tables(x.shape[-3], x.shape[-1], base)
            cache[key] = (cos.astype(x.dtype), (sign * sin).astype(x.dtype))
        cos, sin = cache[key]
        return x * cos + _rotate_half(x) * sin

    return apply


class _Rope(UnaryOp):
    base = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, base: float = 10000.0):
        super().__init__(input, base=float_attr(base))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        shape = tensor_shape(self.input)
        if len(shape) < 3 or shape[-1] % 2:
            raise VerifyException(f"'{self.name}' needs x [..., T, H, Dh] with Dh even, got {list(shape)}")

    def sharding_rule(self) -> OpRule:  # angles use the global position (dim -3) and Dh
        d = factors("d", len(result_shape(self)))
        return OpRule((d,), (d,), frozenset({0}), blocked=frozenset({d[-3], d[-1]}))

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per element: its position t (dim -3) and frequency, the angle in double as NumPy's
        tables are, cos and sin rounded to the element type, then `x cos + sign rotate_half(x) sin`."""
        *_, steps, heads, dh = tensor_shape(self.input)
        half, sign = dh // 2, "-" if isinstance(self, RopeGradOp) else ""
        body = (f"const long d = i % {dh}L, t = (i / {heads * dh}L) % {steps}L;\n"
                f"    const double angle = (double)t * pow({float(self.base.value.data)!r}, -(double)(2 * (d % {half}L)) / {dh}.0);\n"
                f"    const T c = (T)cos(angle), s = (T)({sign}sin(angle));\n"
                f"    const T rot = d < {half}L ? -(T)in0[i + {half}L] : (T)in0[i - {half}L];\n"
                f"    out0[i] = in0[i] * c + rot * s;")
        return flat_kernel(name, self, c_type(self.result.type), body)


@irdl_op_definition
class RopeOp(_Rope):
    """Rotary position embedding of x [..., T, H, Dh] (HuggingFace LLaMA `rotate_half` form):
    `x * cos + rotate_half(x) * sin`, angles `t * base ** (-2i / Dh)` for position t (dim -3)
    and `i < Dh / 2`, repeated for both halves of Dh."""

    name = "graph.rope"
    FRONTEND: ClassVar[tuple[str, ...]] = ("rope",)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(RopeGradOp(g, self.base.value.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return rope_kernel(self.base.value.data, 1.0)


@irdl_op_definition
class RopeGradOp(_Rope):
    """The transposed rotation of `graph.rope` (same base): `dy * cos - rotate_half(dy) * sin`."""

    name = "graph.rope_grad"
    NO_FRONTEND: ClassVar[str] = "made by autodiff (the gradient of graph.rope)"

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(RopeOp(g, self.base.value.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return rope_kernel(self.base.value.data, -1.0)


# ----------------------------------------------------------------------------- dropout

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 with good avalanche."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def dropout_key(seed: int, salt: int, step: int) -> np.uint64:
    """Return the per-(seed, salt, step) key of the dropout hash."""
    with np.errstate(over="ignore"):
        k = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        for word in (salt, step):
            k = _mix64(k + _GOLDEN) ^ np.array([word & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        return _mix64(k + _GOLDEN)[0]


def dropout_uniform(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Return uniforms in [0, 1) (float64, 53 bits): `mix64(key + (index + 1) * golden) >> 11`."""
    with np.errstate(over="ignore"):
        z = _mix64(key + (index.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def global_indices(local_shape, global_shape, slices) -> np.ndarray:
    """Return the row-major global index (uint64) of every element of a local piece."""
    idx = np.zeros(local_shape, dtype=np.uint64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        view = [1] * len(local_shape)
        view[d] = local_shape[d]
        start = slices[d].start or 0
        idx += (np.arange(start, start + local_shape[d], dtype=np.uint64) * np.uint64(stride)).reshape(view)
        stride *= int(global_shape[d])
    return idx


def dropout_kernel(op: DropoutOp, rank: int, microbatch: int = 0) -> Kernel:
    """`x * keep / (1 - rate)`, keep = uniform(seed, salt, step, global index) >= rate.

    An op of a pipeline stage's forward or backward (`microbatches` m and `microbatch_dim` d
    set) holds micro-batch `microbatch` of a tensor whose dim d is m times its global type's:
    its elements take their indices in that whole tensor, so the masks are one device's. The
    kernel's `for_microbatch(i)` returns the kernel of micro-batch i.
    """
    rate = op.rate.value.data
    if rate == 0.0:
        return lambda x, step: x
    seed, salt = op.seed.value.data, op.salt.value.data
    local_shape = result_shape(op)
    typ = op.global_type
    if typ is None:  # logical or a one-device program: the piece is the whole tensor
        slices = tuple(slice(0, s) for s in local_shape)
        global_shape = local_shape
    else:
        global_shape = typ.get_shape()  # type: ignore[attr-defined]
        layout = layout_of(typ)
        me = rank
        if op.microbatch_ranks is not None and op.stage_ranks is not None:  # as the micro-batch's virtual device
            stage = tuple(op.stage_ranks.get_values())
            me = tuple(op.microbatch_ranks.get_values())[microbatch * len(stage) + stage.index(rank)]
        slices = layout.slices(me, global_shape) if layout is not None else tuple(slice(0, s) for s in global_shape)
    if op.microbatches is not None and op.microbatch_dim is not None:
        m, d = op.microbatches.value.data, op.microbatch_dim.value.data
        shift = microbatch * global_shape[d]
        slices = tuple(slice((sl.start or 0) + shift, (sl.stop or global_shape[d]) + shift) if k == d else sl
                       for k, sl in enumerate(slices))
        global_shape = tuple(n * m if k == d else n for k, n in enumerate(global_shape))
    index = global_indices(local_shape, global_shape, slices)
    scale = 1.0 / (1.0 - rate)

    def apply(x: np.ndarray, step: np.ndarray) -> np.ndarray:
        keep = dropout_uniform(dropout_key(seed, salt, int(step)), index) >= rate
        return np.where(keep, x * x.dtype.type(scale), x.dtype.type(0))

    apply.for_microbatch = lambda i: dropout_kernel(op, rank, i)  # type: ignore[attr-defined]
    return apply


@irdl_op_definition
class DropoutOp(TensorOp):
    """`x * keep / (1 - rate)`: `keep` is a counter-based random mask, a pure function of
    (`seed`, `salt`, the scalar integer `step`, the element's index in the global tensor), so it
    does not depend on how the tensor is sharded. `salt` tells dropouts of one step apart.
    `global_type` is set at the physical level (the annotated type of the result: global shape
    and layout), where the kernel finds its piece's global offset from it. In a pipeline
    stage's forward or backward, `microbatches` m and `microbatch_dim` d say that `global_type`
    is one micro-batch: the whole tensor has m of them along dim d, and the runtime tells the
    kernel which one it runs (so the masks are those of one device). Beside other device groups
    (a union layout) the op keeps the stage-shaped step's layout over virtual devices instead,
    with `microbatch_ranks` and `stage_ranks` as on `comm.exchange`: the rank at stage position
    q draws micro-batch i's mask as virtual device `microbatch_ranks[i * len(stage_ranks) + q]`."""

    name = "graph.dropout"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.dropout.default", "aten.native_dropout.default")
    input = operand_def(TensorType)
    step = operand_def(TensorType)
    result = result_def(TensorType)
    rate = prop_def(FloatAttr)
    seed = prop_def(IntegerAttr[I64])
    salt = prop_def(IntegerAttr[I64])
    global_type = opt_prop_def(TypeAttribute)
    microbatches = opt_prop_def(IntegerAttr[I64])
    microbatch_dim = opt_prop_def(IntegerAttr[I64])
    microbatch_ranks = opt_prop_def(DenseArrayBase)
    stage_ranks = opt_prop_def(DenseArrayBase)
    traits = traits_def(Pure())
    #: specialize-groups records the annotated result type in `global_type`
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("dropout",)

    def __init__(self, input: SSAValue, step: SSAValue, rate: float, seed: int, salt: int):
        super().__init__(
            operands=[input, step],
            result_types=[input.type],
            properties={"rate": float_attr(rate), "seed": int_attr(seed), "salt": int_attr(salt)},
        )

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        if tensor_shape(self.step) != ():
            raise VerifyException(f"'{self.name}' needs a scalar integer step")
        check_integer(self, self.step, "step")
        if not 0.0 <= self.rate.value.data < 1.0:
            raise VerifyException(f"'{self.name}' rate must be in [0, 1), got {self.rate.value.data}")

    def sharding_rule(self) -> OpRule:  # the mask is keyed by global indices (global_type): any split is fine
        d = factors("d", len(result_shape(self)))
        return OpRule((d, ()), (d,), frozenset({0}))

    def vjp(self, gs, emit):  # the same mask and scale: the same op on the gradient
        g = gs[0]
        rate, seed, salt = self.rate.value.data, self.seed.value.data, self.salt.value.data
        return [lambda: emit(DropoutOp(g, self.step, rate, seed, salt)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return dropout_kernel(self, ctx.rank)

    def _microbatch_count(self) -> int:
        """Return the micro-batches of a stage beside other groups (`microbatch_ranks` per stage rank)."""
        return len(self.microbatch_ranks.get_values()) // len(self.stage_ranks.get_values())  # type: ignore[union-attr]

    def _virtual_starts(self) -> dict[int, tuple[int, ...]]:
        """Return, per rank of a stage beside other groups, where each micro-batch's piece (its
        virtual device's, as `dropout_kernel` takes it) starts along each dim, micro-batch after
        micro-batch: the rank values of its GPU kernel."""
        stage = tuple(self.stage_ranks.get_values())  # type: ignore[union-attr]
        virtual = tuple(self.microbatch_ranks.get_values())  # type: ignore[union-attr]
        typ = self.global_type
        shape = typ.get_shape()  # type: ignore[union-attr]
        layout = layout_of(typ)

        def start(v: int) -> tuple[int, ...]:
            return tuple(s.start or 0 for s in layout.slices(v, shape)) if layout is not None else (0,) * len(shape)

        return {r: tuple(x for i in range(self._microbatch_count()) for x in start(virtual[i * len(stage) + q]))
                for q, r in enumerate(stage)}

    def cuda_kernel(self, name: str) -> KernelCode:
        """The same counter-based mask as the NumPy kernel (`hs_dropout_key`, `hs_dropout_uniform`
        in hs_common.cuh), for a result that is the whole tensor on every rank."""
        rate = self.rate.value.data
        seed, salt = self.seed.value.data & 0xFFFFFFFFFFFFFFFF, self.salt.value.data & 0xFFFFFFFFFFFFFFFF
        t = c_type(self.result.type)
        if rate == 0.0:
            return flat_kernel(name, self, t, "out0[i] = in0[i];")
        local = result_shape(self)
        whole = self.global_type.get_shape() if self.global_type is not None else local
        pre, start = "", None
        if self.microbatch_ranks is not None and self.stage_ranks is not None:
            # a stage beside other groups: micro-batch i's piece is that of its virtual device;
            # a rank's values are every micro-batch's starts, read at the one the variant runs
            starts, table = self._virtual_starts(), len(local) * self._microbatch_count()
            defaults = rank_defaults(name, [0] * table) + microbatch_default(name)
            pre = f"const long long hs_start[] = {{{', '.join(rank_value(name, k) for k in range(table))}}};\n  "
            start = lambda d: f"hs_start[{microbatch_macro(name)} * {len(local)} + {d}]"  # noqa: E731
        else:
            starts = piece_starts(self)  # a piece: its items' indices in the global tensor
            defaults = rank_defaults(name, [0] * len(local))
        shift = None
        if self.microbatches is not None and self.microbatch_dim is not None:  # one micro-batch of m along d
            m, d = self.microbatches.value.data, self.microbatch_dim.value.data
            shift = {d: f"{microbatch_macro(name)} * {whole[d]}L"}
            whole = tuple(n * m if k == d else n for k, n in enumerate(whole))
            if start is None:
                defaults += microbatch_default(name)
        elif not starts:
            defaults = ""
        index = global_index(name, local, whole, shift, start) if defaults else "long gi = i;"
        pre += f"const unsigned long long key = hs_dropout_key({seed}ULL, {salt}ULL, (unsigned long long)in1[0]);"
        body = (f"{index}\n    const bool keep = hs_dropout_uniform(key, (unsigned long long)gi) >= {rate!r};\n"
                f"    out0[i] = keep ? in0[i] * (T){1.0 / (1.0 - rate)!r} : (T)0;")
        code = flat_kernel(name, self, t, body, pre=pre)
        return KernelCode(defaults + code.source, code.launches, rank_values=starts)


# ----------------------------------------------------------------------------- frontend


def rope(x, base: float = 10000.0):
    """Return the rotary position embedding of x [B, T, H, Dh] (HuggingFace LLaMA convention:
    `x * cos + rotate_half(x) * sin`, `inv_freq = base ** (-arange(0, Dh, 2) / Dh)`)."""
    x = as_tensor(x, "rope")
    require_float(x, "rope")
    if x.ndim < 3 or x.shape[-1] % 2:
        raise fail("rope", f"needs x [B, T, H, Dh] with Dh even, got {list(x.shape)}")
    return x.tracer.emit(RopeOp(x.value, float(base)))


STEP_INPUT = "step"


def step_tensor(tracer):
    """Return the scalar int64 input "step" of the training step (made on first use).

    The runtime must feed it each step (the batch needs a "step" entry). A tracer that is not
    the step's (a function module's) may provide `rng_counter()`, a scalar int64 tensor of its
    own function, to stand for it.
    """
    hook = getattr(tracer, "rng_counter", None)
    if callable(hook):
        return hook()
    if tracer.block.args:  # a function body: no graph.input can live here
        raise fail("dropout", "dropout inside a function module needs the step passed in; not supported yet")
    for op in tracer.block.ops:
        if isinstance(op, InputOp) and op.tensor_name.data == STEP_INPUT:
            if op.result.type != TensorType(element_type("int64"), ()):
                raise fail("dropout", f"the input '{STEP_INPUT}' must be a scalar int64")
            return tracer.tensor(op.result)
    return tracer.input(STEP_INPUT, (), "int64")


def dropout(x, rate: float, seed: int = 0):
    """Return `x * keep / (1 - rate)` with a random keep mask of probability `1 - rate`.

    The mask is a counter-based hash of (seed, a per-op salt, the scalar int64 input "step",
    the element's global index), so it is the same however x is sharded, differs from step
    to step, and the backward pass reuses it. `rate = 0` returns x itself.
    """
    x = as_tensor(x, "dropout")
    require_float(x, "dropout")
    if not 0.0 <= rate < 1.0:
        raise fail("dropout", f"rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return x
    step = step_tensor(x.tracer)
    salt = sum(1 for op in x.tracer.block.ops if isinstance(op, DropoutOp))
    return x.tracer.emit(DropoutOp(x.value, step.value, float(rate), int(seed), salt))
