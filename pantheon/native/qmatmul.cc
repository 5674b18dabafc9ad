// y[M, N] = x[M, K] . W^T for W[N, K] held in ggml's quant blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, IQ4_NL; F16/BF16 rows) or K-quant super-blocks (kquants.h), as the file holds them, as an
// XLA FFI custom call on the CPU. XLA:CPU has no quantized matmul: dequantized f32 weights stream 4-6x the
// bytes of the blocks, which bounds decode. Two formulations:
//  - f32 activations ("exact" numerics): the blocks are dequantized in registers and multiplied
//    with x in f32 (~10 cycles per block and row at batch 1 on an AVX2 EPYC);
//  - 8-bit activations ("llamacpp" numerics): x is first rounded to Q8_0 blocks exactly as
//    ggml-cpu's x86 quantizer rounds it (Q8_1 against Q4_1/U4_1: the same values plus an fp16
//    block sum), and each block is an integer dot product (maddubs/madd), as llama.cpp computes it
//    (~6 cycles per block and row).
//
// Every output element is computed by the same instruction sequence whatever M is (rows are never
// mixed, and a row's quantization reads only that row), so a row's result does not depend on its
// batch-mates: batching never changes a greedy result. The work is split by output columns over
// the cores (common.h: parallel_for).
#include <algorithm>
#include <array>
#include <string>
#include <vector>
#include <cmath>
#include <utility>

#include "common.h"
#include "kquants.h"

namespace pantheon {
namespace {

// ggml's Q8_0 (d, 32 x int8), Q4_0 (d, 16 bytes of nibbles: code - 8), Q4_1 (d, m, 16 bytes of
// nibbles), Q5_0 and Q5_1 (Q4_0's and Q4_1's with a u32 of fifth bits before the nibbles: Q5_0's
// code - 16), and Pantheon's U4_1 (d, m, 32 x u8: a Q4_1/Q5_1 block unpacked, qmatmul.unpack_nibbles;
// the tests' check of the packed reads). A packed block's codes are split in registers (low
// nibbles are weights 0-15, high ones 16-31; fifth bit j of weight j): the same codes, so the same
// arithmetic as their unpacked forms, bit for bit.
// IQ4_NL (d, 16 bytes of nibbles indexing a fixed table of 16 int8 values) reads as Q4_0 with the
// table looked up in registers (iq4_values): its codes are int8s, as Q8_0's.
enum QType : int64_t { kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kIQ4_NL = 20, kBF16 = 30, kU4_1 = 1003 };

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Weights stream once per step from memory: each block's first line is fetched kquants.h's
// kPrefetchAhead bytes ahead (the hardware prefetcher alone left a batch-1 step of the default
// model ~8 % slower; 2 KiB, not 1, on a Zen 5: the 1 B Q8_0 decode 33.6 / 36.5 / 30.6 -> 37.9 /
// 38.2 / 34.6 tok/s, alternating runs, the default model level).

constexpr int64_t block_bytes(int64_t t) {
  return t == kQ8_0 ? 34 : t == kU4_1 ? 36 : t == kQ4_0 || t == kIQ4_NL ? 18 : t == kQ4_1 ? 20 : t == kQ5_0 ? 22
       : t == kQ5_1 ? 24 : t == kF16 || t == kBF16 ? 64 : 0;
}
// F16/BF16 rows read as blocks of 32 weights with no scale (d = 1): the same tiles, half f32's bytes.
constexpr bool half(int64_t t) { return t == kF16 || t == kBF16; }
constexpr bool has_min(int64_t t) { return t == kU4_1 || t == kQ4_1 || t == kQ5_1; }  // weight = d * w + m
constexpr bool five(int64_t t) { return t == kQ5_0 || t == kQ5_1; }
constexpr bool packed(int64_t t) { return t == kQ4_0 || t == kQ4_1 || t == kIQ4_NL || five(t); }
constexpr int64_t codes_at(int64_t t) { return (has_min(t) ? 4 : 2) + (five(t) ? 4 : 0); }  // after d (m, qh)

// 16 fifth bits (bit i: byte i) as bytes 0x10 where set.
inline __m128i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_maskz_mov_epi8(static_cast<__mmask16>(bits), _mm_set1_epi8(0x10));
#else  // byte i of the pair of bytes holding bit i, tested against its bit
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10));
#endif
}

// A packed block's 32 codes as two 16-byte halves (weights 0-15, 16-31); Q4_0's centred (code - 8),
// Q5_0's (code - 16), IQ4_NL's the table's values.
template <int64_t t>
inline void nibbles(const uint8_t* b, __m128i& lo, __m128i& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + codes_at(t))), m4 = _mm_set1_epi8(0x0F);
  lo = _mm_and_si128(raw, m4);
  hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
  if constexpr (five(t)) {
    uint32_t qh;
    std::memcpy(&qh, b + codes_at(t) - 4, 4);
    lo = _mm_or_si128(lo, fifth_bits(qh & 0xFFFF));
    hi = _mm_or_si128(hi, fifth_bits(qh >> 16));
  }
  if constexpr (t == kQ4_0 || t == kQ5_0) {
    const __m128i centre = _mm_set1_epi8(t == kQ4_0 ? 8 : 16);
    lo = _mm_sub_epi8(lo, centre);
    hi = _mm_sub_epi8(hi, centre);
  } else if constexpr (t == kIQ4_NL) {
    lo = iq4_values(lo);
    hi = iq4_values(hi);
  }
}

