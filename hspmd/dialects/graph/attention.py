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
gradient); lse [..., T] (float32); the leading dims are one batch of B x H heads. Tiles are sized
per head dim so that a block's static shared memory stays under 48 KiB (sm_80 and sm_90 without
opting in to more): D <= 128.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import I64, FloatAttr, IntegerAttr, TensorType
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
from hspmd.dialects.graph.base import float_attr, int_attr, tensor_shape, tensor_type
from hspmd.dialects.graph.positions import dropout_key, dropout_uniform
from hspmd.dialects.interfaces import Kernel, KernelContext

__all__ = ["FlashAttentionGradOp", "FlashAttentionOp"]

#: the largest head dim the kernels take (their tiles are sized for it)
MAX_HEAD_DIM = 128
#: static shared memory a block may use without opting in (sm_80, sm_90)
SHARED_BYTES = 48 * 1024
#: queries per block of the forward (the issue's "block of 64 queries")
FWD_QUERIES = 64
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


# ----------------------------------------------------------------------------- CUDA C

# Shared arrays of a block: on a GPU `__shared__`; in the serial CPU emulation (one thread a
# block, blocks run at once on the cores) the block's own, on its stack.
_PRELUDE = """\
#undef HS_TILE
#ifdef HS_SERIAL_BLOCK
#define HS_TILE
#else
#define HS_TILE __shared__
#endif
"""

