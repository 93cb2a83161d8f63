// hspmd: batches of small float32 matrix products, C[b] = A[b] @ B[b], on the CPU.
//
// Built by the host C++ compiler (hspmd/codegen/cpu_compile.py, `build_native`) after
// parallel.cpp, in one translation unit (it uses its `hs_parallel_for`), loaded through ctypes by
// hspmd/runtime/small_matmul.py. Attention's products (64 products of 128 x 64 by
// 64 x 128 and the like per call in GPT-tiny) are too small for OpenBLAS to reach the machine's
// rate: it is called once per product, packs both operands, and splits each product over its
// threads. Here one call runs the whole batch; each product runs on one thread, and the products
// are shared out to the threads one at a time. B is packed in panels; A, where one of its strides
// is 1 (always, in attention), is read where it lies.
//
// Values: every element of C is one chain of fused multiply-adds over k in increasing order,
// starting from +0: c = fma(a[i,k], b[k,j], c). That is what OpenBLAS's AVX-512 and AVX2 kernels
// compute for these shapes (its K blocks are longer than attention's K), so the bits are
// OpenBLAS's there; and they do not depend on the blocking, the batch, the thread or the vector
// width, so every build of this file (AVX-512, AVX2+FMA, or scalar std::fma) gives the same bits.
// Products with a triangular operand (causal attention's) skip the terms whose factor is an exact
// zero: fma(0, b, c) = c for finite b, so skipping them changes no bit.
//
// Triangles (`tri`):
//   0 none; 1 A lower (A[i,k] = 0 for k > i); 2 A upper (k < i); 3 B lower (B[k,j] = 0 for
//   j > k); 4 B upper (j < k); 5 only C's lower triangle is wanted (C[i,j], j <= i: the rest is
//   written as 0); 6 only C's upper triangle (the rest 0).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <pthread.h>
#include <sched.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// ---- vectors of W floats and their fused multiply-add
#if defined(__AVX512F__)
constexpr int W = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_load_ps(p); }
inline vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_load_ps(p); }
inline vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#else
constexpr int W = 8;
struct vec {
  float x[W];
};
inline vec vzero() { return vec{}; }
inline vec vload(const float* p) {
  vec v;
  std::memcpy(v.x, p, sizeof v.x);
  return v;
}
inline vec vloadu(const float* p) { return vload(p); }
inline vec vset1(float x) {
  vec v;
  for (int l = 0; l < W; ++l) v.x[l] = x;
  return v;
}
inline vec vfma(vec a, vec b, vec c) {
  for (int l = 0; l < W; ++l) c.x[l] = std::fma(a.x[l], b.x[l], c.x[l]);
  return c;
}
inline void vstore(float* p, vec v) { std::memcpy(p, v.x, sizeof v.x); }
#endif

constexpr int MR = W == 16 ? 8 : 4;  // rows of C per micro-tile (2 MR accumulators: 16 of the vector registers)
constexpr int NV = 2;       // vectors per row of a micro-tile
constexpr int NR = NV * W;  // columns of C per micro-tile (and of a packed panel of B)

// C[0:R, 0:V*W] = A[0:R, 0:n] @ P[0:n, :]: A's element (r, k) at q[r * qr + k * qk] (a row
// block of A read where it lies: qr = am, qk = ak; or packed: qr = 1, qk = MR), P a packed panel
// of B (NR floats a k). Full tiles store straight into C (row stride ldc); a partial tile
// (cols < V*W) goes through `tile` and only its first `cols` columns are copied. (The loops over
// r and v are unrolled fully, so that the accumulators stay in registers.)
template <int R, int V>
__attribute__((always_inline)) inline void micro(long n, const float* q, long qr, long qk, const float* p, float* c,
                                                 long ldc, long cols, float* tile) {
  vec acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  const float* row[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = q + r * qr;
  for (long k = 0, at = 0; k < n; ++k, p += NR, at += qk) {
    vec bv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) bv[v] = vload(p + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec x = vset1(row[r][at]);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(x, bv[v], acc[r][v]);
    }
  }
  if (cols == V * W) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) vstore(c + r * ldc + v * W, acc[r][v]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) vstore(tile + v * W, acc[r][v]);
    std::memcpy(c + r * ldc, tile, cols * sizeof(float));
  }
}

