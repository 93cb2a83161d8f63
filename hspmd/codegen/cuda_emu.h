// hspmd portability layer for the host C++ compiler: runs the kernels' CUDA C on CPU cores.
//
// A launch runs a kernel's blocks under OpenMP. Two block emulations are compiled from the
// same source (see cpu_compile.py, which wraps each in a namespace):
//  * serial (HS_SERIAL_BLOCK): blockDim = 1, threadIdx = 0 are compile-time constants, so the
//    column loops of a row kernel become plain unit-stride loops the compiler vectorises, the
//    block reductions return their argument, and blocks (rows) run in an `omp parallel for`;
//  * team: one OpenMP team of blockDim.x threads per block, threadIdx.x = the team rank,
//    __shared__ variables are `static` (one block runs at a time), __syncthreads() is an
//    OpenMP barrier and warp shuffles are exchanges through a shared buffer between two
//    barriers. Slow, but it runs the GPU algorithm as written (tests use it for blockDim > 1).
// Elementwise kernels use HS_FOR, which here is an OpenMP worksharing `for simd` over all n
// items, so the threads of the enclosing `omp parallel` each take one contiguous chunk.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>

#define HS_CPU 1
#define HS_KERNEL static
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define HS_INF (__builtin_huge_valf())
#define HS_NAN (__builtin_nanf(""))
#define HS_PRAGMA(x) _Pragma(#x)
// (the OpenMP forms are the team emulation's; the serial one's launches run chunks, see below)
#define HS_FOR_OMP(i, n) HS_PRAGMA(omp for simd schedule(static)) for (long i = 0; i < (long)(n); ++i)
#define HS_FOR(i, n) HS_FOR_OMP(i, n)
#define HS_ROWS(r, n) for (long r = blockIdx.x; r < (long)(n); r += gridDim.x)
#define HS_COLS(j, n) for (long j = threadIdx.x; j < (long)(n); j += blockDim.x)
#define HS_COLS_SIMD(j, n) HS_PRAGMA(omp simd) HS_COLS(j, n)
#define HS_COLS_SUM(j, n, v) HS_PRAGMA(omp simd reduction(+ : v)) HS_COLS(j, n)
#define HS_COLS_MAX(j, n, v) HS_PRAGMA(omp simd reduction(max : v)) HS_COLS(j, n)
// column sums: each OpenMP thread of the enclosing parallel region owns a contiguous range
#define HS_COLUMN_RANGE_OMP(c0, c1, n)                                                          \
  for (long c0 = (long)(n) * omp_get_thread_num() / omp_get_num_threads(),                     \
            c1 = (long)(n) * (omp_get_thread_num() + 1) / omp_get_num_threads(), hs_once_ = 1; \
       hs_once_; hs_once_ = 0)
#define HS_COLUMN_RANGE(c0, c1, n) HS_COLUMN_RANGE_OMP(c0, c1, n)
// the serial emulation's forms: the launch's chunk (hs_emu::chunk_lo/hi) of the items, rows or columns
#define HS_FOR_CHUNK(i, n) HS_PRAGMA(omp simd) for (long i = hs_emu::chunk_lo(n); i < hs_emu::chunk_hi(n); ++i)
#define HS_ROWS_CHUNK(r, n) for (long r = hs_emu::chunk_lo(n); r < hs_emu::chunk_hi(n); ++r)
#define HS_COLUMN_RANGE_CHUNK(c0, c1, n) \
  for (long c0 = hs_emu::chunk_lo(n), c1 = hs_emu::chunk_hi(n), hs_once_ = 1; hs_once_; hs_once_ = 0)
#define HS_SIMD HS_PRAGMA(omp simd)
// the columns of a row that a loop must visit: the first n rounded up to 16 (whole vectors, so
// that the loop needs no scalar remainder), at most cols
#define HS_LIVE_COLS(n, cols) ((((n) + 15L) & ~15L) < (long)(cols) ? (((n) + 15L) & ~15L) : (long)(cols))
#define HS_EXPF(x) hs_cpu_expf(x)
#define HS_TANHF(x) hs_cpu_tanhf(x)

