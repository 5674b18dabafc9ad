// ggml's K-quant super-blocks (256 weights each) as the f32 kernel reads them: a super-block is
// decoded to 256 small integer codes and one scale and min per sub-block (32 weights for Q4_K and
// Q5_K, 16 for Q2_K, Q3_K and Q6_K), as ggml's dequantize_row_* reads them (w = scale * code - min,
// scale = d * sub-scale and min = dmin * sub-min in f32; Q3_K's code already holds its -4). The
// product sums code * x per sub-block in f32, then scales it once: sum_s scale_s * dot_s - min_s *
// sum(x_s), the same value as the dequantized weights' product up to f32 rounding order.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace pantheon {

enum KType : int64_t { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr bool is_k(int64_t t) { return t >= kQ2_K && t <= kQ6_K; }
constexpr int64_t k_bytes(int64_t t) {
  return t == kQ2_K ? 84 : t == kQ3_K ? 110 : t == kQ4_K ? 144 : t == kQ5_K ? 176 : t == kQ6_K ? 210 : 0;
}
constexpr int64_t k_sub(int64_t t) { return t == kQ4_K || t == kQ5_K ? 32 : 16; }  // weights per sub-block
constexpr bool has_k_min(int64_t t) { return t == kQ2_K || t == kQ4_K || t == kQ5_K; }

struct SuperBlock {
  alignas(32) int8_t q[256];
  float scale[16], min[16];  // per sub-block
};

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K/Q5_K's 12 bytes of six-bit sub-block scales and mins (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q2_K's and Q3_K's sub-block scales (and Q2_K's mins), 16 of each.
template <int64_t t>
inline void decode_scales_k(const uint8_t* b, SuperBlock& o) {
  if constexpr (t == kQ3_K) {
    const float d = fp16_at(b + 108);
    uint32_t aux[4];
    std::memcpy(aux, b + 96, 12);
    const uint32_t tmp = aux[2], k1 = 0x03030303, k2 = 0x0f0f0f0f;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    int8_t s[16];
    std::memcpy(s, aux, 16);
    for (int k = 0; k < 16; ++k) o.scale[k] = d * static_cast<float>(s[k] - 32), o.min[k] = 0.f;
  } else {
    const uint8_t* sc = b;
    const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
    for (int k = 0; k < 16; ++k) {
      o.scale[k] = d * static_cast<float>(sc[k] & 0xF);
      o.min[k] = dmin * static_cast<float>(sc[k] >> 4);
    }
  }
}

// A super-block's 256 codes, decoded in vector registers (8 x 32 bytes), and its sub-block scales
// and mins.
template <int64_t t>
inline void codes_k(const uint8_t* b, SuperBlock& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (t == kQ4_K || t == kQ5_K) {
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int s, m;
      scale_min_k4(j, b + 4, s, m);
      o.scale[j] = d * static_cast<float>(s);
      o.min[j] = dmin * static_cast<float>(m);
    }
    const uint8_t* qs = b + (t == kQ4_K ? 16 : 48);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (t == kQ5_K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i one = _mm256_set1_epi8(1);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if constexpr (t == kQ5_K) {  // the fifth bit: qh bit 2j for the low nibbles, 2j+1 for the high
        const __m256i blo = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one);
        const __m256i bhi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(blo, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(bhi, 4));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 64 * j), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 64 * j + 32), hi);
    }
  } else if constexpr (t == kQ6_K) {
    const float d = fp16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int k = 0; k < 16; ++k) o.scale[k] = d * static_cast<float>(sc[k]), o.min[k] = 0.f;
    const __m256i m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
      const auto high = [&](int shift) {  // ((h >> shift) & 3) << 4, per byte
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), m2), 4);
      };
      const auto put = [&](int at, __m256i v) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 128 * n + at), _mm256_sub_epi8(v, off));
      };
      put(0, _mm256_or_si256(_mm256_and_si256(l0, m4), high(0)));
      put(32, _mm256_or_si256(_mm256_and_si256(l1, m4), high(2)));
      put(64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4)));
      put(96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6)));
    }
  } else if constexpr (t == kQ3_K) {  // 2 low bits from qs, minus 4 where the hmask bit is clear
    decode_scales_k<t>(b, o);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), m2 = _mm256_set1_epi8(3);
    const __m256i four = _mm256_set1_epi8(4), zero = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * n));
      for (int j = 0; j < 4; ++j) {
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), m2);
        const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8(static_cast<char>(1 << (4 * n + j)))), zero);
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 128 * n + 32 * j),
                           _mm256_sub_epi8(low, _mm256_and_si256(clear, four)));
      }
    }
  } else {  // Q2_K: 2 bits per code
    decode_scales_k<t>(b, o);
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; ++n) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * n));
      for (int j = 0; j < 4; ++j)
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 128 * n + 32 * j),
                           _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), m2));
    }
  }
}

