// Shared by Pantheon's native CPU kernels (one shared library; see build.py): 8-wide vectors, and
// a parallel loop on XLA's intra-op thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "Pantheon's native kernels are written for x86 AVX2 (with FMA and F16C); elsewhere the jnp paths run"
#endif

#include "xla/ffi/api/ffi.h"

namespace pantheon {

namespace ffi = xla::ffi;

// 8-wide vectors: AVX2, which every x86 server of the last decade has (AVX-512 ones included; a
// 16-wide type is 10x slower on AVX2, where GCC splits it badly).
typedef float v8f __attribute__((vector_size(32)));

// a * b + c. Built with -ffp-contract=off, so the compiler never fuses on its own: every fused
// multiply-add is this one, and a row's arithmetic is the same in every tile shape and batch.
inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v8f v) {  // a fixed tree: ((0+4)+(2+6)) + ((1+5)+(3+7))
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline int64_t pool_threads(ffi::ThreadPool& pool) { return pool.num_threads() > 0 ? pool.num_threads() : 1; }

// One parallel loop: items [0, n) in chunks of `chunk`, taken from one counter by every thread
// that runs it.
struct ParallelLoop {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0, chunk = 1, chunks = 0;
  const std::function<void(int64_t, int64_t)>* body = nullptr;
  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      const int64_t i0 = c * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
      (*body)(i0, i1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Helper threads of the kernels' own that spin a while after each loop before they sleep. A decode
// step is ~100 kernel calls a few tens of microseconds apart; a pool thread woken for each
// (XLA's, through Schedule) started 32 us late on average in a 1 B-shape step on this 2-core VM, a
// third of a small product's time, with this thread working alone meanwhile. These take the next
// loop within a microsecond while the step runs, and sleep once it is over (kSpinNs without a
// loop). One loop at a time holds them; a concurrent one (another model's thread) uses the pool.
class Helpers {
 public:
  static constexpr int64_t kSpinNs = 200000;

  static Helpers& get(int64_t count) {
    static Helpers* helpers = new Helpers(count);  // never destroyed: its threads sleep at exit
    return *helpers;
  }

  // Runs `loop` here and on the helpers; false, having run nothing, while another loop holds them.
  bool run(ParallelLoop& loop) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    loop_.store(&loop);
    epoch_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    loop.run();
    for (int spins = 0; loop.done.load(std::memory_order_acquire) < loop.chunks; ++spins) pause(spins);
    // A helper that read `loop` counts itself in active_ first (all seq_cst): once the pointer is
    // cleared and active_ reads 0, none touches this stack frame's loop again.
    loop_.store(nullptr);
    for (int spins = 0; active_.load() > 0; ++spins) pause(spins);
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  explicit Helpers(int64_t count) {
    for (int64_t i = 0; i < count; ++i) std::thread([this] { serve(); }).detach();
  }

  // A spinning thread yields its core now and then: where threads outnumber free cores, the one
  // it waits for (or XLA's between the kernels) gets to run.
  static void pause(int spins) {
    _mm_pause();
    if ((spins & 63) == 63) std::this_thread::yield();
  }

  void serve() {
    uint64_t seen = epoch_.load();
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int spins = 0; epoch_.load() == seen; ++spins) {
        pause(spins);
        if ((spins & 255) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(kSpinNs)) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return epoch_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = epoch_.load();
      active_.fetch_add(1);
      if (ParallelLoop* loop = loop_.load()) loop->run();
      active_.fetch_sub(1);
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<ParallelLoop*> loop_{nullptr};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> active_{0}, sleeping_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
};

// Items [0, n) in chunks of `chunk`, on this thread and up to `threads - 1` others: the spinning
// helpers, or (while they run another loop, or for a long loop: `helpers` false) XLA's pool
// threads, which hold the loop by a shared pointer so that one starting after the last chunk
// touches nothing of this frame. `body` may reference the caller's stack. A loop of milliseconds
// amid XLA's own operations takes XLA's threads: the helpers' cores are the ones XLA's threads
// spin on between operations, and each ran at half speed (a Gemma 3 270M prefill's GEMMs, 2x).
inline void parallel_for(ffi::ThreadPool& pool, int64_t threads, int64_t n, int64_t chunk,
                         const std::function<void(int64_t, int64_t)>& body, bool helpers = true) {
  auto work = std::make_shared<ParallelLoop>();
  work->n = n;
  work->chunk = chunk > 0 ? chunk : 1;
  work->chunks = (n + work->chunk - 1) / work->chunk;
  work->body = &body;
  if (helpers && threads > 1 && work->chunks > 1 && Helpers::get(pool_threads(pool) - 1).run(*work)) return;
  for (int64_t i = 1; i < threads && i < work->chunks; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
}

// Output columns [n0, n1) for rows [0, M) in row tiles of `Max` (8 or 4), then 4, 2 and 1 rows:
// tile(R, m0, n) with R a std::integral_constant, so each tile size is its own instantiation.
// A tile reads each weight block once for its rows, and every tile runs the same arithmetic per
// row, so a row's result never depends on M. Columns go in blocks of `block`, every row tile over
// a block before the next row tile starts: with blocks of more than one column a row tile's
// activations stay in L1 while the block's weights (in L2) are read once a tile (for activations
// too large for L1 in more than one row tile: kquants.h's fixed-point planes). Only the order of
// the tiles changes with the block.
template <int64_t Max, class Tile>
inline void blocked_columns(int64_t M, int64_t n0, int64_t n1, int64_t block, Tile&& tile) {
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
    const auto columns = [&](auto R, int64_t m0) {
      for (int64_t n = b0; n < b1; ++n) tile(R, m0, n);
    };
    int64_t m0 = 0;
    if constexpr (Max >= 8)
      for (; m0 + 8 <= M; m0 += 8) columns(std::integral_constant<int64_t, 8>{}, m0);
    for (; m0 + 4 <= M; m0 += 4) columns(std::integral_constant<int64_t, 4>{}, m0);
    for (; m0 + 2 <= M; m0 += 2) columns(std::integral_constant<int64_t, 2>{}, m0);
    for (; m0 < M; ++m0) columns(std::integral_constant<int64_t, 1>{}, m0);
  }
}

// Column by column: a column's row tiles one after another.
template <int64_t Max, class Tile>
inline void tiled_columns(int64_t M, int64_t n0, int64_t n1, Tile&& tile) {
  blocked_columns<Max>(M, n0, n1, 1, tile);
}

// How many of x's M rows [M, K] come before its trailing rows of zeros: a prefill chunk's padding
// rows (llama.py zeroes them), whose products are zero. The kernels compute the rows before them
// and write zeros for the rest: each row's arithmetic is its own, so the others do not change.
inline int64_t live_rows(const float* x, int64_t M, int64_t K) {
  for (; M > 0; --M)
    for (const float* r = x + (M - 1) * K; r < x + M * K; ++r)
      if (*r != 0.f) return M;  // NaN too
  return 0;
}

// The rows of y = x . W^T [M, N] a kernel computes: live_rows of x [M, K], y's rows after them zeroed.
inline int64_t computed_rows(const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  const int64_t live = live_rows(x, M, K);
  std::fill(y + live * N, y + M * N, 0.f);
  return live;
}

}  // namespace pantheon