template <int V>
inline void micro_rows(int rows, long n, const float* q, long qr, long qk, const float* p, float* c, long ldc,
                       long cols, float* tile) {
  switch (rows) {
    case 8: micro<8, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 7: micro<7, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 6: micro<6, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 5: micro<5, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 4: micro<4, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 3: micro<3, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    case 2: micro<2, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
    default: micro<1, V>(n, q, qr, qk, p, c, ldc, cols, tile); break;
  }
}

#if defined(__AVX2__)
// dst[c * ld + r] = src[r * ls + c] for r, c < 8: an 8 x 8 transpose in registers (24 shuffles
// for 64 values, where a scalar copy takes a load and a store each)
inline void transpose8(const float* src, long ls, float* dst, long ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ls);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
constexpr bool kTranspose8 = true;
#else
inline void transpose8(const float* src, long ls, float* dst, long ld) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) dst[c * ld + r] = src[r * ls + c];
}
constexpr bool kTranspose8 = false;
#endif

// P[0:K, 0:NR] = B[0:K, j0:j0+w], zero beyond w columns (B by element strides bk, bn).
// (Plain loops, not memcpy: for these short rows the compiler's `rep movs` was 70 % of the time.)
inline void pack_b(long K, long j0, long w, const float* b, long bk, long bn, float* p) {
  if (bn == 1) {
    for (long k = 0; k < K; ++k) {
      const float* src = b + k * bk + j0;
      float* dst = p + k * NR;
      if (w == NR) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) vstore(dst + v * W, vloadu(src + v * W));
        continue;
      }
      for (long j = 0; j < w; ++j) dst[j] = src[j];
      for (long j = w; j < NR; ++j) dst[j] = 0.0f;
    }
    return;
  }
  // B transposed (k^T in attention's scores): its columns are contiguous along k; 8 x 8 blocks
  // are transposed in registers, the rest copied one by one
  long j = 0, k8 = kTranspose8 && bk == 1 ? K - K % 8 : 0;
  for (; k8 > 0 && j + 8 <= w; j += 8)
    for (long k = 0; k < k8; k += 8) transpose8(b + (j0 + j) * bn + k, bn, p + k * NR + j, NR);
  for (long jj = 0; jj < NR; ++jj) {
    float* dst = p + jj;
    const long from = jj < j ? k8 : 0;  // columns before j have their first k8 rows already
    if (jj >= w) {
      for (long k = 0; k < K; ++k) dst[k * NR] = 0.0f;
      continue;
    }
    const float* src = b + (j0 + jj) * bn;
    for (long k = from; k < K; ++k) dst[k * NR] = src[k * bk];
  }
}

// Q[k - k0, r] = A[r, k] for r < rows, k0 <= k < k1 (A by element strides am, ak, neither 1):
// the row block read once, from wherever it lies, into the order the micro-kernel reads it. (An
// A with a unit stride is read where it lies, `product`: packing it, 8 x 8 blocks transposed in
// registers, cost 3-5% of attention's products.)
inline void pack_a(int rows, long k0, long k1, const float* a, long am, long ak, float* q) {
  for (int r = 0; r < rows; ++r) {
    const float* src = a + r * am;
    for (long k = k0; k < k1; ++k) q[(k - k0) * MR + r] = src[k * ak];
  }
}

// Ask for the cache line of `p` to come into L2 (`write`: to be written). The empty asm keeps the
// loops around it: GCC deletes a loop whose only effect is a prefetch (C++ loops may be assumed
// to end, and a prefetch has no side effect it must keep), which it did to every prefetch here.
inline void prefetch_line(const float* p, bool write) {
  if (write) __builtin_prefetch(p, 1, 2);
  else __builtin_prefetch(p, 0, 2);
  asm volatile("");
}