// Codes 8v..8v+7 of a decoded super-block as f32.
inline v8f code_f32(const SuperBlock& sb, int v) {
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb.q + 8 * v))));
}

// R rows m0.. of output column n against a row of K-quant super-blocks. Per super-block: its codes
// as f32 (once, for all R rows), then per row and sub-block the f32 dot of codes and x, scaled:
// acc += scale * dot, and the min term min * sum(x over the sub-block) beside it. A row's sums run
// over the same vectors in the same order in every tile, so a row never depends on its batch.
// xsum[m, K/sub]: x's sums over each sub-block (Q2_K's 16, Q4_K/Q5_K's 32; the others have no min).
template <int64_t t, int64_t R>
inline void ktile(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0,
                  int64_t n) {
  constexpr int64_t bb = k_bytes(t);
  constexpr int per_sub = static_cast<int>(k_sub(t) / 8);  // 8-wide vectors per sub-block
  const int64_t nsb = K / 256;
  v8f acc[R] = {};
  float macc[R] = {};
  SuperBlock sb;
  v8f c[32];
  for (int64_t j = 0; j < nsb; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(wrow + j * bb) + 1024, _MM_HINT_T0);
    codes_k<t>(wrow + j * bb, sb);
    if constexpr (R > 1)  // converted once for the tile's rows (one row converts as it multiplies)
      for (int v = 0; v < 32; ++v) c[v] = code_f32(sb, v);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + j * 256;
      for (int s = 0; s < 32 / per_sub; ++s) {
        const int v0 = s * per_sub;
        v8f dot = (R > 1 ? c[v0] : code_f32(sb, v0)) * load8(xr + 8 * v0);
        for (int v = v0 + 1; v < v0 + per_sub; ++v) dot = fma8(R > 1 ? c[v] : code_f32(sb, v), load8(xr + 8 * v), dot);
        acc[r] = fma8(dot, v8f{} + sb.scale[s], acc[r]);
      }
      if constexpr (has_k_min(t)) {
        constexpr int subs = static_cast<int>(256 / k_sub(t));
        const float* xs = xsum + (m0 + r) * (K / k_sub(t)) + j * subs;
        for (int s = 0; s < subs; ++s) macc[r] += sb.min[s] * xs[s];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) - macc[r];
}

template <int64_t t>
void kcolumns(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
              int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 256 * k_bytes(t);
  tiled_columns<4>(M, n0, n1, [&](auto R, int64_t m0, int64_t n) {
    ktile<t, decltype(R)::value>(x, xsum, w + n * row_bytes, y, N, K, m0, n);
  });
}

inline void kcolumns(int64_t t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N,
                     int64_t K, int64_t n0, int64_t n1) {
  switch (t) {
    case kQ2_K: kcolumns<kQ2_K>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ3_K: kcolumns<kQ3_K>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ4_K: kcolumns<kQ4_K>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ5_K: kcolumns<kQ5_K>(x, xsum, w, y, M, N, K, n0, n1); break;
    default: kcolumns<kQ6_K>(x, xsum, w, y, M, N, K, n0, n1); break;
  }
}

}  // namespace pantheon
