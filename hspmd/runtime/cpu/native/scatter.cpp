// hspmd: adding rows into a table at given indices, in order (the embedding's gradient).
//
// out[index[i], :] += rows[i, :] for i = 0, 1, ... in that order: each element of `out` gets its
// rows added one by one in the order of i, which is what np.add.at(out, index, rows) computes,
// so the bits are NumPy's (tested against it). One pass over the rows, vectorised along a row,
// where NumPy's scatter (numpy_ops.scatter_add_rows) sorted the indices and made several passes.
// Indices are checked: one out of [0, n_out) stops the call and is returned (-1 when all fit).
#include <cstdint>

namespace {

template <class T, class I>
long scatter_add_rows(T* out, long n_out, const I* index, long n, const T* rows, long cols) {
  for (long i = 0; i < n; ++i)
    if (index[i] < 0 || (long)index[i] >= n_out) return i;
  for (long i = 0; i < n; ++i) {
    T* dst = out + (long)index[i] * cols;
    const T* src = rows + i * cols;
#pragma omp simd
    for (long j = 0; j < cols; ++j) dst[j] += src[j];
  }
  return -1;
}

}  // namespace

extern "C" {

// `dtype`: 0 float32, 1 float64; `itype`: 0 int32, 1 int64. Returns -1, or the position of the
// first index out of range (nothing added then).
long hs_scatter_add_rows(void* out, long n_out, const void* index, long n, const void* rows, long cols, int dtype,
                         int itype) {
  if (dtype == 0)
    return itype == 0 ? scatter_add_rows((float*)out, n_out, (const int32_t*)index, n, (const float*)rows, cols)
                      : scatter_add_rows((float*)out, n_out, (const int64_t*)index, n, (const float*)rows, cols);
  return itype == 0 ? scatter_add_rows((double*)out, n_out, (const int32_t*)index, n, (const double*)rows, cols)
                    : scatter_add_rows((double*)out, n_out, (const int64_t*)index, n, (const double*)rows, cols);
}
}