// A block's scale d and (U4_1) min m: weight = d * w + m.
template <int64_t t>
inline void scales(const uint8_t* b, float& d, float& m) {
  if constexpr (half(t)) {
    d = 1.f, m = 0.f;
  } else if constexpr (has_min(t)) {  // d and m, converted together
    uint32_t dm;
    std::memcpy(&dm, b, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    d = _mm_cvtss_f32(f);
    m = _mm_cvtss_f32(_mm_movehdup_ps(f));
  } else {
    uint16_t h;
    std::memcpy(&h, b, 2);
    d = half_to_float(h);
    m = 0.f;
  }
}

// The 32 weights of one block as four vectors (elements 0-7, 8-15, 16-23, 24-31) and its scales.
template <int64_t t>
inline void dequant(const uint8_t* b, v8f w[4], float& d, float& m) {
  scales<t>(b, d, m);
  if constexpr (half(t)) {  // exact conversions: F16C, or bf16 as the upper half of an f32
    for (int i = 0; i < 4; ++i) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
      w[i] = t == kF16 ? (v8f)_mm256_cvtph_ps(h) : (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return;
  }
  if constexpr (packed(t)) {
    __m128i h[2];
    nibbles<t>(b, h[0], h[1]);
    for (int i = 0; i < 4; ++i) {
      const __m128i q = (i & 1) ? _mm_srli_si128(h[i / 2], 8) : h[i / 2];
      w[i] = (v8f)_mm256_cvtepi32_ps(has_min(t) ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q));
    }
    return;
  }
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + codes_at(t) + 8 * i));
    w[i] = (v8f)_mm256_cvtepi32_ps(has_min(t) ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q));
  }
}

// The 32 weights of one block as 32 / kW vectors of kquants.h's width (16 where the CPU has AVX-512:
// half the conversions and multiply-adds of 8-wide ones; the same values).
template <int64_t t>
inline void dequant_wide(const uint8_t* b, vkf w[32 / kW], float& d, float& m) {
#if defined(__AVX512F__)
  scales<t>(b, d, m);
  if constexpr (half(t)) {
    for (int i = 0; i < 2; ++i) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * i));
      w[i] = t == kF16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return;
  }
  if constexpr (packed(t)) {  // codes looked up as f32 (vpermps reads an index's low 4 bits, vpermt2ps 5)
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + codes_at(t))));
    const __m512i hi = _mm512_srli_epi32(raw, 4);  // weights 16-31; the low nibbles are 0-15
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (five(t)) {  // fifth bit j rotated to bit 4 of lane j % 16, selected in beside the nibble
      uint32_t bits;
      std::memcpy(&bits, b + codes_at(t) - 4, 4);
      const __m512i qh = _mm512_set1_epi32(static_cast<int>(bits));
      const __m512i by = _mm512_setr_epi32(-4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), nib = _mm512_set1_epi32(0xF);
      const __m512i lo = _mm512_ternarylogic_epi32(raw, _mm512_rorv_epi32(qh, by), nib, 0xE4);  // c ? a : b
      const __m512i h5 = _mm512_ternarylogic_epi32(hi, _mm512_rorv_epi32(qh, _mm512_add_epi32(by, _mm512_set1_epi32(16))), nib, 0xE4);
      const __m512 t0 = _mm512_add_ps(codes, _mm512_set1_ps(t == kQ5_0 ? -16.f : 0.f)), t1 = _mm512_add_ps(t0, _mm512_set1_ps(16.f));
      w[0] = _mm512_permutex2var_ps(t0, lo, t1), w[1] = _mm512_permutex2var_ps(t0, h5, t1);
    } else {
      const __m512 table = t == kIQ4_NL ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(iq4_table()))
                                        : _mm512_add_ps(codes, _mm512_set1_ps(t == kQ4_0 ? -8.f : 0.f));
      w[0] = _mm512_permutexvar_ps(raw, table), w[1] = _mm512_permutexvar_ps(hi, table);
    }
    return;
  }
  for (int i = 0; i < 2; ++i) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + codes_at(t) + 16 * i));
    w[i] = _mm512_cvtepi32_ps(has_min(t) ? _mm512_cvtepu8_epi32(q) : _mm512_cvtepi8_epi32(q));
  }
#else
  dequant<t>(b, w, d, m);
#endif
}