// a float's bits and back (hs_common.cuh's 16-bit float storage types are written with them)
static inline unsigned hs_float_bits(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
static inline float hs_bits_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

struct hs_dim3 {
  unsigned x, y, z;
};
static const int warpSize = 32;

namespace hs_emu {
// the block being run by this OS thread (both emulations) and, in a team, the thread's place
inline thread_local hs_dim3 blockIdx{0, 0, 0}, gridDim{1, 1, 1}, threadIdx{0, 0, 0}, blockDim{1, 1, 1};

// The serial emulation cuts a large launch into `chunks` chunks of its items (HS_FOR), rows
// (HS_ROWS) or columns (HS_COLUMN_RANGE), chunk c being [chunk_lo(n), chunk_hi(n)) (bounds on
// multiples of 16, whole vectors), and runs them through the runtime's parallel loop (`parallel`,
// set by hs_set_parallel: hspmd/runtime/native/parallel.cpp). Every item, row or column is
// computed as in one call, by one thread: the bits do not depend on the chunks or threads.
inline thread_local long chunk = 0, chunks = 1;
inline long chunk_lo(long n) { return chunk == 0 ? 0 : (n * chunk / chunks) & ~15L; }
inline long chunk_hi(long n) { return chunk == chunks - 1 ? n : (n * (chunk + 1) / chunks) & ~15L; }
typedef void (*item_fn)(void* ctx, long item);
typedef void (*parallel_fn)(long n, item_fn fn, void* ctx, int threads);
// the runtime's parallel loop, handed over once when the library is loaded (none: chunks run in turn)
inline parallel_fn parallel = nullptr;

// One launch of a kernel in the serial emulation: `kernel` calls it on (a, n0, n1).
struct launch {
  void (*kernel)(void **a, long n0, long n1);
  void **a;
  long n0, n1, chunks;
};

inline void run_chunk(void *p, long c) {
  const launch *l = static_cast<const launch *>(p);
  blockIdx = {0, 0, 0};
  gridDim = {1, 1, 1};
  chunk = c;
  chunks = l->chunks;
  l->kernel(l->a, l->n0, l->n1);
}

// Run launch `l` of `units` rows (or vectors of items, or columns) and `work` elements: one
// chunk for small work (or without the runtime's loop), else up to 4 per thread.
#ifndef HS_PARALLEL_MIN_WORK
#define HS_PARALLEL_MIN_WORK 16384
#endif
inline void run_chunks(launch l, long units, long work) {
  const int threads = parallel != nullptr ? omp_get_max_threads() : 1;
  long n = threads > 1 && work > HS_PARALLEL_MIN_WORK ? (units < 4L * threads ? units : 4L * threads) : 1;
  l.chunks = n < 1 ? 1 : n;
  if (l.chunks == 1) {
    run_chunk(&l, 0);
    return;
  }
  parallel(l.chunks, run_chunk, &l, threads);
}
}  // namespace hs_emu

// a * b + c: one fused multiply-add where the CPU has it (used inside hs_cpu_expf/tanhf
// only, whose error bound already allows it; the kernels' own arithmetic is never contracted)
#ifdef __FMA__
#define HS_FMAF(a, b, c) __builtin_fmaf(a, b, c)
#else
#define HS_FMAF(a, b, c) ((a) * (b) + (c))
#endif

// exp for float without a library call, so `omp simd` loops vectorise: exp(x) = 2^k exp(r),
// r = x - k ln2 (Cody-Waite split), exp(r) by its degree-7 Taylor polynomial (|r| <= 0.347),
// 2^k through the exponent field. Within 2 ulp of the correctly rounded result for
// x >= -86.6; below (results under 2.5e-38, at the edge of the subnormals) it returns 0.
static inline float hs_cpu_expf(float x) {
  float xc = x > -86.6f ? x : -86.6f;  // maxps / minps exactly (NaN gives the bound; see the end)
  xc = xc < 88.8f ? xc : 88.8f;
  float kf = HS_FMAF(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  float r = HS_FMAF(kf, -0.693359375f, xc);
  r = HS_FMAF(kf, 2.12194440e-4f, r);
  float p = 1.0f / 5040.0f;
  p = HS_FMAF(p, r, 1.0f / 720.0f);
  p = HS_FMAF(p, r, 1.0f / 120.0f);
  p = HS_FMAF(p, r, 1.0f / 24.0f);
  p = HS_FMAF(p, r, 1.0f / 6.0f);
  p = HS_FMAF(p, r, 0.5f);
  p = HS_FMAF(p, r, 1.0f);
  p = HS_FMAF(p, r, 1.0f);
  // k in [-125, 128]: 2^(k-1) is a normal float, and p * 2 * 2^(k-1) rounds once (or overflows)
  int32_t bits = ((int32_t)kf + 126) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  float y = (p * 2.0f) * s;
  y = x < -86.6f ? 0.0f : y;
  return x != x ? x : y;
}

// tanh for float, vectorisable: an odd Taylor polynomial up to x^17 for |x| < 0.55, else
// sign(x) (1 - 2 / (exp(2|x|) + 1)) (no cancellation there: the result is >= 0.5).
static inline float hs_cpu_tanhf(float x) {
  float a = x < 0.0f ? -x : x;
  float z = x * x;
  float p = 6404582.0f / 10854718875.0f;
  p = HS_FMAF(p, -z, 929569.0f / 638512875.0f);
  p = HS_FMAF(p, -z, 21844.0f / 6081075.0f);
  p = HS_FMAF(p, -z, 1382.0f / 155925.0f);
  p = HS_FMAF(p, -z, 62.0f / 2835.0f);
  p = HS_FMAF(p, -z, 17.0f / 315.0f);
  p = HS_FMAF(p, -z, 2.0f / 15.0f);
  p = HS_FMAF(p, -z, 1.0f / 3.0f);
  float small = x - x * z * p;
  float e = hs_cpu_expf(2.0f * (a > 20.0f ? 20.0f : a));
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = x < 0.0f ? -big : big;
  float y = a < 0.55f ? small : big;
  return x != x ? x : y;
}

// team emulation of a warp shuffle: lanes are groups of 32 consecutive team threads
template <class T> static inline T hs_team_shfl_down(T v, int delta) {
  static T hs_lanes[1024];
  const int t = (int)hs_emu::threadIdx.x;
  hs_lanes[t] = v;
#pragma omp barrier
  const int src = t + delta;
  T r = ((t % 32) + delta < 32 && src < (int)hs_emu::blockDim.x) ? hs_lanes[src] : v;
#pragma omp barrier
  return r;
}
