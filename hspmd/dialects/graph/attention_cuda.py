"""The CUDA C of flash attention's kernels (`graph.flash_attention`, `graph.flash_attention_grad`):
the source templates of the forward and the backward's three kernels, and their tile sizes per
head dim. The ops (`attention.py`) fill them in with their shapes, scale, mask and dropout.
"""

from __future__ import annotations

import numpy as np

#: static shared memory a block may use without opting in (sm_80, sm_90)
SHARED_BYTES = 48 * 1024
#: queries per block of the forward (the issue's "block of 64 queries")
FWD_QUERIES = 64

# Shared arrays of a block: on a GPU `__shared__`; in the serial CPU emulation (one thread a
# block, blocks run at once on the cores) the block's own, on its stack.
PRELUDE = """\
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
FWD = """\
// {name}_fwd: flash attention forward, a block per (batch x head, {bq} queries)
HS_KERNEL void {name}_fwd({params}) {
  HS_TILE float acc[{bq} * {d}];
  HS_TILE float kv[{bk} * {dp}];
  HS_TILE float s[{bq} * {bk}];
  HS_TILE float mrow[{bq}], lrow[{bq}], crow[{bq}];
  const {st}* q = in0; const {st}* k = in1; const {st}* v = in2;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nqb}L, q0 = (r % {nqb}L) * {bq}L;
    const int rows = {t}L - q0 < {bq}L ? (int)({t}L - q0) : {bq};
    const {st}* qb = q + (bh * {t}L + q0) * {d}L;
    const {st}* kb = k + bh * {t}L * {d}L;
    const {st}* vb = v + bh * {t}L * {d}L;
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
        const {st}* qr[4];
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
        hs_tile_madd<4, {cc}>(a, s + i0 * {bk}, {bk}, 1, kv + c0, {dp}, kn);
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
BWD_DOT = """\
// {name}_dot: the rows' dO . O
HS_KERNEL void {name}_dot({params}) {
  HS_FOR(i, n0) {
    const {st}* oi = in3 + {orow};
    const {st}* gi = in4 + i * {d}L;
    float acc = 0.0f;
    for (int c = 0; c < {d}; ++c) acc += (float)gi[c] * (float)oi[c];
    scratch0[i] = acc;
  }
}
"""

# Recompute one entry (query row `qrow`, key `kcol`) of the probabilities from the logsumexp:
# p (softmax's), pd (after dropout: what multiplied v), ds (the scores' gradient without the scale).
ENTRY = """\
          const float pr = hs_exp(sdot * {scale} - lrow_);
          const float dpd = gdot;
          {dropentry}
          ds_ = pr * (dp - drow_);
"""

# dk, dv: a block per (batch x head, BKV keys), over the blocks of BQ2 queries that see them.
BWD_DKV = """\
// {name}_dkv: flash attention backward, dk and dv: a block per (batch x head, {bkv} keys)
HS_KERNEL void {name}_dkv({params}) {
  HS_TILE float dk[{bkv} * {d}], dv[{bkv} * {d}];
  HS_TILE float ks[{bkv} * {dp}], vs[{bkv} * {dp}];
  HS_TILE float qs[{bq2} * {dp}], gs[{bq2} * {dp}];
  HS_TILE float pds[{bq2} * {bkv}], dss[{bq2} * {bkv}];
  HS_TILE float ls[{bq2}], dsum[{bq2}];
  const {st}* q = in0; const {st}* k = in1; const {st}* v = in2; const {st}* g = in4; const float* lse = in5;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nkb}L, k0 = (r % {nkb}L) * {bkv}L;
    const int kn = {t}L - k0 < {bkv}L ? (int)({t}L - k0) : {bkv};
    const {st}* kb = k + bh * {t}L * {d}L;
    const {st}* vb = v + bh * {t}L * {d}L;
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
        hs_tile_madd<2, {cc}>(a, pds + j0, 1, {bkv}, gs + c0, {dp}, qn);  // dv += pd^T do
        hs_tile_madd<2, {cc}>(b, dss + j0, 1, {bkv}, qs + c0, {dp}, qn);  // dk += ds^T q
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
BWD_DQ = """\
// {name}_dq: flash attention backward, dq: a block per (batch x head, {bq3} queries)
HS_KERNEL void {name}_dq({params}) {
  HS_TILE float dq[{bq3} * {d}];
  HS_TILE float ks[{bk3} * {dp}], vs[{bk3} * {dp}];
  HS_TILE float dss[{bq3} * {bk3}];
  const {st}* q = in0; const {st}* k = in1; const {st}* v = in2; const {st}* g = in4; const float* lse = in5;
  {keydecl}
  HS_ROWS(r, n0) {
    const long bh = r / {nqb3}L, q0 = (r % {nqb3}L) * {bq3}L;
    const int rows = {t}L - q0 < {bq3}L ? (int)({t}L - q0) : {bq3};
    const {st}* kb = k + bh * {t}L * {d}L;
    const {st}* vb = v + bh * {t}L * {d}L;
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
        const {st}* qr[{r3}];
        const {st}* gr[{r3}];
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
        hs_tile_madd<4, {cc}>(a, dss + i0 * {bk3}, {bk3}, 1, ks + c0, {dp}, kn);
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


def fill(template: str, **kw) -> str:
    for key, value in kw.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def flit(x: float) -> str:
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