// R rows m0.. of output column n. xsum[m, blk]: block sums of x (U4_1's min term).
// AVX-512: the block's weights dequantized in registers (d * code, ggml's value) and multiply-added
// into four sums a row (per vector, even and odd blocks): two FMAs a row and block where the
// scale-once form takes three, and one row's sums are not one chain of FMA latencies. 8192 x 2048
// at 1 / 16 / 32 / 64 rows (two Zen 5 threads): Q8_0 0.23 / 2.37 / 4.70 / 9.19 -> 0.21 / 1.81 / 3.71
// / 7.21 ms, Q5_0 at 16 / 32 2.28 / 4.64 -> 1.98 / 4.00; the 1 B's 32-token prefill Q8_0 86-92 ->
// 110-111 tok/s, Q5_0 89-102 -> 105-113 (decode level: it streams from memory). Four rows a tile:
// four sums for each of eight rows would not fit the registers. (IQ4_XS's lookups scaled the same
// way, kquants.h: lut_ktile, ran 10 % slower: not done.)
template <int64_t t, int64_t R>
inline void tile(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K,
                 int64_t m0, int64_t n) {
  constexpr int64_t bb = block_bytes(t);
  const int64_t nb = K / 32;
#if defined(__AVX512F__)
  __m512 acc[R][4];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  float macc[R] = {};
  const auto block = [&](int64_t j, auto p) {  // p: the pair of sums (even or odd block)
    __m512 w[2];
    float d, mn;
    _mm_prefetch(reinterpret_cast<const char*>(wrow + j * bb) + kPrefetchAhead, _MM_HINT_T0);
    dequant_wide<t>(wrow + j * bb, w, d, mn);
    if constexpr (!half(t)) w[0] = _mm512_mul_ps(w[0], _mm512_set1_ps(d)), w[1] = _mm512_mul_ps(w[1], _mm512_set1_ps(d));
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + j * 32;
      acc[r][p] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r][p]);
      acc[r][p + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r][p + 1]);
      if constexpr (has_min(t)) macc[r] += mn * xsum[(m0 + r) * nb + j];
    }
  };
  int64_t j = 0;
  for (; j + 2 <= nb; j += 2) block(j, std::integral_constant<int, 0>{}), block(j + 1, std::integral_constant<int, 2>{});
  if (j < nb) block(j, std::integral_constant<int, 0>{});
  for (int64_t r = 0; r < R; ++r)
    y[(m0 + r) * N + n] = k_hsum(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][2]), _mm512_add_ps(acc[r][1], acc[r][3]))) + macc[r];
#else
  constexpr int nv = 32 / kW;
  vkf acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = k_set1(0.f);
  float macc[R] = {};
  for (int64_t j = 0; j < nb; ++j) {
    vkf w[nv];
    float d, mn;
    _mm_prefetch(reinterpret_cast<const char*>(wrow + j * bb) + kPrefetchAhead, _MM_HINT_T0);
    dequant_wide<t>(wrow + j * bb, w, d, mn);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + j * 32;
      vkf s = k_mul(w[0], k_load(xr));
      for (int i = 1; i < nv; ++i) s = k_fma(w[i], k_load(xr + kW * i), s);
      acc[r] = k_fma(s, k_set1(d), acc[r]);
      if constexpr (has_min(t)) macc[r] += mn * xsum[(m0 + r) * nb + j];
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = k_hsum(acc[r]) + macc[r];
#endif
}

// Output columns [n0, n1) for all M rows (common.h's tiled_columns).
template <int64_t t>
void columns(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 32 * block_bytes(t);
  blocked_columns<kW == 16 ? 4 : 8>(M, n0, n1, kColumnBlock, [&](auto R, int64_t m0, int64_t n) {
    tile<t, decltype(R)::value>(x, xsum, w + n * row_bytes, y, N, K, m0, n);
  });
}

// ---- 8-bit activations (llamacpp numerics) -------------------------------------------------

inline float round_fp16(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

// x [M, K] as 8-bit blocks: q [M, K] int8, d [M, K/32] the fp16 scale (as f32), s [M, K/32] the
// fp16 block sum d * sum(q) (Q8_1's). As ggml-cpu's AVX2 quantize_row_q8_0/q8_1: d = amax / 127,
// values times 127 / amax rounded to nearest even; s from the unrounded d.
void quantize_rows(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float dd = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * id));
      q[i * 32 + k] = static_cast<int8_t>(v);
      sum += v;
    }
    d[i] = round_fp16(dd);
    s[i] = round_fp16(dd * static_cast<float>(sum));
  }
}

struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* s;
};

// The 32 weights of one block as bytes for maddubs (unsigned first operand): U4_1's (0..15) as
// they are; Q8_0's as |w|, with the signs in `sign` to move onto the activations
// (_mm256_sign_epi8), as ggml does.
template <int64_t t>
inline void block_bytes8(const uint8_t* b, __m256i& w, __m256i& sign, float& d, float& m) {
  scales<t>(b, d, m);
  if constexpr (packed(t)) {
    __m128i lo, hi;
    nibbles<t>(b, lo, hi);
    const __m256i v = _mm256_set_m128i(hi, lo);
    if constexpr (has_min(t)) {
      w = v;
    } else {
      sign = v;
      w = _mm256_sign_epi8(sign, sign);
    }
  } else if constexpr (has_min(t)) {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4));
  } else {
    sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    w = _mm256_sign_epi8(sign, sign);
  }
}

