// hspmd portability layer for NVRTC / CuPy (the GPU side of one kernel source).
#define HS_KERNEL extern "C" __global__
#define HS_INF __int_as_float(0x7f800000)
#define HS_NAN __int_as_float(0x7fffffff)
#define HS_EXPF(x) expf(x)
#define HS_TANHF(x) tanhf(x)
// elementwise loop: a grid-stride loop over n items
#define HS_FOR(i, n) for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)(n); i += (long)gridDim.x * blockDim.x)
// rows: a block per row, grid-stride over rows; columns: the block's threads stride over them
#define HS_ROWS(r, n) for (long r = blockIdx.x; r < (long)(n); r += gridDim.x)
#define HS_COLS(j, n) for (long j = threadIdx.x; j < (long)(n); j += blockDim.x)
// reductions inside one thread's column loop: nothing to say to the GPU compiler
#define HS_COLS_SUM(j, n, v) HS_COLS(j, n)
#define HS_COLS_MAX(j, n, v) HS_COLS(j, n)
#define HS_COLS_SIMD(j, n) HS_COLS(j, n)
// column sums: each thread owns the columns [c0, c1): here one column, grid-stride
#define HS_COLUMN_RANGE(c0, c1, n) \
  for (long c0 = (long)blockIdx.x * blockDim.x + threadIdx.x, c1 = c0 + 1; c0 < (long)(n); \
       c0 += (long)gridDim.x * blockDim.x, c1 = c0 + 1)
#define HS_SIMD
// the columns of a row that a loop must visit: the first n (a causal softmax's unmasked ones)
#define HS_LIVE_COLS(n, cols) ((n) < (cols) ? (n) : (cols))
// a float's bits and back (hs_common.cuh's 16-bit float storage types are written with them)
#define hs_float_bits(x) __float_as_uint(x)
#define hs_bits_float(u) __uint_as_float(u)
typedef int int32_t;
typedef long long int64_t;
typedef short int16_t;
typedef signed char int8_t;