# The forward: a block per (batch x head, BQ queries). Per block of BK keys: the scores into `s`
# (the key tile in `kv`), then per query row the new running maximum, the correction of what
# was summed so far, the probabilities (dropped out where the mask says, the row sum without
# the dropout, as softmax's), then the V tile in `kv` and `acc += p v`.
_FWD = """\
// {name}_fwd: flash attention forward, a block per (batch x head, {bq} queries)
HS_KERNEL void {name}_fwd({params}) {
  HS_TILE float acc[{bq} * {d}];
  HS_TILE float kv[{bk} * {dp}];
  HS_TILE float s[{bq} * {bk}];
  HS_TILE float mrow[{bq}], lrow[{bq}], crow[{bq}];
  const float* q = in0; const float* k = in1; const float* v = in2;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nqb}L, q0 = (r % {nqb}L) * {bq}L;
    const int rows = {t}L - q0 < {bq}L ? (int)({t}L - q0) : {bq};
    const float* qb = q + (bh * {t}L + q0) * {d}L;
    const float* kb = k + bh * {t}L * {d}L;
    const float* vb = v + bh * {t}L * {d}L;
    const long kend = {causal} ? q0 + rows : {t}L;
    for (int x = threadIdx.x; x < {bq} * {d}; x += blockDim.x) acc[x] = 0.0f;
    for (int i = threadIdx.x; i < {bq}; i += blockDim.x) { mrow[i] = -HS_INF; lrow[i] = 0.0f; crow[i] = 1.0f; }
    __syncthreads();
    for (long k0 = 0; k0 < kend; k0 += {bk}) {
      const int kn = kend - k0 < {bk}L ? (int)(kend - k0) : {bk};
      for (int x = threadIdx.x; x < kn * {d}; x += blockDim.x) {
        const int jj = x / {d}, c = x % {d};
        kv[jj * {dp} + c] = {kload};
      }
      __syncthreads();
      // the scores by micro-tiles of 4 queries x {cs} keys: each value read serves several products
      for (int x = threadIdx.x; x < {bq} / 4 * ({bk} / {cs}); x += blockDim.x) {
        const int i0 = x / ({bk} / {cs}) * 4, j0 = x % ({bk} / {cs}) * {cs};
        if (i0 >= rows) continue;
        const float* qr[4];
        for (int a = 0; a < 4; ++a) qr[a] = qb + (long)(i0 + a < rows ? i0 + a : i0) * {d};
        float dot[4][{cs}];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < {cs}; ++b) dot[a][b] = 0.0f;
        for (int c = 0; c < {d}; ++c) {
          float qa[4], kc[{cs}];
          for (int a = 0; a < 4; ++a) qa[a] = qr[a][c];
          for (int b = 0; b < {cs}; ++b) kc[b] = kv[(j0 + b) * {dp} + c];
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < {cs}; ++b) dot[a][b] += qa[a] * kc[b];
        }
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < {cs}; ++b) {
            const int i = i0 + a, jj = j0 + b;
            s[i * {bk} + jj] = jj < kn && !({causal} && k0 + jj > q0 + i) ? dot[a][b] * {scale} : -HS_INF;
          }
      }
      __syncthreads();
      for (int x = threadIdx.x; x < kn * {d}; x += blockDim.x) kv[(x / {d}) * {dp} + x % {d}] = vb[(k0 + x / {d}) * {d}L + x % {d}];
      for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        float m = mrow[i];
        for (int jj = 0; jj < kn; ++jj) m = hs_max(m, s[i * {bk} + jj]);
        const bool none = m == -HS_INF;  // no key of this row yet (not in a causal row: key 0 comes first)
        const float corr = none ? 1.0f : hs_exp(mrow[i] - m);
        float l = 0.0f;
        for (int jj = 0; jj < kn; ++jj) {
          const float p = none ? 0.0f : hs_exp(s[i * {bk} + jj] - m);
          l += p;
          s[i * {bk} + jj] = {dropp};
        }
        lrow[i] = lrow[i] * corr + l;
        mrow[i] = m;
        crow[i] = corr;
      }
      __syncthreads();
      // acc += p v by micro-tiles of 4 queries x {cc} columns
      for (int x = threadIdx.x; x < {bq} / 4 * ({d} / {cc}); x += blockDim.x) {
        const int i0 = x / ({d} / {cc}) * 4, c0 = x % ({d} / {cc}) * {cc};
        if (i0 >= rows) continue;
        float a[4][{cc}];
        for (int r = 0; r < 4; ++r)
          for (int b = 0; b < {cc}; ++b) a[r][b] = acc[(i0 + r) * {d} + c0 + b] * crow[i0 + r];
        for (int jj = 0; jj < kn; ++jj) {
          float pr[4], vc[{cc}];
          for (int r = 0; r < 4; ++r) pr[r] = s[(i0 + r) * {bk} + jj];
          for (int b = 0; b < {cc}; ++b) vc[b] = kv[jj * {dp} + c0 + b];
          for (int r = 0; r < 4; ++r)
            for (int b = 0; b < {cc}; ++b) a[r][b] += pr[r] * vc[b];
        }
        for (int r = 0; r < 4; ++r)
          for (int b = 0; b < {cc}; ++b) acc[(i0 + r) * {d} + c0 + b] = a[r][b];
      }
      __syncthreads();
    }
    for (int x = threadIdx.x; x < rows * {d}; x += blockDim.x) out0[(bh * {t}L + q0) * {d}L + x] = acc[x] / lrow[x / {d}];
    for (int i = threadIdx.x; i < rows; i += blockDim.x) out1[bh * {t}L + q0 + i] = mrow[i] + hs_log(lrow[i]);
    __syncthreads();
  }
}
"""

# The backward's first launch: D_i = dO_i . O_i per query row (= sum_j P_ij dP_ij), into scratch.
_BWD_DOT = """\
// {name}_dot: the rows' dO . O
HS_KERNEL void {name}_dot({params}) {
  HS_FOR(i, n0) {
    const float* oi = in3 + {orow};
    const float* gi = in4 + i * {d}L;
    float acc = 0.0f;
    for (int c = 0; c < {d}; ++c) acc += gi[c] * oi[c];
    scratch0[i] = acc;
  }
}
"""

# Recompute one entry (query row `qrow`, key `kcol`) of the probabilities from the logsumexp:
# p (softmax's), pd (after dropout: what multiplied v), ds (the scores' gradient without the scale).
_ENTRY = """\
          const float pr = hs_exp(sdot * {scale} - lrow_);
          const float dpd = gdot;
          {dropentry}
          ds_ = pr * (dp - drow_);
"""