// R rows m0.. of output column n, against 8-bit activations.
template <int64_t t, int64_t R>
inline void tile8(const Q8Rows& a, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  constexpr int64_t bb = block_bytes(t);
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  // ggml's IQ4_NL product keeps even and odd blocks in two accumulators, added before the final
  // sum, and takes an odd last block in scalar (vec_dot_iq4_nl_q8_0); the others keep one.
  constexpr bool pairs = t == kIQ4_NL;
  const int64_t nv = pairs ? nb & ~int64_t{1} : nb;
  v8f acc[R] = {}, acc_odd[R] = {};
  float macc[R] = {};
  for (int64_t j = 0; j < nb; ++j) {
    __m256i w, sign = _mm256_setzero_si256();
    float d, mn;
    _mm_prefetch(reinterpret_cast<const char*>(wrow + j * bb) + kPrefetchAhead, _MM_HINT_T0);
    block_bytes8<t>(wrow + j * bb, w, sign, d, mn);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * K + j * 32));
      if constexpr (!has_min(t)) xq = _mm256_sign_epi8(xq, sign);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);  // exact: |pair| < 2^15
      const float dd = d * a.d[row * nb + j];
      if (pairs && j >= nv) {  // IQ4_NL's odd last block: its integer sum, scaled, onto the float total
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), dot);
        int32_t sum = 0;
        for (int i = 0; i < 8; ++i) sum += lanes[i];
        macc[r] += dd * static_cast<float>(sum);
      } else if (pairs && (j & 1)) {
        acc_odd[r] = fma8((v8f)_mm256_cvtepi32_ps(dot), v8f{} + dd, acc_odd[r]);
      } else {
        acc[r] = fma8((v8f)_mm256_cvtepi32_ps(dot), v8f{} + dd, acc[r]);
      }
      if constexpr (has_min(t)) macc[r] += mn * a.s[row * nb + j];
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = (pairs ? hsum(acc[r] + acc_odd[r]) : hsum(acc[r])) + macc[r];
}

template <int64_t t>
void columns8(const Q8Rows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 32 * block_bytes(t);
  tiled_columns<8>(M, n0, n1, [&](auto R, int64_t m0, int64_t n) {
    tile8<t, decltype(R)::value>(a, w + n * row_bytes, y, N, K, m0, n);
  });
}

void columns8(int64_t t, const Q8Rows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
              int64_t n1) {
  switch (t) {
    case kU4_1: columns8<kU4_1>(a, w, y, M, N, K, n0, n1); break;
    case kQ4_0: columns8<kQ4_0>(a, w, y, M, N, K, n0, n1); break;
    case kQ4_1: columns8<kQ4_1>(a, w, y, M, N, K, n0, n1); break;
    case kQ5_0: columns8<kQ5_0>(a, w, y, M, N, K, n0, n1); break;
    case kQ5_1: columns8<kQ5_1>(a, w, y, M, N, K, n0, n1); break;
    case kIQ4_NL: columns8<kIQ4_NL>(a, w, y, M, N, K, n0, n1); break;
    default: columns8<kQ8_0>(a, w, y, M, N, K, n0, n1); break;
  }
}

void columns(int64_t t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N,
             int64_t K, int64_t n0, int64_t n1) {
  switch (t) {
    case kU4_1: columns<kU4_1>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ4_0: columns<kQ4_0>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ4_1: columns<kQ4_1>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ5_0: columns<kQ5_0>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kQ5_1: columns<kQ5_1>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kIQ4_NL: columns<kIQ4_NL>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kF16: columns<kF16>(x, xsum, w, y, M, N, K, n0, n1); break;
    case kBF16: columns<kBF16>(x, xsum, w, y, M, N, K, n0, n1); break;
    default: columns<kQ8_0>(x, xsum, w, y, M, N, K, n0, n1); break;
  }
}

// The products below take x [M, K] (M: the rows computed), W's blocks [N, row_bytes] and y [M, N]
// as pointers: a matrix of its own (the FFI calls) or one routed expert's rows in place
// (ExpertMatmul); alone: on the calling thread only (ExpertMatmul spreads experts over the cores).

// K-quant super-blocks (kquants.h): f32 activations, or 8-bit ones rounded to Q8_K.
ffi::Error KMatmul(ffi::ThreadPool& pool, const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t N,
                   int64_t K, int64_t row_bytes, int64_t qtype, int64_t int8_activations, bool alone = false) {
  const bool tiled = is_tiled(qtype);  // read only by the fixed-point kernel (exact numerics)
  if (tiled) qtype -= kTiled;
  if (tiled && (int8_activations || !fixed_k(qtype)))
    return ffi::Error::InvalidArgument("qmatmul: K-tiled blocks are read with f32 activations by the AVX-512 VNNI kernel only");
  if (K % 256 != 0 || row_bytes != K / 256 * k_bytes(qtype)) return ffi::Error::InvalidArgument("qmatmul: w does not match x");
  const int64_t threads = !alone && M * N * K >= (int64_t{1} << 18) ? pool_threads(pool) : 1;
  const int64_t chunk = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
  if (int8_activations) {
    const int64_t blocks = std::max<int64_t>(M * (K / 256), 1);
    std::unique_ptr<int8_t[]> q(new int8_t[blocks * 256]);
    std::unique_ptr<float[]> d(new float[blocks]);
    std::unique_ptr<int16_t[]> bsum(new int16_t[blocks * 16]);
    quantize_rows_q8k(xp, M * (K / 256), q.get(), d.get(), bsum.get());
    const Q8KRows a{q.get(), d.get(), bsum.get()};
    parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { kcolumns8(qtype, a, wp, yp, M, N, K, n0, n1); });
    return ffi::Error::Success();
  }
  const int64_t sub = k_sub(qtype);  // the min terms' sums of x over each sub-block
  std::unique_ptr<float[]> xsum(new float[M * (K / sub) + 1]);
  const float* xs = xsum.get();