// Ask for the rows of A's next row block while this one is computed (it lies in L3 or memory
// after the step's large products; the packing would otherwise wait for each line).
inline void prefetch_a(int rows, long K, const float* a, long am, long ak) {
  const long line = 64 / sizeof(float);
  if (am == 1) {
    for (long k = 0; k < K; ++k) prefetch_line(a + k * ak, false);
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (long k = 0; k < K; k += (ak == 1 ? line : 1)) prefetch_line(a + r * am + k * ak, false);
}

inline void zero_rows(float* c, long ldc, int rows, long cols) {
  if (cols > 0)
    for (int r = 0; r < rows; ++r) std::memset(c + r * ldc, 0, cols * sizeof(float));
}

// One product C = A @ B (M x K by K x N), C with unit column stride. `p`: ceil(N / NR) * K * NR
// floats and `q`: K * MR floats, 64-byte aligned; `tile`: NR floats.
struct Job;
void prefetch_product(const Job& j, long t, long part, long parts);

void product(long M, long N, long K, const float* a, long am, long ak, const float* b, long bk, long bn, float* c,
             long ldc, int tri, float* p, float* q, float* tile, const Job* job, long next) {
  for (long j0 = 0; j0 < N; j0 += NR) pack_b(K, j0, std::min<long>(NR, N - j0), b, bk, bn, p + (j0 / NR) * K * NR);
  for (long i0 = 0; i0 < M; i0 += MR) {
    const int rows = (int)std::min<long>(MR, M - i0);
    // the terms of A this row block needs (a triangular A: one side of its diagonal only)
    const long ka = tri == 2 ? std::min(K, i0) : 0, kb = tri == 1 ? std::min(K, i0 + rows) : K;
    // A with a unit stride (a row's terms, or a term's rows, side by side: attention's operands)
    // is read where it lies; any other A is packed first (MR floats a term)
    const bool direct = am == 1 || ak == 1;
    if (!direct) pack_a(rows, ka, kb, a + i0 * am, am, ak, q);
    if (i0 + MR < M) prefetch_a((int)std::min<long>(MR, M - i0 - MR), K, a + (i0 + MR) * am, am, ak);
    if (job != nullptr && next >= 0) prefetch_product(*job, next, i0 / MR, (M + MR - 1) / MR);
    for (long j0 = 0; j0 < N; j0 += NR) {
      const long w = std::min<long>(NR, N - j0);
      long k0 = ka, k1 = kb, c0 = 0, c1 = w;  // the terms k0..k1 and columns j0+c0..j0+c1 computed
      switch (tri) {
        case 3: k0 = std::min(K, j0); break;
        case 4: k1 = std::min(K, j0 + w); break;
        case 5: c1 = std::clamp(i0 + rows - j0, 0L, w); break;  // columns j <= the tile's last row
        case 6: c0 = std::clamp(i0 - j0, 0L, w); c0 -= c0 % W; break;  // columns j >= its first row
        default: break;
      }
      float* cc = c + i0 * ldc + j0;
      zero_rows(cc, ldc, rows, c0);
      if (c1 > c0) {
        const float* pp = p + (j0 / NR) * K * NR + k0 * NR + c0;
        const float* qq = direct ? a + i0 * am + k0 * ak : q + (k0 - ka) * MR;
        const long qr = direct ? am : 1, qk = direct ? ak : MR;
        const long n = std::max(0L, k1 - k0);
        if (c1 - c0 > W)
          micro_rows<2>(rows, n, qq, qr, qk, pp, cc + c0, ldc, c1 - c0, tile);
        else
          micro_rows<1>(rows, n, qq, qr, qk, pp, cc + c0, ldc, c1 - c0, tile);
      }
      zero_rows(cc + c1, ldc, rows, w - std::max(c0, c1));
    }
  }
}

// ---- the work of one call, shared out product by product
struct Job {
  long nb1, nb2, M, N, K;
  const float* A;
  long a_b1, a_b2, a_m, a_k;
  const float* B;
  long b_b1, b_b2, b_k, b_n;
  float* C;
  long c_b1, c_b2, c_m;
  int tri;
};

struct Scratch {
  float *p = nullptr, *q = nullptr;
  long p_size = 0, q_size = 0;
  alignas(64) float tile[NR];
  ~Scratch() {
    std::free(p);
    std::free(q);
  }
  static float* grow(float*& buf, long& size, long need) {
    if (need > size) {
      std::free(buf);
      size = need;
      buf = static_cast<float*>(std::aligned_alloc(64, ((size * sizeof(float) + 63) / 64) * 64));
    }
    return buf;
  }
};

// Ask for part `part` of `parts` of the rows of a rows x cols matrix (element strides sr, sc) to
// come into L2, line by line (`write`: lines about to be written); of row r only the columns
// [lo(r), hi(r)) (a triangle: its zeros are never read).
template <class Lo, class Hi>
inline void prefetch_matrix(const float* x, long rows, long sr, long sc, bool write, long part, long parts, Lo lo,
                            Hi hi) {
  const long line = 64 / sizeof(float);
  for (long r = rows * part / parts; r < rows * (part + 1) / parts; ++r) {
    if (sc == 1) {
      for (long c = lo(r) - lo(r) % line; c < hi(r); c += line) prefetch_line(x + r * sr + c, write);
    } else if (sr == 1) {  // columns contiguous: a row's values lie in different lines
      for (long c = lo(r); c < hi(r); ++c)
        if ((r % line) == 0 || r == rows * part / parts) prefetch_line(x + r + c * sc, write);
    } else {
      for (long c = lo(r); c < hi(r); ++c) prefetch_line(x + r * sr + c * sc, write);
    }
  }
}

// Ask for part `part` of `parts` of product t's operands and result. A product's data lies in
// L3 or memory when it starts (other work ran in between), and its packing then waited for
// each line: one product on one thread took 0.77 ms for att @ v's 64 back to back, 1.2-1.5 ms
// after anything else, the packing three times as long. So each product, row block by row
// block, asks for the next product's data, a part at a time, the non-zero side of a triangle only.
void prefetch_product(const Job& j, long t, long part, long parts) {
  const long i = t / j.nb2, k = t % j.nb2, K = j.K, N = j.N;
  auto zero = [](long) { return 0L; };
  auto a_lo = [&](long r) { return j.tri == 2 ? std::min(r, K) : 0L; };
  auto a_hi = [&](long r) { return j.tri == 1 ? std::min(r + 1, K) : K; };
  auto b_lo = [&](long r) { return j.tri == 4 ? std::min(r, N) : 0L; };  // B upper: B[k, j] = 0 for j < k
  auto b_hi = [&](long r) { return j.tri == 3 ? std::min(r + 1, N) : N; };  // B lower: 0 for j > k
  prefetch_matrix(j.A + i * j.a_b1 + k * j.a_b2, j.M, j.a_m, j.a_k, false, part, parts, a_lo, a_hi);
  prefetch_matrix(j.B + i * j.b_b1 + k * j.b_b2, K, j.b_k, j.b_n, false, part, parts, b_lo, b_hi);
  prefetch_matrix(j.C + i * j.c_b1 + k * j.c_b2, j.M, j.c_m, 1, true, part, parts, zero, [&](long) { return N; });
}

void run_product(const Job& j, long t, Scratch& s) {
  const long i = t / j.nb2, k = t % j.nb2;
  float* p = Scratch::grow(s.p, s.p_size, ((j.N + NR - 1) / NR) * std::max(j.K, 1L) * NR);
  float* q = Scratch::grow(s.q, s.q_size, std::max(j.K, 1L) * MR);
  product(j.M, j.N, j.K, j.A + i * j.a_b1 + k * j.a_b2, j.a_m, j.a_k, j.B + i * j.b_b1 + k * j.b_b2, j.b_k, j.b_n,
          j.C + i * j.c_b1 + k * j.c_b2, j.c_m, j.tri, p, q, s.tile, &j, t + 1 < j.nb1 * j.nb2 ? t + 1 : -1);
}

void product_of(void* job, long t) {
  static thread_local Scratch scratch;
  run_product(*static_cast<const Job*>(job), t, scratch);
}

}  // namespace

extern "C" {

// Vector width of this build (16: AVX-512, 8: AVX2 or scalar); the bits do not depend on it.
int hs_small_matmul_width() { return W; }

// C[i, j] = A[i, j] @ B[i, j] for i < nb1, j < nb2 (two batch dims), all by element strides;
// C's columns are unit-stride. `threads`: how many threads may share the products.
void hs_small_matmul_f32(long nb1, long nb2, long M, long N, long K, const float* A, long a_b1, long a_b2,
                         long a_m, long a_k, const float* B, long b_b1, long b_b2, long b_k, long b_n, float* C,
                         long c_b1, long c_b2, long c_m, int tri, int threads) {
  Job job{nb1, nb2, M, N, K, A, a_b1, a_b2, a_m, a_k, B, b_b1, b_b2, b_k, b_n, C, c_b1, c_b2, c_m, tri};
  hs_parallel_for(nb1 * nb2, product_of, &job, threads);
}
}
