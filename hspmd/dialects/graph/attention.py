"""Flash-style fused attention for GPU programs: one kernel forward, one backward.

`graph.flash_attention` computes `softmax(scale q k^T [causal mask]) [dropout] v` per block of
queries without the T x T scores: an online softmax over blocks of keys (a running maximum and
sum per query row), the dropout mask drawn from the same counters as `graph.dropout` on the
probabilities `[..., Tq, Tk]` (so the CPU's masks), and it keeps the logsumexp of each row of
scores for the backward. `graph.flash_attention_grad` recomputes the probabilities from q, k
and that logsumexp and gives dq, dk, dv with no atomics (one block per key block for dk and
dv, one per query block for dq; every sum in a fixed order, so the bits do not change between
runs).

Neither op is written by users or autodiff: the `flash-attention` pass puts them into a GPU
program (the kernel level after `device-kernels`) where it finds attention's chain of products,
softmax and dropout, and its backward (`hspmd/transforms/flash_attention.py`). Their NumPy
kernels (float64, rounded to the result type) are the reference tests hold the CUDA C to (its
`cuda_kernel`, run under `cuda_emu.h` on the CPU and by NVRTC/CuPy on a GPU).

Shapes: q, v, o [..., T, D]; k [..., T, D], or [..., D, T] with `k_transposed` (the residual a
GEMM's transpose flag left behind); the backward's o may be [B, T, H, D] for q [B, H, T, D]
(`o_heads_inside`: its layout before the heads merge, which the layer keeps for its projection's
gradient); lse [..., T] (float32); the leading dims are one batch of B x H heads.

Types: q, k, v, o, do and dq, dk, dv are all float32, or all bfloat16, or all float16 (stored
as 16 bits, `codegen/hs_float16.cuh`); lse and the backward's scratch `D = rowsum(dO o)` are
float32 always. The kernels compute in float32 whatever the storage: a 16-bit q, k, v, o or do
is widened exactly when it is read (into the float32 tiles in shared memory, or straight from
global memory); the scores `scale q k^T`, the running maximum and sum, the probabilities and
their dropout, the accumulator of `p v`, the logsumexp, `D`, the recomputed `p`, `dp`, `ds` and
the accumulators of dq, dk, dv are float32 and never rounded to 16 bits. A 16-bit result is
rounded once, to nearest even, where it is stored: o (`acc / l`), dq and dk (times the scale),
dv. The backward's `D` is computed from o as stored (16-bit o, rounded), as the kernels get it. Tiles are sized
per head dim so that a block's static shared memory stays under 48 KiB (sm_80 and sm_90 without
opting in to more): D <= 128.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    I64,
    BFloat16Type,
    Float16Type,
    Float32Type,
    FloatAttr,
    IntegerAttr,
    TensorType,
    f32,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import EmitError, KernelCode, c_type, kernel_params
from hspmd.dialects.graph.attention_cuda import (
    BWD_DKV,
    BWD_DOT,
    BWD_DQ,
    ENTRY,
    FWD,
    FWD_QUERIES,
    PRELUDE,
    fill,
    flit,
    tiles,
)
from hspmd.dialects.graph.base import float_attr, int_attr, tensor_shape, tensor_type
from hspmd.dialects.graph.positions import dropout_key, dropout_uniform
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.ir.types import dtype_name

__all__ = ["FlashAttentionGradOp", "FlashAttentionOp"]

#: the element types of q, k, v, o (and of do, dq, dk, dv): the kernels compute in float32
STORED = (Float32Type, BFloat16Type, Float16Type)
#: the largest head dim the kernels take (their tiles are sized for it)
MAX_HEAD_DIM = 128
#: the column count a row launch passes so that the GPU runs it with 128 threads a block
#: (`codegen/cupy_backend.row_block`: a quarter of the columns)
LAUNCH_COLS = 512


# ----------------------------------------------------------------------------- NumPy reference


def _mask(op, lead: int, t: int, step) -> np.ndarray | None:
    """Return the dropout keep-mask [lead, T, T] times 1/(1-rate) (float64), or None without dropout."""
    rate = op.rate.value.data
    if rate == 0.0:
        return None
    key = dropout_key(op.seed.value.data, op.salt.value.data, int(np.asarray(step)))
    keep = dropout_uniform(key, np.arange(lead * t * t, dtype=np.uint64)) >= rate
    return keep.reshape(lead, t, t) * (1.0 / (1.0 - rate))


def _probabilities(op, q, k, step):
    """Return (scale, probabilities P [n, T, T], logsumexp [n, T], dropout factors or None) in float64."""
    *lead, t, d = q.shape
    n = int(np.prod(lead, dtype=np.int64))
    q64 = q.reshape(n, t, d).astype(np.float64)
    k64 = k.reshape(n, *k.shape[-2:]).astype(np.float64)
    if op.k_transposed.value.data:
        k64 = np.swapaxes(k64, -1, -2)
    scale = op.scale.value.data
    s = scale * (q64 @ np.swapaxes(k64, -1, -2))
    if op.causal.value.data:
        s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    return scale, e / total, (m + np.log(total))[..., 0], _mask(op, n, t, step)


def flash_attention_values(op, q, k, v, step=None):
    """Return (o, lse) of `graph.flash_attention` (float64 arithmetic, results in their types)."""
    _, p, lse, mask = _probabilities(op, q, k, step)
    pd = p if mask is None else p * mask
    o = pd @ v.reshape(p.shape[0], *v.shape[-2:]).astype(np.float64)
    return o.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[:-1]).astype(np.float32)


def flash_attention_grad_values(op, q, k, v, o, do, lse, step=None):
    """Return (dq, dk, dv) of `graph.flash_attention_grad`, all [..., T, D] (float64 arithmetic).

    As the kernels compute them from their operands: the probabilities `exp(scale q k - lse)`
    from the given logsumexp, and the rows' `sum_j p dp` as `dO . o` from the given o; for the
    o and lse of `graph.flash_attention` these are attention's gradients."""
    *lead, t, d = q.shape
    n = int(np.prod(lead, dtype=np.int64))
    if op.o_heads_inside.value.data:  # o [B, T, H, D]: as q's [B, H, T, D]
        o = np.swapaxes(o, -2, -3)
    q64, v64, o64, do64 = (x.reshape(n, t, d).astype(np.float64) for x in (q, v, o, do))
    k64 = k.reshape(n, *k.shape[-2:]).astype(np.float64)
    if op.k_transposed.value.data:
        k64 = np.swapaxes(k64, -1, -2)
    scale = op.scale.value.data
    s = scale * (q64 @ np.swapaxes(k64, -1, -2))
    if op.causal.value.data:
        s = np.where(np.arange(t)[None, :] > np.arange(t)[:, None], -np.inf, s)
    p = np.exp(s - lse.reshape(n, t, 1).astype(np.float64))
    mask = _mask(op, n, t, step)
    pd = p if mask is None else p * mask
    dv = np.swapaxes(pd, -1, -2) @ do64
    dpd = do64 @ np.swapaxes(v64, -1, -2)
    dp = dpd if mask is None else dpd * mask
    ds = p * (dp - (do64 * o64).sum(-1, keepdims=True)) * scale
    dq, dk = ds @ k64, np.swapaxes(ds, -1, -2) @ q64
    return tuple(x.reshape(q.shape).astype(q.dtype) for x in (dq, dk, dv))