#if defined(PANTHEON_FIXED_K)
  if (fixed_k(qtype)) {  // x as 23-bit fixed point, exact integer products (kquants.h)
    std::unique_ptr<int8_t[]> planes(new int8_t[M * K * 3 + 1]);
    std::unique_ptr<float[]> scale(new float[M * K / 16 + 1]), row_scale(new float[M + 1]);
    fixed_rows(xp, M, K, sub, planes.get(), scale.get(), row_scale.get(), xsum.get());
    const FixedRows xf{planes.get(), scale.get(), row_scale.get()};
    parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { fixed_columns(qtype, xf, xs, wp, tiled, yp, M, N, K, n0, n1); });
    return ffi::Error::Success();
  }
#endif
  for (int64_t i = 0; i < M * (K / sub); ++i) {
    float s = 0.f;
    for (int64_t k = 0; k < sub; ++k) s += xp[i * sub + k];
    xsum[i] = s;
  }
  std::unique_ptr<float[]> xl;
  if (lut_k(qtype)) {  // x in the order the lookups produce the codes
    xl.reset(new float[M * K + 1]);
    lut_order(qtype == kQ4_K, xp, xl.get(), M, K);
    xp = xl.get();
  }
  parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { kcolumns(qtype, xp, xs, wp, yp, M, N, K, n0, n1); });
  return ffi::Error::Success();
}

// Any type the kernels read: the row kernels.
ffi::Error Product(ffi::ThreadPool& pool, const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t N,
                   int64_t K, int64_t row_bytes, int64_t qtype, int64_t int8_activations, bool alone = false) {
  if (is_k(qtype) || is_tiled(qtype)) return KMatmul(pool, xp, wp, yp, M, N, K, row_bytes, qtype, int8_activations, alone);
#if defined(PANTHEON_FIXED_K)
  // Q4_0/Q4_1 with f32 activations: eight blocks at a time as a K-quant super-block, x in fixed
  // point (kquants.h: fixed_group); rows of other lengths take the f32 kernel below
  if ((qtype == kQ4_0 || qtype == kQ4_1) && !int8_activations && K % 256 == 0)
    return KMatmul(pool, xp, wp, yp, M, N, K, row_bytes, qtype == kQ4_0 ? kG4_0 : kG4_1, 0, alone);
#endif
  const int64_t bb = block_bytes(qtype);
  if (bb == 0) return ffi::Error::InvalidArgument("qmatmul: unsupported quant type");
  if (K % 32 != 0 || row_bytes != K / 32 * bb) return ffi::Error::InvalidArgument("qmatmul: w does not match x");
  if (int8_activations && half(qtype)) return ffi::Error::InvalidArgument("qmatmul: F16/BF16 take f32 activations");
  const int64_t nb = K / 32, blocks = M * nb > 0 ? M * nb : 1;
  // Waking a pool thread costs more than a small product gains from it.
  const int64_t threads = !alone && M * N * K >= (int64_t{1} << 18) ? pool_threads(pool) : 1;
  const int64_t chunk = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
  if (int8_activations) {
    std::unique_ptr<int8_t[]> q(new int8_t[blocks * 32]);
    std::unique_ptr<float[]> d(new float[blocks]), s(new float[blocks]);
    quantize_rows(xp, M * nb, q.get(), d.get(), s.get());
    const Q8Rows a{q.get(), d.get(), s.get()};
    parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { columns8(qtype, a, wp, yp, M, N, K, n0, n1); });
    return ffi::Error::Success();
  }
  std::unique_ptr<float[]> xsum(new float[blocks]);
  for (int64_t i = 0; i < M * nb; ++i) {
    float s = 0.f;
    for (int k = 0; k < 32; ++k) s += xp[i * 32 + k];
    xsum[i] = s;
  }
  const float* xs = xsum.get();
  parallel_for(pool, threads, N, chunk, [&](int64_t n0, int64_t n1) { columns(qtype, xp, xs, wp, yp, M, N, K, n0, n1); });
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                   ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t int8_activations) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x and w must be 2-D");
  // x's trailing rows of zeros (a prefill chunk's padding) are zeros in y, not computed
  const int64_t N = wd[0], M = computed_rows(x.typed_data(), xd[0], xd[1], y->typed_data(), N);
  return Product(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, N, xd[1], wd[1], qtype, int8_activations);
}

// ---- dequantization for long prefill chunks ------------------------------------------------
// Weights [k0, k1) of row n (multiples of the block's 256 or 32 weights) -> f32 at o: the values
// ggml's dequantize_row_* gives (and gguf/quants.py's jnp reference, exactly: one multiply and one
// add or subtract per weight, nothing fused).
template <int64_t t>
void dequant_part(const uint8_t* w, int64_t n, int64_t N, int64_t K, int64_t k0, int64_t k1, bool tiled, float* o) {
  if constexpr (is_k(t)) {
    constexpr int per_sub = static_cast<int>(k_sub(t) / 8);
    SuperBlock sb;
    for (int64_t j = k0 / 256; j < k1 / 256; ++j, o += 256) {
      codes_k<t>(w + block_offset(tiled, n, j, N, K / 256, k_bytes(t)), sb);
      for (int v = 0; v < 32; ++v)
        store8(o + 8 * v, code_f32(sb, v) * (v8f{} + sb.scale[v / per_sub]) - (v8f{} + sb.min[v / per_sub]));
    }
  } else {
    const uint8_t* row = w + n * (K / 32 * block_bytes(t));
    for (int64_t j = k0 / 32; j < k1 / 32; ++j, o += 32) {
      v8f q[4];
      float d, m;
      dequant<t>(row + j * block_bytes(t), q, d, m);
      for (int i = 0; i < 4; ++i) store8(o + 8 * i, has_min(t) ? d * q[i] + m : d * q[i]);
    }
  }
}

