// hspmd: a chain of batched steps run by slices of its batch (causal attention's products and softmax).
//
// `hs_chain_run(entries, per_slice, desc, ndesc, threads)` runs every step of a chain on
// entries [lo, hi) of the batch's leading dim, then the next slice, the slices spread over
// `threads` threads (hs_parallel_for): one thread runs all the steps of its slice, so that the
// slice's intermediates (scores, probabilities) stay in that core's caches between the step
// that writes them and the next one that reads them. A step inside a slice runs on that thread
// alone (the parallel loop runs a nested call's items in order). See runtime/cpu/batch_chain.py.
//
// `desc` holds `ndesc` longs: the steps one after the other, each a kind then its fields:
//   0, a batch of small products (small_matmul.cpp's Job, its first batch dim the chain's):
//      nb2, M, N, K, A, a_b1, a_b2, a_m, a_k, B, b_b1, b_b2, b_k, b_n, C, c_b1, c_b2, c_m, tri
//   1, a row launch of a fused kernel (cpu_compile.py's `hs_launch_*`):
//      launch, rows per entry, cols, nptr, then nptr pairs (base address, bytes per entry)
// Each entry is computed by the same code, in the same order, as in one whole call: the same bits.
#include <algorithm>
#include <vector>

namespace {

typedef void (*hs_launch_fn)(void** args, long n0, long n1, int team);

struct ChainStep {
  int kind = 0;
  Job job{};  // kind 0
  hs_launch_fn launch = nullptr;  // kind 1
  long rows = 0, cols = 0;
  std::vector<char*> bases;
  std::vector<long> strides;
};

struct Chain {
  long entries, per_slice;
  std::vector<ChainStep> steps;
};

void run_slice(void* ctx, long s) {
  const Chain& c = *static_cast<const Chain*>(ctx);
  const long lo = s * c.per_slice, hi = std::min(c.entries, lo + c.per_slice);
  std::vector<void*> ptrs;
  for (const ChainStep& st : c.steps) {
    if (st.kind == 0) {
      Job j = st.job;
      j.nb1 = hi - lo;
      j.A += lo * j.a_b1;
      j.B += lo * j.b_b1;
      j.C += lo * j.c_b1;
      for (long t = 0; t < j.nb1 * j.nb2; ++t) product_of(&j, t);
    } else {
      ptrs.resize(st.bases.size());
      for (size_t k = 0; k < st.bases.size(); ++k) ptrs[k] = st.bases[k] + lo * st.strides[k];
      st.launch(ptrs.data(), st.rows * (hi - lo), st.cols, 1);
    }
  }
}

}  // namespace

extern "C" {

// Run the chain `desc` (see the top of this file) on `entries` entries, `per_slice` at a time;
// returns 0, or -1 (nothing run) for a malformed description.
int hs_chain_run(long entries, long per_slice, const long* desc, long ndesc, int threads) {
  Chain c{entries, std::max(1L, per_slice), {}};
  long at = 0;
  while (at < ndesc) {
    ChainStep st;
    st.kind = (int)desc[at++];
    if (st.kind == 0) {
      if (at + 19 > ndesc) return -1;
      const long* d = desc + at;
      st.job = Job{0, d[0], d[1], d[2], d[3], reinterpret_cast<const float*>(d[4]), d[5], d[6], d[7], d[8],
                   reinterpret_cast<const float*>(d[9]), d[10], d[11], d[12], d[13], reinterpret_cast<float*>(d[14]),
                   d[15], d[16], d[17], (int)d[18]};
      at += 19;
    } else if (st.kind == 1) {
      if (at + 4 > ndesc) return -1;
      st.launch = reinterpret_cast<hs_launch_fn>(desc[at]);
      st.rows = desc[at + 1];
      st.cols = desc[at + 2];
      const long nptr = desc[at + 3];
      at += 4;
      if (nptr < 0 || at + 2 * nptr > ndesc) return -1;
      for (long k = 0; k < nptr; ++k) {
        st.bases.push_back(reinterpret_cast<char*>(desc[at + 2 * k]));
        st.strides.push_back(desc[at + 2 * k + 1]);
      }
      at += 2 * nptr;
    } else {
      return -1;
    }
    c.steps.push_back(std::move(st));
  }
  hs_parallel_for((entries + c.per_slice - 1) / c.per_slice, run_slice, &c, threads);
  return 0;
}
}
