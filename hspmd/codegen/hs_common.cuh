// hspmd kernel library: block reductions and math helpers written once in CUDA C.
// Included after the target's portability layer: cuda_preamble.cuh (NVRTC / CuPy) or
// cuda_emu.h (host C++ compiler, OpenMP). It has no include guard on purpose: the CPU
// build includes it twice, once per block-emulation namespace (serial and team).

// ---- a piece of a multi-tensor kernel (transforms/multi_tensor.py): an elementwise body run
// over the items [hs_piece_lo, min(n, hs_piece_hi)) by steps of hs_piece_step (one block's chunk)
#define HS_FOR_PIECE(i, n) \
  for (long i = hs_piece_lo; i < ((long)(n) < hs_piece_hi ? (long)(n) : hs_piece_hi); i += hs_piece_step)

// ---- block reductions: every thread of the block must call them (uniform control flow)
// Warp-level steps add a lane's partner only if it lies within the `width` live lanes of the
// warp, so a last, partial warp (blockDim not a multiple of 32) reduces correctly.
template <class T> __device__ __forceinline__ T hs_warp_sum(T v, int width) {
  const int lane = threadIdx.x % 32;
  for (int d = 16; d > 0; d >>= 1) {
    T o = __shfl_down_sync(0xffffffffu, v, d);
    if (lane + d < width) v += o;
  }
  return v;
}
template <class T> __device__ __forceinline__ T hs_warp_max(T v, int width) {
  const int lane = threadIdx.x % 32;
  for (int d = 16; d > 0; d >>= 1) {
    T o = __shfl_down_sync(0xffffffffu, v, d);
    if (lane + d < width && (o > v || o != o)) v = o;
  }
  return v;
}

// Sum of `v` over the block's threads, returned to every thread.
template <class T> __device__ T hs_block_sum(T v) {
#ifdef HS_SERIAL_BLOCK
  return v;
#else
  __shared__ T hs_part[32];
  __shared__ T hs_total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  const int live = (int)blockDim.x - warp * 32;
  v = hs_warp_sum(v, live < 32 ? live : 32);
  if (lane == 0) hs_part[warp] = v;
  __syncthreads();
  T w = ((int)threadIdx.x < nwarps) ? hs_part[threadIdx.x] : T(0);
  w = hs_warp_sum(w, nwarps);  // all threads take part, so shuffles stay uniform; lane 0 of warp 0 has the sum
  if (threadIdx.x == 0) hs_total = w;
  __syncthreads();
  T r = hs_total;
  __syncthreads();
  return r;
#endif
}

// Maximum of `v` over the block's threads (NaN wins), returned to every thread.
template <class T> __device__ T hs_block_max(T v) {
#ifdef HS_SERIAL_BLOCK
  return v;
#else
  __shared__ T hs_mpart[32];
  __shared__ T hs_mtotal;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  const int live = (int)blockDim.x - warp * 32;
  v = hs_warp_max(v, live < 32 ? live : 32);
  if (lane == 0) hs_mpart[warp] = v;
  __syncthreads();
  T w = ((int)threadIdx.x < nwarps) ? hs_mpart[threadIdx.x] : -HS_INF;
  w = hs_warp_max(w, nwarps);
  if (threadIdx.x == 0) hs_mtotal = w;
  __syncthreads();
  T r = hs_mtotal;
  __syncthreads();
  return r;
#endif
}

// ---- math: one name per function and type; the CPU layer may give vectorisable versions
__device__ __forceinline__ float hs_exp(float x) { return HS_EXPF(x); }
__device__ __forceinline__ double hs_exp(double x) { return exp(x); }
__device__ __forceinline__ float hs_tanh(float x) { return HS_TANHF(x); }
__device__ __forceinline__ double hs_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float hs_log(float x) { return logf(x); }
__device__ __forceinline__ double hs_log(double x) { return log(x); }
__device__ __forceinline__ float hs_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double hs_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float hs_erf(float x) { return erff(x); }
__device__ __forceinline__ double hs_erf(double x) { return erf(x); }
__device__ __forceinline__ float hs_pow(float x, float p) { return powf(x, p); }
__device__ __forceinline__ double hs_pow(double x, double p) { return pow(x, p); }
// the elementary functions of graph's `elementary` family (`dialects/graph/elementary.py`)
#ifndef HS_MATH1
#define HS_MATH1(name, fn) \
  __device__ __forceinline__ float hs_##name(float x) { return fn##f(x); } \
  __device__ __forceinline__ double hs_##name(double x) { return fn(x); }
#endif
HS_MATH1(sin, sin) HS_MATH1(cos, cos) HS_MATH1(tan, tan) HS_MATH1(asin, asin) HS_MATH1(acos, acos)
HS_MATH1(atan, atan) HS_MATH1(sinh, sinh) HS_MATH1(cosh, cosh) HS_MATH1(asinh, asinh) HS_MATH1(acosh, acosh)
HS_MATH1(atanh, atanh) HS_MATH1(abs, fabs) HS_MATH1(floor, floor) HS_MATH1(ceil, ceil) HS_MATH1(rint, rint)
HS_MATH1(trunc, trunc) HS_MATH1(log1p, log1p) HS_MATH1(expm1, expm1) HS_MATH1(log2, log2) HS_MATH1(log10, log10)
__device__ __forceinline__ float hs_atan2(float y, float x) { return atan2f(y, x); }
__device__ __forceinline__ double hs_atan2(double y, double x) { return atan2(y, x); }
// max(a, b) that propagates NaN like NumPy's maximum
template <class T> __device__ __forceinline__ T hs_max(T a, T b) { return (a > b || a != a) ? a : b; }
// NumPy's overflow-free logistic function
template <class T> __device__ __forceinline__ T hs_sigmoid(T x) {
  T e = hs_exp(x >= T(0) ? -x : x);
  return x >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
}
// ---- micro-tile products (flash attention's p v, ds k, pd^T dO and ds^T q from its tiles)
// acc[r][c] += sum over k < n of a[r * ar + k * ak] * b[k * bk + c], k in order: each value
// read serves R or C products. `a` and `b` are float tiles (shared memory on a GPU).
template <int R, int C>
__device__ __forceinline__ void hs_tile_madd(float (&acc)[R][C], const float* a, int ar, int ak, const float* b,
                                             int bk, int n) {
  for (int k = 0; k < n; ++k) {
    float av[R], bv[C];
    for (int r = 0; r < R; ++r) av[r] = a[r * ar + k * ak];
    for (int c = 0; c < C; ++c) bv[c] = b[k * bk + c];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] += av[r] * bv[c];
  }
}

// ---- counter-based random numbers: graph.dropout's (positions.py has the NumPy side)
// the splitmix64 finaliser, a bijection of 64-bit words with good avalanche
__device__ __forceinline__ unsigned long long hs_mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
// the key of (seed, salt, step), then the uniform in [0, 1) (53 bits) of element `index`
__device__ __forceinline__ unsigned long long hs_dropout_key(unsigned long long seed, unsigned long long salt,
                                                             unsigned long long step) {
  const unsigned long long golden = 0x9E3779B97F4A7C15ULL;
  unsigned long long k = hs_mix64(seed + golden) ^ salt;
  k = hs_mix64(k + golden) ^ step;
  return hs_mix64(k + golden);
}
__device__ __forceinline__ double hs_dropout_uniform(unsigned long long key, unsigned long long index) {
  return (double)(hs_mix64(key + (index + 1ULL) * 0x9E3779B97F4A7C15ULL) >> 11) * (1.0 / 9007199254740992.0);
}
