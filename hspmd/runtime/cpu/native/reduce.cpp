// hspmd: the sum of squares of a gradient in float64 (gradient clipping's norm), in one pass.
//
// NumPy's kernel converted the float32 gradient to a float64 copy and took BLAS's dot product of
// it with itself: for GPT-tiny's stacked weights (1M values) 1.1 - 2 ms a call, the copy
// dominating. Here each value is squared and added in float64 as it is read. The order of the
// additions is fixed, whatever the threads: blocks of `kBlock` values, each summed in 8 lanes
// (value i into lane i % 8, in order), the lanes added as ((0+1)+(2+3))+((4+5)+(6+7)), then the
// blocks' sums added in block order. (It is not BLAS's order: the last bits of the sum differ
// from NumPy's, within float64's rounding of a sum of n terms.)
#include <cstdint>
#include <vector>
#include <omp.h>

namespace {

constexpr long kBlock = 4096;

template <class T>
double block_sum(const T* x, long n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  long i = 0;
  for (; i + 8 <= n; i += 8)
#pragma omp simd
    for (int l = 0; l < 8; ++l) acc[l] += (double)x[i + l] * (double)x[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += (double)x[i] * (double)x[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <class T>
struct SumSquares {
  const T* x;
  long n, blocks_per_item;
  double* partial;
};

template <class T>
void sum_item(void* ctx, long item) {
  auto* s = static_cast<SumSquares<T>*>(ctx);
  const long nb = (s->n + kBlock - 1) / kBlock;
  for (long b = item * s->blocks_per_item; b < (item + 1) * s->blocks_per_item && b < nb; ++b) {
    const long start = b * kBlock, len = s->n - start < kBlock ? s->n - start : kBlock;
    s->partial[b] = block_sum(s->x + start, len);
  }
}

template <class T>
double sum_squares(const T* x, long n, int threads) {
  const long nb = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(nb > 0 ? nb : 1, 0.0);
  const long items = nb < 8L * threads ? nb : 8L * threads;
  SumSquares<T> s{x, n, items > 0 ? (nb + items - 1) / items : 1, partial.data()};
  hs_parallel_for(items, sum_item<T>, &s, threads);
  double total = 0.0;
  for (long b = 0; b < nb; ++b) total += partial[b];
  return total;
}

}  // namespace

extern "C" {

// The sum of x[i]^2 over n values of `dtype` (0 float32, 1 float64), in float64, the order of
// its additions fixed (see above); on up to `threads` threads (0: as many as the fused kernels,
// `omp_get_max_threads()`).
double hs_sum_squares(const void* x, long n, int dtype, int threads) {
  if (threads <= 0) threads = omp_get_max_threads();
  return dtype == 0 ? sum_squares((const float*)x, n, threads) : sum_squares((const double*)x, n, threads);
}
}