// f(std::integral_constant<int64_t, t>{}) for the block type t of a Dequantize / QGemm qtype.
template <class F>
void by_block_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kU4_1: return f(std::integral_constant<int64_t, kU4_1>{});
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kIQ4_NL: return f(std::integral_constant<int64_t, kIQ4_NL>{});
    case kF16: return f(std::integral_constant<int64_t, kF16>{});
    case kBF16: return f(std::integral_constant<int64_t, kBF16>{});
    case kQ2_K: return f(std::integral_constant<int64_t, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int64_t, kQ3_K>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kIQ4_XS: return f(std::integral_constant<int64_t, kIQ4_XS>{});
    default: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
}

// A Dequantize / QGemm qtype: whether its blocks are K-tiled, and its block type; false where
// w [N, row bytes] does not hold rows of K weights of that type.
struct BlockShape {
  bool tiled;
  int64_t type;
};
inline bool block_shape(int64_t qtype, int64_t K, int64_t row_bytes, BlockShape& s) {
  s.tiled = is_tiled(qtype);
  s.type = s.tiled ? qtype - kTiled : qtype;
  const int64_t bytes = is_k(s.type) ? k_bytes(s.type) : block_bytes(s.type), per = is_k(s.type) ? 256 : 32;
  return bytes != 0 && K % per == 0 && row_bytes == K / per * bytes;
}

// w [N, row bytes] -> f32 [N, K]. A prefill chunk of many rows is compute-bound: where QGemm is not
// built (AVX2), XLA's f32 GEMM runs on these, one matrix at a time. `after` is only an ordering
// dependency (dequantize_native): its values are not read.
ffi::Error Dequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> /*after*/,
                      ffi::ResultBuffer<ffi::F32> out, int64_t qtype) {
  const auto wd = w.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || od.size() != 2 || wd[0] != od[0]) return ffi::Error::InvalidArgument("dequantize: bad shapes");
  const int64_t N = od[0], K = od[1];
  BlockShape shape;
  if (!block_shape(qtype, K, wd[1], shape)) return ffi::Error::InvalidArgument("dequantize: bad type");
  const uint8_t* wp = w.typed_data();
  float* op = out->typed_data();
  const int64_t threads = N * K >= (int64_t{1} << 18) ? pool_threads(pool) : 1;
  parallel_for(pool, threads, N, std::max<int64_t>(16, N / (4 * threads) + 1), [&](int64_t n0, int64_t n1) {
    by_block_type(shape.type, [&](auto t) {
      for (int64_t n = n0; n < n1; ++n) dequant_part<decltype(t)::value>(wp, n, N, K, 0, K, shape.tiled, op + n * K);
    });
  });
  return ffi::Error::Success();
}

#if defined(__AVX512F__)
// ---- long exact prefill chunks: a GEMM over weights dequantized a tile at a time -----------------
//
// y = x W^T for many rows of f32 x, where the product is compute-bound: per column panel of
// kGemmCols outputs and depth block of kGemmDepth weights, the panel's weights are dequantized
// (ggml's values, as Dequantize writes them) into L1, transposed to [depth][columns], and every
// 14-row tile of x multiplies it in registers (14 x 32 sums, two 16-wide loads and 14 broadcasts
// per depth step). What dequantize-then-XLA's-GEMM computes, without the layer's f32 weights
// written out and read back, and with each output a single f32 FMA chain over k in order: a row's
// result does not depend on its batch-mates or its tile (a tail tile's rows are padded with zeros).
constexpr int64_t kGemmRows = 14, kGemmCols = 32, kGemmDepth = 256;

// dst[j][i] = src[i][j] for a 16 x 16 block (rows ss and ds floats apart).
inline void transpose16(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved, columns 0-1 / 2-3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], lane L: rows 4i .. 4i + 3 of column 4L + c
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512 w0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), w1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 w2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), w3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    _mm512_storeu_ps(dst + c * ds, _mm512_shuffle_f32x4(w0, w2, 0x88));
    _mm512_storeu_ps(dst + (c + 8) * ds, _mm512_shuffle_f32x4(w0, w2, 0xdd));
    _mm512_storeu_ps(dst + (c + 4) * ds, _mm512_shuffle_f32x4(w1, w3, 0x88));
    _mm512_storeu_ps(dst + (c + 12) * ds, _mm512_shuffle_f32x4(w1, w3, 0xdd));
  }
}

// c[R][32] (+)= xp[k][:R] . panel[k][32] over k < depth: R of a tile's 14 rows (a tail tile
// computes its live rows only).
template <int R>
void gemm_tile(const float* xp, const float* panel, int64_t depth, float* c, int64_t ldc, bool first) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) a[r][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * h);
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kGemmCols), w1 = _mm512_loadu_ps(panel + k * kGemmCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xp[k * kGemmRows + r]);
      a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + r * ldc + 16 * h, a[r][h]);
}