# dk, dv: a block per (batch x head, BKV keys), over the blocks of BQ2 queries that see them.
_BWD_DKV = """\
// {name}_dkv: flash attention backward, dk and dv: a block per (batch x head, {bkv} keys)
HS_KERNEL void {name}_dkv({params}) {
  HS_TILE float dk[{bkv} * {d}], dv[{bkv} * {d}];
  HS_TILE float ks[{bkv} * {dp}], vs[{bkv} * {dp}];
  HS_TILE float qs[{bq2} * {dp}], gs[{bq2} * {dp}];
  HS_TILE float pds[{bq2} * {bkv}], dss[{bq2} * {bkv}];
  HS_TILE float ls[{bq2}], dsum[{bq2}];
  const float* q = in0; const float* k = in1; const float* v = in2; const float* g = in4; const float* lse = in5;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nkb}L, k0 = (r % {nkb}L) * {bkv}L;
    const int kn = {t}L - k0 < {bkv}L ? (int)({t}L - k0) : {bkv};
    const float* kb = k + bh * {t}L * {d}L;
    const float* vb = v + bh * {t}L * {d}L;
    for (int x = threadIdx.x; x < {bkv} * {d}; x += blockDim.x) { dk[x] = 0.0f; dv[x] = 0.0f; }
    for (int x = threadIdx.x; x < kn * {d}; x += blockDim.x) {
      const int jj = x / {d}, c = x % {d};
      ks[jj * {dp} + c] = {kloadb};
      vs[jj * {dp} + c] = vb[(k0 + jj) * {d}L + c];
    }
    __syncthreads();
    for (long i0 = {causal} ? k0 / {bq2}L * {bq2}L : 0; i0 < {t}L; i0 += {bq2}) {
      const int qn = {t}L - i0 < {bq2}L ? (int)({t}L - i0) : {bq2};
      for (int x = threadIdx.x; x < qn * {d}; x += blockDim.x) {
        const int ii = x / {d}, c = x % {d};
        qs[ii * {dp} + c] = q[(bh * {t}L + i0 + ii) * {d}L + c];
        gs[ii * {dp} + c] = g[(bh * {t}L + i0 + ii) * {d}L + c];
      }
      for (int ii = threadIdx.x; ii < qn; ii += blockDim.x) { ls[ii] = lse[bh * {t}L + i0 + ii]; dsum[ii] = scratch0[bh * {t}L + i0 + ii]; }
      __syncthreads();
      // p, its dropout and the scores' gradient by micro-tiles of {r2} queries x {c2} keys
      for (int x = threadIdx.x; x < {bq2} / {r2} * ({bkv} / {c2}); x += blockDim.x) {
        const int ii0 = x / ({bkv} / {c2}) * {r2}, jj0 = x % ({bkv} / {c2}) * {c2};
        float sd[{r2}][{c2}], gd[{r2}][{c2}];
        for (int a = 0; a < {r2}; ++a)
          for (int b = 0; b < {c2}; ++b) { sd[a][b] = 0.0f; gd[a][b] = 0.0f; }
        for (int c = 0; c < {d}; ++c) {
          float qa[{r2}], ga[{r2}], kc[{c2}], vc[{c2}];
          for (int a = 0; a < {r2}; ++a) { qa[a] = qs[(ii0 + a) * {dp} + c]; ga[a] = gs[(ii0 + a) * {dp} + c]; }
          for (int b = 0; b < {c2}; ++b) { kc[b] = ks[(jj0 + b) * {dp} + c]; vc[b] = vs[(jj0 + b) * {dp} + c]; }
          for (int a = 0; a < {r2}; ++a)
            for (int b = 0; b < {c2}; ++b) { sd[a][b] += qa[a] * kc[b]; gd[a][b] += ga[a] * vc[b]; }
        }
        for (int a = 0; a < {r2}; ++a)
          for (int b = 0; b < {c2}; ++b) {
            const int ii = ii0 + a, jj = jj0 + b;
            float pd_ = 0.0f, ds_ = 0.0f;
            if (ii < qn && jj < kn && !({causal} && k0 + jj > i0 + ii)) {
              const float sdot = sd[a][b], gdot = gd[a][b];
              const float lrow_ = ls[ii], drow_ = dsum[ii];
              const unsigned long long at_ = ((unsigned long long)(bh * {t}L + i0 + ii)) * {t}ULL + (unsigned long long)(k0 + jj);
              (void)at_;
{entry}
            }
            pds[ii * {bkv} + jj] = pd_;
            dss[ii * {bkv} + jj] = ds_;
          }
      }
      __syncthreads();
      // dv += pd^T do, dk += ds^T q by micro-tiles of 2 keys x {cc} columns
      for (int x = threadIdx.x; x < {bkv} / 2 * ({d} / {cc}); x += blockDim.x) {
        const int j0 = x / ({d} / {cc}) * 2, c0 = x % ({d} / {cc}) * {cc};
        if (j0 >= kn) continue;
        float a[2][{cc}], b[2][{cc}];
        for (int r = 0; r < 2; ++r)
          for (int e = 0; e < {cc}; ++e) { a[r][e] = dv[(j0 + r) * {d} + c0 + e]; b[r][e] = dk[(j0 + r) * {d} + c0 + e]; }
        for (int ii = 0; ii < qn; ++ii) {
          float pc[2], sc[2], gc[{cc}], qc[{cc}];
          for (int r = 0; r < 2; ++r) { pc[r] = pds[ii * {bkv} + j0 + r]; sc[r] = dss[ii * {bkv} + j0 + r]; }
          for (int e = 0; e < {cc}; ++e) { gc[e] = gs[ii * {dp} + c0 + e]; qc[e] = qs[ii * {dp} + c0 + e]; }
          for (int r = 0; r < 2; ++r)
            for (int e = 0; e < {cc}; ++e) { a[r][e] += pc[r] * gc[e]; b[r][e] += sc[r] * qc[e]; }
        }
        for (int r = 0; r < 2; ++r)
          for (int e = 0; e < {cc}; ++e) { dv[(j0 + r) * {d} + c0 + e] = a[r][e]; dk[(j0 + r) * {d} + c0 + e] = b[r][e]; }
      }
      __syncthreads();
    }
    for (int x = threadIdx.x; x < kn * {d}; x += blockDim.x) {
      out1[(bh * {t}L + k0) * {d}L + x] = dk[x] * {scale};
      out2[(bh * {t}L + k0) * {d}L + x] = dv[x];
    }
    __syncthreads();
  }
}
"""

