// y[M, N] = x[M, K] . W^T for W[N, K] held in ggml's quant blocks (Q4_0, Q4_1, Q8_0), as an XLA FFI
// custom call on the CPU. XLA:CPU has no quantized matmul: dequantized f32 weights stream 4-6x the
// bytes of the blocks, which bounds decode. This reads the blocks and dequantizes in registers.
//
// Every output element is computed by the same instruction sequence whatever M is (rows are never
// mixed), so a row's result does not depend on its batch-mates: batching never changes a greedy
// result. The work is split by output columns over XLA's intra-op thread pool.
#include <algorithm>

#include "common.h"

namespace pantheon {
namespace {

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type ids

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

constexpr int64_t block_bytes(int64_t t) { return t == kQ4_0 ? 18 : t == kQ4_1 ? 20 : t == kQ8_0 ? 34 : 0; }

// The 32 weights of one block as four vectors (elements 0-7, 8-15, 16-23, 24-31), its scale d,
// and (Q4_1) its min m: weight = d * w + m. Low nibbles of a Q4 block are weights 0-15, high 16-31.
template <int64_t t>
inline void dequant(const uint8_t* b, v8f w[4], float& d, float& m) {
  uint16_t h;
  std::memcpy(&h, b, 2);
  d = half_to_float(h);
  m = 0.f;
  if constexpr (t == kQ4_1) { std::memcpy(&h, b + 2, 2); m = half_to_float(h); }
  if constexpr (t == kQ8_0) {
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      w[i] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (t == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    w[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  if constexpr (t == kQ4_0) for (int i = 0; i < 4; ++i) w[i] -= 8.f;
}



// R rows m0.. of output column n. xsum[m, blk]: block sums of x (Q4_1's min term).
template <int64_t t, int64_t R>
inline void tile(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K,
                 int64_t m0, int64_t n) {
  constexpr int64_t bb = block_bytes(t);
  const int64_t nb = K / 32;
  v8f acc[R] = {};
  float macc[R] = {};
  for (int64_t j = 0; j < nb; ++j) {
    v8f w[4];
    float d, mn;
    dequant<t>(wrow + j * bb, w, d, mn);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + j * 32;
      v8f s = w[0] * load8(xr);
      for (int i = 1; i < 4; ++i) s = fma8(w[i], load8(xr + 8 * i), s);
      acc[r] = fma8(s, v8f{} + d, acc[r]);
      if constexpr (t == kQ4_1) macc[r] += mn * xsum[(m0 + r) * nb + j];
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + macc[r];
}

// Output columns [n0, n1) for all M rows, in row tiles of 8, 4, 2 and 1 (a tile dequantizes each
// block once for its rows). Every tile runs the same arithmetic per row, so a row's result does not
// depend on M.
template <int64_t t>
void columns(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 32 * block_bytes(t);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w + n * row_bytes;
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) tile<t, 8>(x, xsum, wrow, y, N, K, m0, n);
    for (; m0 + 4 <= M; m0 += 4) tile<t, 4>(x, xsum, wrow, y, N, K, m0, n);
    for (; m0 + 2 <= M; m0 += 2) tile<t, 2>(x, xsum, wrow, y, N, K, m0, n);
    for (; m0 < M; ++m0) tile<t, 1>(x, xsum, wrow, y, N, K, m0, n);
  }
}

void columns(int64_t t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N,
             int64_t K, int64_t n0, int64_t n1) {
  if (t == kQ4_0) columns<kQ4_0>(x, xsum, w, y, M, N, K, n0, n1);
  else if (t == kQ4_1) columns<kQ4_1>(x, xsum, w, y, M, N, K, n0, n1);
  else columns<kQ8_0>(x, xsum, w, y, M, N, K, n0, n1);
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                   ffi::ResultBuffer<ffi::F32> y, int64_t qtype) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0], bb = block_bytes(qtype);
  if (bb == 0) return ffi::Error::InvalidArgument("qmatmul: unsupported quant type");
  if (K % 32 != 0 || wd[1] != K / 32 * bb) return ffi::Error::InvalidArgument("qmatmul: w does not match x");
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t nb = K / 32;
  std::unique_ptr<float[]> xsum(new float[M * nb > 0 ? M * nb : 1]);
  for (int64_t i = 0; i < M * nb; ++i) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += xp[i * 32 + k];
    xsum[i] = s;
  }
  // Waking a pool thread costs more than a small product gains from it.
  const int64_t threads = M * N * K >= (int64_t{1} << 16) ? pool_threads(pool) : 1;
  const float* xs = xsum.get();
  const int64_t chunk = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
  parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { columns(qtype, xp, xs, wp, yp, M, N, K, n0, n1); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pantheon

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonQMatmul, pantheon::QMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("qtype"));
