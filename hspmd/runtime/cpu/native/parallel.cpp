// hspmd: a parallel loop for the CPU kernels that never waits for a thread that has not started.
//
// `hs_parallel_for(n, fn, ctx, threads)` runs fn(ctx, 0) ... fn(ctx, n - 1), each exactly once,
// on the calling thread and up to threads - 1 helper threads. Items are taken one at a time
// from a shared counter. The caller takes items too and, once none is left, waits only for
// the items a helper has already started: a helper that has not woken up yet (the machine busy
// with other work, the helper's CPU taken) holds nobody up, where an OpenMP team waits at its
// closing barrier for every thread (on this 2-core machine shared with other work, a 2-thread
// team was often slower than one thread). The counter holds the call's generation in its high
// 32 bits, so a helper waking late cannot take an item of a later call for one of its own.
//
// Used by the small batched products (small_matmul.cpp, in the same library), the batch chains
// (chain.cpp) and, through a function pointer handed to each program's kernel library
// (`hs_set_parallel`, see hspmd/codegen/cpu_compile.py), by the fused kernels: rows and
// elements in chunks.
//
// Linux wakes a sleeping thread on the CPU of the thread that wakes it when it can; a woken
// helper then took the caller's CPU and did every item while the caller waited for that CPU
// (measured: all 64 products of a call by one thread in half the calls). So the helpers are kept
// off the caller's CPU, re-pinned when the caller has moved.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>
#include <pthread.h>
#include <sched.h>

namespace {

typedef void (*hs_item_fn)(void* ctx, long item);

// set while this thread runs a call's items: a parallel loop inside an item (a fused kernel
// launched by a chain's slice, chain.cpp) runs on this thread alone
thread_local bool t_in_items = false;

struct InItems {
  bool was = t_in_items;
  InItems() { t_in_items = true; }
  ~InItems() { t_in_items = was; }
};

class Pool {
 public:
  // Run the items; false (nothing run) if another thread's call holds the helpers.
  bool run(long total, hs_item_fn fn, void* ctx, int threads) {
    std::unique_lock<std::mutex> call(calls_, std::try_to_lock);
    if (!call.owns_lock()) return false;
    const uint32_t gen = publish(total, fn, ctx, threads - 1);
    long mine = 0;
    {
      InItems inside;
      for (long t; (t = claim(gen, total)) >= 0; ++mine) fn(ctx, t);
    }
    // the items the helpers took: wait for them to finish (they are under way, so this is short)
    while (done_.load(std::memory_order_acquire) != total - mine) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = nullptr;
    return true;
  }

 private:
  long claim(uint32_t gen, long total) {
    uint64_t v = next_.load(std::memory_order_relaxed);
    for (;;) {
      if ((uint32_t)(v >> 32) != gen || (long)(v & 0xffffffffu) >= total) return -1;
      if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return (long)(v & 0xffffffffu);
    }
  }

  uint32_t publish(long total, hs_item_fn fn, void* ctx, int helpers) {
    std::lock_guard<std::mutex> lock(mu_);
    while ((int)threads_.size() < helpers) {
      const int index = (int)threads_.size();
      std::thread t([this, index] { helper(index); });
      threads_.push_back(t.native_handle());
      t.detach();  // it sleeps between calls and lives as long as the process
      avoid_ = -1;
    }
    keep_off(sched_cpu());
    if (++generation_ == 0) generation_ = 1;  // 0 is the state before any call
    fn_ = fn;
    ctx_ = ctx;
    total_ = total;
    helpers_ = helpers;
    done_.store(0, std::memory_order_relaxed);
    next_.store((uint64_t)generation_ << 32, std::memory_order_release);
    wake_.notify_all();
    return generation_;
  }

  static int sched_cpu() {
#ifdef __linux__
    return sched_getcpu();
#else
    return -1;
#endif
  }

  // Pin the helpers to every CPU this process may use but `cpu` (nothing where that leaves none).
  void keep_off(int cpu) {
#ifdef __linux__
    if (cpu < 0 || cpu == avoid_) return;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2)
      return;
    CPU_CLR(cpu, &allowed);
    for (pthread_t t : threads_) pthread_setaffinity_np(t, sizeof allowed, &allowed);
    avoid_ = cpu;
#else
    (void)cpu;
#endif
  }

  void helper(int index) {
    uint32_t seen = 0;
    for (;;) {
      hs_item_fn fn;
      void* ctx;
      long total;
      uint32_t gen;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return fn_ != nullptr && generation_ != seen && index < helpers_; });
        seen = gen = generation_;
        fn = fn_;  // ctx is the caller's: used only for an item claimed, which the caller waits for
        ctx = ctx_;
        total = total_;
      }
      InItems inside;
      for (long t; (t = claim(gen, total)) >= 0;) {
        fn(ctx, t);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  std::mutex calls_;  // one call at a time shares the helpers
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<pthread_t> threads_;  // the helpers (detached)
  int avoid_ = -1;                  // the CPU the helpers are kept off
  int helpers_ = 0;                 // how many helpers the current call may use
  hs_item_fn fn_ = nullptr;
  void* ctx_ = nullptr;
  long total_ = 0;
  uint32_t generation_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<long> done_{0};
};

Pool& pool() {
  // one pool per process, made on first use; its threads live as long as the process
  static Pool* p = new Pool();
  return *p;
}

}  // namespace

extern "C" {

// Run fn(ctx, i) for 0 <= i < n on up to `threads` threads (this one included); every item is
// done when it returns. With one thread or item, inside another call's item, or while another
// thread's call holds the helpers, the items run here, in order.
void hs_parallel_for(long n, hs_item_fn fn, void* ctx, int threads) {
  if (threads > 1 && n > 1 && !t_in_items && pool().run(n, fn, ctx, threads)) return;
  for (long t = 0; t < n; ++t) fn(ctx, t);
}
}