# dq: a block per (batch x head, BQ3 queries), over the blocks of BK3 keys they see.
_BWD_DQ = """\
// {name}_dq: flash attention backward, dq: a block per (batch x head, {bq3} queries)
HS_KERNEL void {name}_dq({params}) {
  HS_TILE float dq[{bq3} * {d}];
  HS_TILE float ks[{bk3} * {dp}], vs[{bk3} * {dp}];
  HS_TILE float dss[{bq3} * {bk3}];
  const float* q = in0; const float* k = in1; const float* v = in2; const float* g = in4; const float* lse = in5;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nqb3}L, q0 = (r % {nqb3}L) * {bq3}L;
    const int rows = {t}L - q0 < {bq3}L ? (int)({t}L - q0) : {bq3};
    const float* kb = k + bh * {t}L * {d}L;
    const float* vb = v + bh * {t}L * {d}L;
    const long kend = {causal} ? q0 + rows : {t}L;
    for (int x = threadIdx.x; x < {bq3} * {d}; x += blockDim.x) dq[x] = 0.0f;
    for (long k0 = 0; k0 < kend; k0 += {bk3}) {
      const int kn = kend - k0 < {bk3}L ? (int)(kend - k0) : {bk3};
      for (int x = threadIdx.x; x < kn * {d}; x += blockDim.x) {
        const int jj = x / {d}, c = x % {d};
        ks[jj * {dp} + c] = {kloadb};
        vs[jj * {dp} + c] = vb[(k0 + jj) * {d}L + c];
      }
      __syncthreads();
      // the scores' gradient by micro-tiles of {r3} queries x {c3} keys
      for (int x = threadIdx.x; x < {bq3} / {r3} * ({bk3} / {c3}); x += blockDim.x) {
        const int i0 = x / ({bk3} / {c3}) * {r3}, j0 = x % ({bk3} / {c3}) * {c3};
        if (i0 >= rows) continue;
        const float* qr[{r3}];
        const float* gr[{r3}];
        for (int a = 0; a < {r3}; ++a) {
          const long row = bh * {t}L + q0 + (i0 + a < rows ? i0 + a : i0);
          qr[a] = q + row * {d}L;
          gr[a] = g + row * {d}L;
        }
        float sd[{r3}][{c3}], gd[{r3}][{c3}];
        for (int a = 0; a < {r3}; ++a)
          for (int b = 0; b < {c3}; ++b) { sd[a][b] = 0.0f; gd[a][b] = 0.0f; }
        for (int c = 0; c < {d}; ++c) {
          float qa[{r3}], ga[{r3}], kc[{c3}], vc[{c3}];
          for (int a = 0; a < {r3}; ++a) { qa[a] = qr[a][c]; ga[a] = gr[a][c]; }
          for (int b = 0; b < {c3}; ++b) { kc[b] = ks[(j0 + b) * {dp} + c]; vc[b] = vs[(j0 + b) * {dp} + c]; }
          for (int a = 0; a < {r3}; ++a)
            for (int b = 0; b < {c3}; ++b) { sd[a][b] += qa[a] * kc[b]; gd[a][b] += ga[a] * vc[b]; }
        }
        for (int a = 0; a < {r3}; ++a)
          for (int b = 0; b < {c3}; ++b) {
            const int i = i0 + a, jj = j0 + b;
            float ds_ = 0.0f, pd_ = 0.0f;
            if (i < rows && jj < kn && !({causal} && k0 + jj > q0 + i)) {
              const long row = bh * {t}L + q0 + i;
              const float sdot = sd[a][b], gdot = gd[a][b];
              const float lrow_ = lse[row], drow_ = scratch0[row];
              const unsigned long long at_ = (unsigned long long)row * {t}ULL + (unsigned long long)(k0 + jj);
              (void)at_;
{entry}
            }
            (void)pd_;
            dss[i * {bk3} + jj] = ds_;
          }
      }
      __syncthreads();
      // dq += ds k by micro-tiles of 4 queries x {cc} columns
      for (int x = threadIdx.x; x < {bq3} / 4 * ({d} / {cc}); x += blockDim.x) {
        const int i0 = x / ({d} / {cc}) * 4, c0 = x % ({d} / {cc}) * {cc};
        if (i0 >= rows) continue;
        float a[4][{cc}];
        for (int r = 0; r < 4; ++r)
          for (int e = 0; e < {cc}; ++e) a[r][e] = dq[(i0 + r) * {d} + c0 + e];
        for (int jj = 0; jj < kn; ++jj) {
          float sc[4], kc[{cc}];
          for (int r = 0; r < 4; ++r) sc[r] = dss[(i0 + r) * {bk3} + jj];
          for (int e = 0; e < {cc}; ++e) kc[e] = ks[jj * {dp} + c0 + e];
          for (int r = 0; r < 4; ++r)
            for (int e = 0; e < {cc}; ++e) a[r][e] += sc[r] * kc[e];
        }
        for (int r = 0; r < 4; ++r)
          for (int e = 0; e < {cc}; ++e) dq[(i0 + r) * {d} + c0 + e] = a[r][e];
      }
      __syncthreads();
    }
    for (int x = threadIdx.x; x < rows * {d}; x += blockDim.x) out0[(bh * {t}L + q0) * {d}L + x] = dq[x] * {scale};
    __syncthreads();
  }
}
"""