using GemmTile = void (*)(const float*, const float*, int64_t, float*, int64_t, bool);
template <size_t... R>
constexpr std::array<GemmTile, sizeof...(R)> gemm_tiles(std::index_sequence<R...>) {
  return {{&gemm_tile<int(R) + 1>...}};
}
constexpr auto kGemmTiles = gemm_tiles(std::make_index_sequence<kGemmRows>());  // [r - 1]: a tile of r rows

// Output columns [n0, n1) (multiples of kGemmCols) of y [M, N], the sums over k in [ka, kb) added
// to those before ka; xp: x packed tile-major, [tiles][K][14]; tails: per column panel, the last
// tile's rows (y holds only M of them).
template <int64_t t>
void gemm_columns(const float* xp, const uint8_t* w, bool tiled, float* y, float* tails, int64_t M, int64_t N,
                  int64_t K, int64_t ka, int64_t kb, int64_t n0, int64_t n1) {
  alignas(64) float rows[kGemmCols * kGemmDepth], panel[kGemmDepth * kGemmCols];
  const int64_t tiles = (M + kGemmRows - 1) / kGemmRows, full = M / kGemmRows;
  const GemmTile tail_tile = kGemmTiles[(M - 1) % kGemmRows];  // the last tile's rows (all 14 when full)
  for (int64_t nb = n0; nb < n1; nb += kGemmCols) {
    float* tail = tails + nb / kGemmCols * kGemmRows * kGemmCols;
    for (int64_t k0 = ka; k0 < kb; k0 += kGemmDepth) {
      const int64_t depth = std::min(kGemmDepth, kb - k0);  // a multiple of 32
      for (int64_t c = 0; c < kGemmCols; ++c) dequant_part<t>(w, nb + c, N, K, k0, k0 + depth, tiled, rows + c * depth);
      for (int64_t c = 0; c < kGemmCols; c += 16)
        for (int64_t k = 0; k < depth; k += 16) transpose16(rows + c * depth + k, depth, panel + k * kGemmCols + c, kGemmCols);
      for (int64_t i = 0; i < tiles; ++i) {
        const float* xt = xp + (i * K + k0) * kGemmRows;
        if (i < full) gemm_tile<kGemmRows>(xt, panel, depth, y + i * kGemmRows * N + nb, N, k0 == 0);
        else tail_tile(xt, panel, depth, tail, kGemmCols, k0 == 0);
      }
    }
    if (kb == K)
      for (int64_t r = full * kGemmRows; r < M; ++r)
        std::memcpy(y + r * N + nb, tail + (r - full * kGemmRows) * kGemmCols, sizeof(float) * kGemmCols);
  }
}

// x's rows are read once per column panel: the depth runs in spans whose part of x (M rows) stays
// within this many bytes (L2 and L3 hold it while every panel reads it; a 512 x 8192 x streamed from
// memory 64 times took a 2048 x 8192 product from 35 to 47 ms).
constexpr int64_t kGemmSpanBytes = int64_t{2} << 20;

ffi::Error Gemm(ffi::ThreadPool& pool, const float* xs, const uint8_t* wp, float* yp, int64_t M, int64_t N, int64_t K,
                int64_t row_bytes, int64_t qtype, bool alone = false) {
  BlockShape shape;
  if (!block_shape(qtype, K, row_bytes, shape)) return ffi::Error::InvalidArgument("qgemm: w does not match x");
  if (N % kGemmCols != 0) return ffi::Error::InvalidArgument("qgemm: outputs must be a multiple of 32");
  if (M == 0) return ffi::Error::Success();
  const int64_t tiles = (M + kGemmRows - 1) / kGemmRows;
  std::unique_ptr<float[]> packed(new float[tiles * K * kGemmRows + 1]);
  const int64_t threads = alone ? 1 : pool_threads(pool);
  parallel_for(pool, tiles > 1 ? threads : 1, tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // tile i: [K][14] (written in order), rows past M zero
      const int64_t live = std::min(kGemmRows, M - i * kGemmRows);
      const float* src = xs + i * kGemmRows * K;
      float* dst = packed.get() + i * K * kGemmRows;
      for (int64_t k = 0; k < K; ++k, dst += kGemmRows) {
        int64_t r = 0;
        for (; r < live; ++r) dst[r] = src[r * K + k];
        for (; r < kGemmRows; ++r) dst[r] = 0.f;
      }
    }
  }, false);
  const int64_t panels = N / kGemmCols;
  const int64_t chunk = std::max<int64_t>(1, panels / (4 * threads));
  std::unique_ptr<float[]> tails(new float[panels * kGemmRows * kGemmCols]);
  const int64_t span = std::max<int64_t>(kGemmDepth, kGemmSpanBytes / (4 * std::max<int64_t>(M, 1)) / kGemmDepth * kGemmDepth);
  for (int64_t ka = 0; ka < K; ka += span) {
    const int64_t kb = std::min(K, ka + span);
    parallel_for(pool, threads, panels, chunk, [&](int64_t p0, int64_t p1) {
      by_block_type(shape.type, [&](auto t) {
        gemm_columns<decltype(t)::value>(packed.get(), wp, shape.tiled, yp, tails.get(), M, N, K, ka, kb,
                                         p0 * kGemmCols, p1 * kGemmCols);
      });
    }, false);
  }
  return ffi::Error::Success();
}