class _FlashFacts(IRDLOperation):
    """What both ops share: the attention's constants and the checks of their shapes."""

    scale = prop_def(FloatAttr)
    causal = prop_def(IntegerAttr[I64])
    k_transposed = prop_def(IntegerAttr[I64])
    rate = prop_def(FloatAttr)
    seed = prop_def(IntegerAttr[I64])
    salt = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    NO_SHARDING_RULE: ClassVar[str] = "made in a GPU program by flash-attention, after layouts are decided"
    NO_FRONTEND: ClassVar[str] = "made by the flash-attention pass from attention's chain of ops"

    @staticmethod
    def props(scale: float, causal: bool, k_transposed: bool, rate: float, seed: int, salt: int) -> dict:
        return {"scale": float_attr(scale), "causal": int_attr(int(causal)), "k_transposed": int_attr(int(k_transposed)),
                "rate": float_attr(rate), "seed": int_attr(seed), "salt": int_attr(salt)}

    def sample_operands(self, rng: np.random.Generator) -> list[np.ndarray]:
        """Return operands that agree with each other (to check a kernel against the NumPy one):
        q, k, v and do normal with deviation 1/2, o and lse the forward's, the step 0."""
        *lead, t, d = tensor_shape(self.operands[0])
        dt = np.dtype(dtype_name(self.operands[0].type))
        q, k, v, do = ((0.5 * rng.standard_normal((*lead, t, d))).astype(dt) for _ in range(4))
        kin = np.ascontiguousarray(np.swapaxes(k, -1, -2)) if self.k_transposed.value.data else k
        step = [np.array(0, np.int64)] if self.step is not None else []
        if isinstance(self, FlashAttentionOp):
            return [q, kin, v, *step]
        o, lse = flash_attention_values(self, q, kin, v, *step)
        if self.o_heads_inside.value.data:
            o = np.ascontiguousarray(np.swapaxes(o, -2, -3))
        return [q, kin, v, o, do, lse, *step]

    def dims(self) -> tuple[int, int, int]:
        """Return (batch x heads, T, D)."""
        *lead, t, d = tensor_shape(self.operands[0])
        return int(math.prod(lead)), t, d

    def check(self) -> None:
        q = tensor_shape(self.operands[0])
        if len(q) < 2:
            raise VerifyException(f"'{self.name}' needs q [..., T, D], got {list(q)}")
        *lead, t, d = q
        k_shape = (*lead, d, t) if self.k_transposed.value.data else (*lead, t, d)
        if tensor_shape(self.operands[1]) != k_shape or tensor_shape(self.operands[2]) != q:
            raise VerifyException(f"'{self.name}': k {list(tensor_shape(self.operands[1]))} or v "
                                  f"{list(tensor_shape(self.operands[2]))} do not fit q {list(q)}")
        if not 0.0 <= self.rate.value.data < 1.0:
            raise VerifyException(f"'{self.name}' rate must be in [0, 1)")
        if (self.rate.value.data > 0.0) != (self.step is not None):
            raise VerifyException(f"'{self.name}' takes a step operand exactly when it drops out")
        stored = [self.operands[i].type.element_type for i in (0, 1, 2)]  # type: ignore[attr-defined]
        if len(set(stored)) != 1 or not isinstance(stored[0], STORED):
            raise VerifyException(f"'{self.name}': q, k, v must be of one float type (f32, bf16, f16), got "
                                  f"{', '.join(map(str, stored))}")

    def _kernel_parts(self) -> dict[str, str]:
        _, t, d = self.dims()
        if d > MAX_HEAD_DIM:
            raise EmitError(f"'{self.name}' with head dim {d} > {MAX_HEAD_DIM}")
        st = c_type(self.operands[0].type)
        if st not in ("float", "hs_bf16", "hs_half"):
            raise EmitError(f"'{self.name}' stores float32, bfloat16 or float16 only, not {st}")
        rate = self.rate.value.data
        kt = bool(self.k_transposed.value.data)
        parts = {"st": st, "t": str(t), "d": str(d), "dp": str(d + 1), "causal": "1" if self.causal.value.data else "0",
                 "scale": flit(self.scale.value.data), **{k: str(v) for k, v in tiles(d).items()}}
        # element (key k0 + jj, column c) of this head's keys
        parts["kload"] = "kb[(long)c * {t}L + k0 + jj]" if kt else "kb[(k0 + jj) * {d}L + c]"
        parts["kloadb"] = parts["kload"]
        if rate > 0.0:
            seed, salt = self.seed.value.data & 0xFFFFFFFFFFFFFFFF, self.salt.value.data & 0xFFFFFFFFFFFFFFFF
            step = f"in{len(self.operands) - 1}"
            parts["keydecl"] = f"const unsigned long long key = hs_dropout_key({seed}ULL, {salt}ULL, (unsigned long long){step}[0]);"
            keep = f"hs_dropout_uniform(key, at_) >= {rate!r}"
            parts["dropp"] = (f"hs_dropout_uniform(key, ((unsigned long long)(bh * {{t}}L + q0 + i)) * {{t}}ULL + "
                              f"(unsigned long long)(k0 + jj)) >= {rate!r} ? p * {flit(1.0 / (1.0 - rate))} : 0.0f")
            parts["dropentry"] = (f"const bool keep_ = {keep};\n"
                                  f"          pd_ = keep_ ? pr * {flit(1.0 / (1.0 - rate))} : 0.0f;\n"
                                  f"          const float dp = keep_ ? dpd * {flit(1.0 / (1.0 - rate))} : 0.0f;")
        else:
            parts["keydecl"] = ""
            parts["dropp"] = "p"
            parts["dropentry"] = "pd_ = pr;\n          const float dp = dpd;"
        parts["nqb"] = str(-(-t // FWD_QUERIES))
        return parts


@irdl_op_definition
class FlashAttentionOp(_FlashFacts):
    """`o = dropout(softmax(scale q k^T, causal)) v` and the rows' logsumexp `lse` of the scores
    (see the module docstring); `step` (a scalar integer) only where `rate` > 0."""

    name = "graph.flash_attention"
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    step = opt_operand_def(TensorType)
    o = result_def(TensorType)
    lse = result_def(TensorType)
    NO_VJP: ClassVar[str] = "made after autodiff; flash-attention puts its gradient beside it (flash_attention_grad)"

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, step: SSAValue | None, *, scale: float, causal: bool,
                 k_transposed: bool = False, rate: float = 0.0, seed: int = 0, salt: int = 0):
        qt = q.type
        lse = tensor_type(f32, tensor_shape(q)[:-1])  # float32 whatever q's type
        super().__init__(operands=[q, k, v, [step] if step is not None else []], result_types=[qt, lse],
                         properties=self.props(scale, causal, k_transposed, rate, seed, salt))

    def verify_(self) -> None:
        self.check()

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda *args: flash_attention_values(self, *args)

    def cuda_kernel(self, name: str) -> KernelCode:
        parts = self._kernel_parts()
        bh, _, _ = self.dims()
        src = PRELUDE + fill(FWD, name=name, params=", ".join(kernel_params(self)).replace("T* scratch", "float* scratch"))
        src = fill(src, **parts)
        src = fill(src, **parts)  # the dropout's index names {t}
        return KernelCode(src, [f"row {name}_fwd {bh * int(parts['nqb'])} {LAUNCH_COLS}"])


@irdl_op_definition
class FlashAttentionGradOp(_FlashFacts):
    """`dq, dk, dv` of `graph.flash_attention` from q, k, v, its o, the gradient `do` of o and
    its `lse` (and `step` where it dropped out); dk is [..., T, D] whatever the layout of k."""

    name = "graph.flash_attention_grad"
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    o = operand_def(TensorType)
    do = operand_def(TensorType)
    lse = operand_def(TensorType)
    step = opt_operand_def(TensorType)
    dq = result_def(TensorType)
    dk = result_def(TensorType)
    dv = result_def(TensorType)
    #: 1: o is [B, T, H, D] (heads inside the sequence, as attention's output is before its heads
    #: merge), q [B, H, T, D]; 0: o is laid out as q
    o_heads_inside = prop_def(IntegerAttr[I64])
    NO_VJP: ClassVar[str] = "a gradient op"

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, o: SSAValue, do: SSAValue, lse: SSAValue,
                 step: SSAValue | None, *, scale: float, causal: bool, k_transposed: bool = False, rate: float = 0.0,
                 seed: int = 0, salt: int = 0, o_heads_inside: bool = False):
        props = self.props(scale, causal, k_transposed, rate, seed, salt)
        super().__init__(operands=[q, k, v, o, do, lse, [step] if step is not None else []],
                         result_types=[q.type, q.type, q.type],
                         properties={**props, "o_heads_inside": int_attr(int(o_heads_inside))})

    def verify_(self) -> None:
        self.check()
        q = tensor_shape(self.q)
        o = (q[0], q[2], q[1], q[3]) if self.o_heads_inside.value.data and len(q) == 4 else q
        if self.o_heads_inside.value.data and len(q) != 4:
            raise VerifyException(f"'{self.name}': o [B, T, H, D] needs q [B, H, T, D], got {list(q)}")
        if tensor_shape(self.o) != o or tensor_shape(self.do) != q or tensor_shape(self.lse) != q[:-1]:
            raise VerifyException(f"'{self.name}': o, do or lse do not fit q {list(q)}")
        et = self.q.type.element_type  # type: ignore[attr-defined]
        if self.o.type.element_type != et or self.do.type.element_type != et:  # type: ignore[attr-defined]
            raise VerifyException(f"'{self.name}': o and do must be of q's type {et}")
        if not isinstance(self.lse.type.element_type, Float32Type):  # type: ignore[attr-defined]
            raise VerifyException(f"'{self.name}': lse must be float32")

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda *args: flash_attention_grad_values(self, *args)

    def cuda_kernel(self, name: str) -> KernelCode:
        parts = self._kernel_parts()
        bh, t, d = self.dims()
        tl = tiles(d)
        parts["nkb"] = str(-(-t // tl["bkv"]))
        if self.o_heads_inside.value.data:  # o [B, T, H, D]: row i = (b H + h) T + t of q is o's (b T + t) H + h
            heads = tensor_shape(self.q)[-3]
            parts["orow"] = (f"(((i / {t}L) / {heads}L * {t}L + i % {t}L) * {heads}L + (i / {t}L) % {heads}L) * {d}L")
        else:
            parts["orow"] = f"i * {d}L"
        parts["nqb3"] = str(-(-t // tl["bq3"]))
        params = ", ".join(kernel_params(self, scratch=1)).replace("T* scratch", "float* scratch")
        entry = ENTRY.replace("{dropentry}", parts["dropentry"])
        src = PRELUDE + "".join(fill(x, name=name, params=params, entry=entry) for x in (BWD_DOT, BWD_DKV, BWD_DQ))
        src = fill(fill(src, **parts), **parts)
        launches = [f"elementwise {name}_dot {bh * t} 0", f"row {name}_dkv {bh * int(parts['nkb'])} {LAUNCH_COLS}",
                    f"row {name}_dq {bh * int(parts['nqb3'])} {LAUNCH_COLS}"]
        return KernelCode(src, launches, [bh * t])