def _fill(template: str, **kw) -> str:
    for key, value in kw.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def _flit(x: float) -> str:
    return f"{float(np.float32(x))!r}f"


def tiles(d: int) -> dict[str, int]:
    """Return the tile sizes of the three kernels for head dim `d`, each block's shared memory
    under `SHARED_BYTES` (rows of d + 1 floats: threads reading one column of a tile hit
    different banks)."""
    dp = d + 1
    small = d <= 64
    t = {
        # forward: queries a block, keys a tile, micro-tiles of 4 queries x cs keys (scores) and
        # 4 queries x cc columns (p v)
        "bq": FWD_QUERIES, "bk": 32 if small else 16, "cs": 4 if small else 2,
        "cc": 4 if d % 4 == 0 else 2 if d % 2 == 0 else 1,
        # dk, dv: keys a block, queries a tile, micro-tiles of r2 x c2 (p, ds) and 2 keys x cc
        "bkv": 32 if small else 16, "bq2": 16 if small else 8, "r2": 2 if small else 1, "c2": 2 if small else 1,
        # dq: queries a block, keys a tile, micro-tiles of r3 x c3 (ds) and 4 queries x cc
        "bq3": 64 if small else 32, "bk3": 32 if small else 16, "r3": 4 if small else 2, "c3": 4 if small else 2,
    }
    fwd = t["bq"] * d + t["bk"] * dp + t["bq"] * t["bk"] + 3 * t["bq"]
    dkv = 2 * t["bkv"] * d + 2 * t["bkv"] * dp + 2 * t["bq2"] * dp + 2 * t["bq2"] * t["bkv"] + 2 * t["bq2"]
    dq = t["bq3"] * d + 2 * t["bk3"] * dp + t["bq3"] * t["bk3"]
    assert 4 * max(fwd, dkv, dq) <= SHARED_BYTES, (d, fwd, dkv, dq)
    return t


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
        q, k, v, do = ((0.5 * rng.standard_normal((*lead, t, d))).astype(np.float32) for _ in range(4))
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

    def _kernel_parts(self) -> dict[str, str]:
        _, t, d = self.dims()
        if d > MAX_HEAD_DIM:
            raise EmitError(f"'{self.name}' with head dim {d} > {MAX_HEAD_DIM}")
        if c_type(self.operands[0].type) != "float":
            raise EmitError(f"'{self.name}' computes in float32 only")
        rate = self.rate.value.data
        kt = bool(self.k_transposed.value.data)
        parts = {"t": str(t), "d": str(d), "dp": str(d + 1), "causal": "1" if self.causal.value.data else "0",
                 "scale": _flit(self.scale.value.data), **{k: str(v) for k, v in tiles(d).items()}}
        # element (key k0 + jj, column c) of this head's keys
        parts["kload"] = "kb[(long)c * {t}L + k0 + jj]" if kt else "kb[(k0 + jj) * {d}L + c]"
        parts["kloadb"] = parts["kload"]
        if rate > 0.0:
            seed, salt = self.seed.value.data & 0xFFFFFFFFFFFFFFFF, self.salt.value.data & 0xFFFFFFFFFFFFFFFF
            step = f"in{len(self.operands) - 1}"
            parts["keydecl"] = f"const unsigned long long key = hs_dropout_key({seed}ULL, {salt}ULL, (unsigned long long){step}[0]);"
            keep = f"hs_dropout_uniform(key, at_) >= {rate!r}"
            parts["dropp"] = (f"hs_dropout_uniform(key, ((unsigned long long)(bh * {{t}}L + q0 + i)) * {{t}}ULL + "
                              f"(unsigned long long)(k0 + jj)) >= {rate!r} ? p * {_flit(1.0 / (1.0 - rate))} : 0.0f")
            parts["dropentry"] = (f"const bool keep_ = {keep};\n"
                                  f"          pd_ = keep_ ? pr * {_flit(1.0 / (1.0 - rate))} : 0.0f;\n"
                                  f"          const float dp = keep_ ? dpd * {_flit(1.0 / (1.0 - rate))} : 0.0f;")
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
        lse = tensor_type(qt.element_type, tensor_shape(q)[:-1])  # type: ignore[attr-defined]
        super().__init__(operands=[q, k, v, [step] if step is not None else []], result_types=[qt, lse],
                         properties=self.props(scale, causal, k_transposed, rate, seed, salt))

    def verify_(self) -> None:
        self.check()

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda *args: flash_attention_values(self, *args)

    def cuda_kernel(self, name: str) -> KernelCode:
        parts = self._kernel_parts()
        bh, _, _ = self.dims()
        src = _PRELUDE + _fill(_FWD, name=name, params=", ".join(kernel_params(self)).replace("T* scratch", "float* scratch"))
        src = _fill(src, **parts)
        src = _fill(src, **parts)  # the dropout's index names {t}
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
        entry = _ENTRY.replace("{dropentry}", parts["dropentry"])
        src = _PRELUDE + "".join(_fill(x, name=name, params=params, entry=entry) for x in (_BWD_DOT, _BWD_DKV, _BWD_DQ))
        src = _fill(_fill(src, **parts), **parts)
        launches = [f"elementwise {name}_dot {bh * t} 0", f"row {name}_dkv {bh * int(parts['nkb'])} {LAUNCH_COLS}",
                    f"row {name}_dq {bh * int(parts['nqb3'])} {LAUNCH_COLS}"]
        return KernelCode(src, launches, [bh * t])