ffi::Error QGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                 int64_t qtype) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("qgemm: x and w must be 2-D");
  // x's trailing rows of zeros (a prefill chunk's padding) are zeros in y, not computed
  const int64_t M = computed_rows(x.typed_data(), xd[0], xd[1], y->typed_data(), wd[0]);
  return Gemm(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, wd[0], xd[1], wd[1], qtype);
}
#endif

// Routed experts read in place: row a of y [N k, Nout] is assignment a = n k + j (token n's j-th
// choice of expert, experts [N, k]) times that expert's matrix of the stacked experts w [X, Nout,
// row bytes], read where the file holds it (no expert is copied out). x holds a row per token
// ([N, K]: the gate and up products) or per assignment ([N k, K]: the down product). Each used
// expert's rows are gathered (assignment order) into one product, the kernel a product of that
// many rows takes alone: the GEMM from gemm_rows rows (0: never; exact numerics, AVX-512 builds),
// else the row kernels; its trailing rows of zeros (a prefill chunk's padding, routed last) are
// zeros, not computed. With an expert for each core the experts spread over the cores, each
// product on one: one loop a call, not one an expert.
ffi::Error ExpertMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> experts,
                        ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y, int64_t qtype,
                        int64_t int8_activations, int64_t gemm_rows) {
  const auto xd = x.dimensions(), ed = experts.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("expert_matmul: x and experts must be 2-D, w 3-D (experts, outputs, row bytes)");
  const int64_t T = ed[0], k = ed[1], A = T * k, R = xd[0], K = xd[1], X = wd[0], N = wd[1], B = wd[2];
  if (R != T && R != A) return ffi::Error::InvalidArgument("expert_matmul: x needs a row per token or per assignment");
  const bool per_token = R == T;  // (k == 1: the same rows either way)
  const int32_t* ids = experts.typed_data();
  std::vector<int64_t> count(X, 0), start(X + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) {
    if (ids[a] < 0 || ids[a] >= X) return ffi::Error::InvalidArgument("expert_matmul: an expert id out of range");
    ++count[ids[a]];
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < X; ++e) {
    start[e + 1] = start[e] + count[e];
    if (count[e]) used.push_back(e);
  }
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[at[ids[a]]++] = a;  // by expert, in assignment order
  }
  std::unique_ptr<float[]> xs(new float[A * K + 1]), ys(new float[A * N + 1]);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const auto product = [&](int64_t e, bool alone) -> ffi::Error {
    const int64_t rows = count[e], s = start[e];
    float* xe = xs.get() + s * K;
    float* ye = ys.get() + s * N;
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(xe + i * K, xp + (per_token ? order[s + i] / k : order[s + i]) * K, K * sizeof(float));
    const int64_t M = computed_rows(xe, rows, K, ye, N);
    const uint8_t* we = w.typed_data() + e * N * B;
    if (M > 0) {
#if defined(__AVX512F__)
      if (gemm_rows > 0 && M >= gemm_rows && !int8_activations) {
        if (auto r = Gemm(pool, xe, we, ye, M, N, K, B, qtype, alone); r.failure()) return r;
      } else
#endif
      if (auto r = Product(pool, xe, we, ye, M, N, K, B, qtype, int8_activations, alone); r.failure()) return r;
    }
    for (int64_t i = 0; i < rows; ++i) std::memcpy(yp + order[s + i] * N, ye + i * N, N * sizeof(float));
    return ffi::Error::Success();
  };
  const int64_t n = static_cast<int64_t>(used.size()), threads = pool_threads(pool);
  if (n < threads) {  // too few to spread: each over every core
    for (int64_t e : used)
      if (auto r = product(e, false); r.failure()) return r;
    return ffi::Error::Success();
  }
  std::mutex failed;
  std::string first;
  parallel_for(pool, threads, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      if (auto r = product(used[i], true); r.failure()) {
        std::lock_guard<std::mutex> hold(failed);
        if (first.empty()) first = std::string(r.message());
      }
  });
  return first.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(first);
}

}  // namespace
}  // namespace pantheon

// The products take x (f32), the blocks (u8) and the qtype, and return y (f32).
static auto product_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
      .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
      .Attr<int64_t>("qtype");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonQMatmul, pantheon::QMatmul, product_binding().Attr<int64_t>("int8_activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonExpertMatmul, pantheon::ExpertMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("int8_activations")
                                  .Attr<int64_t>("gemm_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonDequantize, pantheon::Dequantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("qtype"));

#if defined(__AVX512F__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonQGemm, pantheon::QGemm, product_binding());
#endif

// f32 lanes of the vectors these kernels were built with (build.vector_width): 16 with AVX-512, else 8.
extern "C" int pantheon_vector_width() { return pantheon::kW; }

// 1 where the K-quant products take x as fixed point (AVX-512 VNNI) and read K-tiled blocks.
extern "C" int pantheon_fixed_point() { return pantheon::fixed_k(pantheon::kQ4_K) ? 1 : 0; }
