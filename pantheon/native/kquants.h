// ggml's K-quant super-blocks (256 weights each) as the f32 kernel reads them: a super-block is
// decoded to 256 small integer codes and one scale and min per sub-block (32 weights for Q4_K and
// Q5_K, 16 for Q2_K, Q3_K and Q6_K), as ggml's dequantize_row_* reads them (w = scale * code - min,
// scale = d * sub-scale and min = dmin * sub-min in f32; Q3_K's code already holds its -4). The
// product sums code * x per sub-block in f32, then scales it once: sum_s scale_s * dot_s - min_s *
// sum(x_s), the same value as the dequantized weights' product up to f32 rounding order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "common.h"

namespace pantheon {

// Every cache line of a super-block 2 KiB ahead of the one being read. One line per block (a Q6_K
// block spans four) left the rest to demand misses: Gemma 3 270M's small K-quant products
// (2048 x 640, 1024 x 640, read cold each step) ran at 5-7 GB/s, and its decode step took ~1 ms more.
// 1 KiB ahead was enough on a Zen 4; a Zen 5 computes a super-block in half the time, and the 1 B
// decode step's products streamed ~33 GB/s where two threads read 50-60: 2 KiB (or 4) ahead, the
// 1 B Q4_K_M decode 53.3 / 54.8 / 56.8 -> 58.9 / 59.6 tok/s (alternating runs; Gemma level).
constexpr int64_t kPrefetchAhead = 2048;
template <int64_t bytes>
inline void prefetch_block(const uint8_t* b) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchAhead + o, _MM_HINT_T0);
}

// IQ4_XS reads as one of them: 256-weight super-blocks of eight 32-weight sub-blocks, each with a
// signed 6-bit scale and 4-bit indices into IQ4_NL's table of 16 int8 values (no min).
enum KType : int64_t { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_XS = 23 };

// Q4_0 and Q4_1 (qmatmul.cc's 32-weight blocks) read by the fixed-point kernels (exact numerics on
// AVX-512 VNNI) eight blocks at a time, as a Q4_K super-block with the blocks for its sub-blocks:
// 144 / 160 bytes, the file's, in rows of a multiple of 256 weights.
enum GroupType : int64_t { kG4_0 = 2002, kG4_1 = 2003 };
constexpr bool is_group(int64_t t) { return t == kG4_0 || t == kG4_1; }

constexpr bool is_k(int64_t t) { return (t >= kQ2_K && t <= kQ6_K) || t == kIQ4_XS; }
constexpr bool is_q_k(int64_t t) { return t >= kQ2_K && t <= kQ6_K; }  // Q2_K..Q6_K: the fixed-point kernel's
constexpr int64_t k_bytes(int64_t t) {
  return t == kQ2_K ? 84 : t == kQ3_K ? 110 : t == kQ4_K ? 144 : t == kQ5_K ? 176 : t == kQ6_K ? 210
       : t == kIQ4_XS ? 136 : t == kG4_0 ? 8 * 18 : t == kG4_1 ? 8 * 20 : 0;
}
constexpr int64_t k_sub(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kIQ4_XS || is_group(t) ? 32 : 16; }  // weights per sub-block
constexpr bool has_k_min(int64_t t) { return t == kQ2_K || t == kQ4_K || t == kQ5_K; }

// Blocks tiled K-tile-major (qmatmul.tile_k, long rows loaded for exact numerics): tile i holds
// super-blocks [8 i, 8 i + len_i) of every row, row after row, so a tile's reads are one stream
// while x's planes for it (6.5 KB a row) stay in L1. A row of 8192 in row-major blocks needs 26 KB
// of them, more than L1 holds beside the streaming weights (the down projection ran at 0.48 /
// 0.65 ms for Q4_K / Q6_K against 0.35 / 0.39 for the same bytes in rows of 2048).
constexpr int64_t kTileBlocks = 8;
constexpr int64_t kTiled = 1000;  // a K type's id + kTiled: its blocks tiled so (qmatmul.py TILED)
constexpr bool is_tiled(int64_t t) { return is_q_k(t - kTiled); }

// Columns a row tile of x runs over before the next row tile (common.h: blocked_columns), so the
// tile stays in L1 while the block's weights wait in L2 (32 columns of 2048 Q4_K weights are 37
// KB). The fixed-point kernels (x's planes, 3 bytes a weight: 24 KB for 4 rows of 2048; their
// products under gemm_rows rows), an 8192 x 2048 product at 8 / 16 / 32 rows,
// column by column -> in blocks: Q4_K 0.34 / 0.30 / 0.32 -> 0.21 / 0.24 / 0.29 ms a row, Q6_K 0.33
// / 0.31 / 0.31 -> 0.26 / 0.25 / 0.27 (two Zen 4 threads). The f32 kernels (x as f32, 32 KB for 4
// rows of 2048): IQ4_XS 8192 x 2048 at 16 / 32 / 48 rows 3.7 / 7.9 / 12.0 -> 2.1 / 4.4 / 6.5 ms, Q5_0
// 3.5 / 8.9 / 13.5 -> 2.3 / 4.6 / 7.0 (two Zen 5 threads).
// K-tiled matrices keep tiled_columns' order: their tiles' planes are small already (no gain
// measured); nor do the 8-bit kernels gain (1 byte a weight).
constexpr int64_t kColumnBlock = 32;

// Byte offset of row n's super-block j in a matrix of N rows of nsb super-blocks of bb bytes.
inline int64_t block_offset(bool tiled, int64_t n, int64_t j, int64_t N, int64_t nsb, int64_t bb) {
  if (!tiled) return (n * nsb + j) * bb;
  const int64_t j0 = j / kTileBlocks * kTileBlocks, len = std::min(kTileBlocks, nsb - j0);
  return (N * j0 + n * len + (j - j0)) * bb;
}

struct SuperBlock {
  alignas(32) int8_t q[256];
  float scale[16], min[16];  // per sub-block
};

// IQ4_NL's and IQ4_XS's table (ggml's kvalues_iq4nl): 4-bit indices -> int8 values.
alignas(16) inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};
inline __m128i iq4_table() { return _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)); }

// Indices (bytes 0..15) -> their int8 values.
inline __m128i iq4_values(__m128i idx) { return _mm_shuffle_epi8(iq4_table(), idx); }

// 16 bytes of IQ4 indices (an IQ4_NL block's, an IQ4_XS sub-block's) -> their 32 int8 values in
// weight order: the low nibbles are weights 0-15, the high ones 16-31.
inline __m256i iq4_codes(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(iq4_values(_mm_and_si128(_mm_srli_epi16(raw, 4), m4)), iq4_values(_mm_and_si128(raw, m4)));
}

// IQ4_XS's eight 6-bit scales, centred (-32..31): low 4 bits from scales_l (sub-block i: byte i / 2,
// nibble i % 2), high 2 from scales_h (bits 2i, 2i + 1).
inline void iq4xs_scales(const uint8_t* b, int16_t s[8]) {
  const unsigned h = b[2] | (b[3] << 8);
  for (int i = 0; i < 8; ++i) s[i] = static_cast<int16_t>((((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((h >> (2 * i)) & 3) << 4)) - 32);
}

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4, four at a time:
// bytes 0-3 hold scales 0-3, 4-7 mins 0-3, and their top two bits the high bits of sub-blocks 4-7, whose
// low four bits are in bytes 8-11).
inline void k4_scale_bytes(const uint8_t* s12, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t u[3];
  std::memcpy(u, s12, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const uint32_t sc_lo = u[0] & m6, mn_lo = u[1] & m6;  // sub-blocks 0-3
  const uint32_t sc_hi = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);  // 4-7: low bits from bytes 8-11
  const uint32_t mn_hi = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
  std::memcpy(sc, &sc_lo, 4), std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4), std::memcpy(mn + 4, &mn_hi, 4);
}

// Q3_K's 16 six-bit sub-block scales (12 bytes at 96), unpacked and centred (-32..31), in a
// register: written as four words and read back as one vector they stall the load (no store
// forwarding), which cost the AVX2 Q3_K row tile ~40 % of its time.
inline __m128i q3k_scales16(const uint8_t* b) {
  uint32_t a[3];
  std::memcpy(a, b + 96, 12);
  const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
  const __m128i s = _mm_setr_epi32(static_cast<int>((a[0] & k2) | ((a[2] & k1) << 4)),
                                   static_cast<int>((a[1] & k2) | (((a[2] >> 2) & k1) << 4)),
                                   static_cast<int>(((a[0] >> 4) & k2) | (((a[2] >> 4) & k1) << 4)),
                                   static_cast<int>(((a[1] >> 4) & k2) | (((a[2] >> 6) & k1) << 4)));
  return _mm_sub_epi8(s, _mm_set1_epi8(32));
}
inline void q3k_scales(const uint8_t* b, int8_t s[16]) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(s), q3k_scales16(b));
}

// A Q6_K super-block's 256 six-bit codes, unsigned (0..63, before ggml's -32), in weight order as
// 8 x 32 bytes: per half of 128 weights, 4 bits from ql (64 bytes at 64h) and 2 from qh (32 at 128 + 32h).
inline void q6k_codes(const uint8_t* b, __m256i q[8]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const auto high = [&](int shift) {  // ((qh >> shift) & 3) << 4, per byte
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, shift), m2), 4);
    };
    q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), high(0));
    q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), high(2));
    q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4));
    q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6));
  }
}

// The 16-weight sub-block types' unsigned codes, 32 a vector in weight order (Q6_K 0..63, Q3_K 0..7
// before ggml's -32 and -4: code_offset; Q2_K 0..3).
constexpr int code_offset(int64_t t) { return t == kQ6_K ? 32 : t == kQ3_K ? 4 : 0; }
template <int64_t t>
inline void sub16_codes(const uint8_t* b, __m256i q[8]) {
  if constexpr (t == kQ6_K) {
    q6k_codes(b, q);
  } else {
    const __m256i m2 = _mm256_set1_epi8(3);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));  // Q3_K's high bits
    for (int n = 0; n < 2; ++n) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (t == kQ3_K ? 32 : 16) + 32 * n));
      for (int j = 0; j < 4; ++j) {
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), m2);
        if constexpr (t == kQ3_K) {  // + 4 where the hmask bit is set
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (4 * n + j)));
          q[4 * n + j] = _mm256_or_si256(low, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit),
                                                               _mm256_set1_epi8(4)));
        } else {
          q[4 * n + j] = low;
        }
      }
    }
  }
}

// Q2_K's and Q3_K's sub-block scales (and Q2_K's mins), 16 of each.
template <int64_t t>
inline void decode_scales_k(const uint8_t* b, SuperBlock& o) {
  if constexpr (t == kQ3_K) {
    const float d = fp16_at(b + 108);
    int8_t s[16];
    q3k_scales(b, s);
    for (int k = 0; k < 16; ++k) o.scale[k] = d * static_cast<float>(s[k]), o.min[k] = 0.f;
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
    alignas(16) uint8_t sc[8], mn[8];
    k4_scale_bytes(b + 4, sc, mn);
    const auto f32x8 = [](const uint8_t* v) {
      return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
    };
    store8(o.scale, (v8f{} + d) * f32x8(sc));
    store8(o.min, (v8f{} + dmin) * f32x8(mn));
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
  } else if constexpr (t == kIQ4_XS) {  // per sub-block: 16 bytes of nibbles, low ones weights 0-15
    const float d = fp16_at(b);
    int16_t s[8];
    iq4xs_scales(b, s);
    for (int i = 0; i < 8; ++i) {
      o.scale[i] = d * static_cast<float>(s[i]), o.min[i] = 0.f;
      _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 32 * i), iq4_codes(b + 8 + 16 * i));
    }
  } else {  // Q2_K, Q3_K, Q6_K: the unsigned codes less their offset (ggml's signed codes)
    if constexpr (t == kQ6_K) {
      const float d = fp16_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int k = 0; k < 16; ++k) o.scale[k] = d * static_cast<float>(sc[k]), o.min[k] = 0.f;
    } else {
      decode_scales_k<t>(b, o);
    }
    const __m256i off = _mm256_set1_epi8(code_offset(t));
    __m256i q[8];
    sub16_codes<t>(b, q);
    for (int v = 0; v < 8; ++v)
      _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 32 * v), _mm256_sub_epi8(q[v], off));
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
// Where the CPU has AVX-512 the vectors are 16 wide (half the conversions and multiply-adds: a
// 16384 x 2048 Q4_K product at batch 1 2.2 ms a thread against 2.7 on a Zen 4), else 8 wide.
#if defined(__AVX512F__)
typedef __m512 vkf;
constexpr int kW = 16;
inline vkf k_mul(vkf a, vkf b) { return _mm512_mul_ps(a, b); }
inline vkf k_fma(vkf a, vkf b, vkf c) { return _mm512_fmadd_ps(a, b, c); }
inline vkf k_load(const float* p) { return _mm512_loadu_ps(p); }
inline vkf k_set1(float v) { return _mm512_set1_ps(v); }
inline vkf k_codes(const SuperBlock& sb, int v) {  // codes 16v..16v+15 as f32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sb.q + 16 * v))));
}
inline float k_hsum(vkf v) {  // a fixed tree: the two 8-lane halves added, then hsum's
  return hsum((v8f)_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#else
typedef v8f vkf;
constexpr int kW = 8;
inline vkf k_mul(vkf a, vkf b) { return a * b; }
inline vkf k_fma(vkf a, vkf b, vkf c) { return fma8(a, b, c); }
inline vkf k_load(const float* p) { return load8(p); }
inline vkf k_set1(float v) { return v8f{} + v; }
inline vkf k_codes(const SuperBlock& sb, int v) { return code_f32(sb, v); }
inline float k_hsum(vkf v) { return hsum(v); }
#endif

#if defined(__AVX512F__)
// ---- AVX-512: 4-bit codes looked up straight into f32 (f32 activations) -------------------------
// Where a code is a nibble (Q4_K and IQ4_XS), vpermps turns 16 of them into f32 at once from a
// 16-entry table (0..15, or IQ4's values) with the nibbles as indices. It reads only an index's low
// 4 bits, so a dword shifted right brings a nibble down with no mask: one shift and one lookup per
// 16 codes, against codes_k's unpacking plus a widening and a conversion. The codes come out in the
// order their nibbles sit in the dwords, so x is permuted once per call to that order (lut_order);
// the sums are then as ktile's (per sub-block, scaled once; the min term from x's sub-block sums).
// A row's sums run over the same vectors in the same order in every tile, so the batch never
// changes a row. 8192 x 2048 on one Zen 4 thread, one row / four: Q4_K 1.08 -> 1.03 / 3.15 -> 2.20 ms,
// IQ4_XS 1.13 -> 1.09 / 2.93 -> 2.16. (What it saves is codes_k's trip through memory: Q4_1's
// 32-weight blocks, split in registers already, ran 20 % slower looked up, so they are not.)
//
// The order, per 32-weight sub-block, lane L of vector v (0, 1):
//  - Q4_K: a 32-byte chunk of codes broadcast to both halves of the register, low nibbles one
//    sub-block, high nibbles the next: weight 4 (L % 8) + 2 v + L / 8.
//  - IQ4_XS: a sub-block's 16 bytes (low nibbles weights 0-15) broadcast to the four 128-bit
//    quarters: weight 16 v + 4 (L % 4) + L / 4.
constexpr bool lut_k(int64_t t) { return t == kQ4_K || t == kIQ4_XS; }

// x [rows, K] -> xp in the order the lookups produce the codes (K a multiple of 32): Q4_K's
// (chunk32) or IQ4_XS's.
inline void lut_order(bool chunk32, const float* x, float* xp, int64_t rows, int64_t K) {
  int src[32];
  for (int v = 0; v < 2; ++v)
    for (int L = 0; L < 16; ++L) src[16 * v + L] = chunk32 ? 4 * (L % 8) + 2 * v + L / 8 : 16 * v + 4 * (L % 4) + L / 4;
  for (int64_t g = 0; g < rows * K / 32; ++g)
    for (int k = 0; k < 32; ++k) xp[32 * g + k] = x[32 * g + src[k]];
}

// A Q4_K super-block's sub-block scales d * sc (lanes 0-7) and mins dmin * mn (lanes 8-15), as
// codes_k computes them.
inline __m512 q4k_scales16(const uint8_t* b) {
  alignas(16) uint8_t bytes[16];  // scales 0-7, then mins 0-7
  k4_scale_bytes(b + 4, bytes, bytes + 8);
  const __m512 dm = _mm512_insertf32x8(_mm512_set1_ps(fp16_at(b)), _mm256_set1_ps(fp16_at(b + 2)), 1);
  return _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes)))));
}

inline __m512 lut_iq4() { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(iq4_table())); }  // the table as f32

// 16 bytes of nibbles (low ones weights 0-15) -> 32 entries of `table` as two vectors, lut order.
inline void lut_block16(const uint8_t* qs, __m512 table, __m512 c[2]) {
  const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i s = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
  c[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(raw, s), table);
  c[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(raw, _mm512_add_epi32(s, _mm512_set1_epi32(4))), table);
}

// Quarter q (sub-blocks 2q and 2q + 1) of a super-block's codes as four f32 vectors, lut order.
template <int64_t t>
inline void lut_codes(const uint8_t* b, int q, __m512 c[4]) {
  if constexpr (t == kQ4_K) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * q)));
    const __m512i s = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    for (int i = 0; i < 4; ++i)  // shifts 0|8, 16|24 (low nibbles), 4|12, 20|28 (high)
      c[i] = _mm512_permutexvar_ps(_mm512_srlv_epi32(raw, _mm512_add_epi32(s, _mm512_set1_epi32(16 * (i % 2) + 4 * (i / 2)))), table);
  } else {
    for (int h = 0; h < 2; ++h) lut_block16(b + 8 + 16 * (2 * q + h), lut_iq4(), c + 2 * h);
  }
}

// R rows m0.. (xp in lut order; xsum: x's sums per 32, Q4_K's min term) of output column n.
template <int64_t t, int64_t R>
inline void lut_ktile(const float* xp, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K,
                      int64_t m0, int64_t n) {
  constexpr int64_t bb = k_bytes(t);
  __m512 acc[R][2];
  __m256 macc[R];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps(), macc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < K / 256; ++j) {
    const uint8_t* b = wrow + j * bb;
    prefetch_block<bb>(b);
    alignas(64) float sm[16];  // scales, then (Q4_K) mins
    if constexpr (t == kQ4_K) {
      _mm512_store_ps(sm, q4k_scales16(b));
    } else {
      int16_t s[8];
      iq4xs_scales(b, s);
      const float d = fp16_at(b);
      for (int k = 0; k < 8; ++k) sm[k] = d * static_cast<float>(s[k]);
    }
    for (int q = 0; q < 4; ++q) {
      __m512 c[4];
      lut_codes<t>(b, q, c);
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = xp + (m0 + r) * K + j * 256 + 64 * q;
        const __m512 lo = _mm512_fmadd_ps(c[1], _mm512_loadu_ps(xr + 16), _mm512_mul_ps(c[0], _mm512_loadu_ps(xr)));
        const __m512 hi = _mm512_fmadd_ps(c[3], _mm512_loadu_ps(xr + 48), _mm512_mul_ps(c[2], _mm512_loadu_ps(xr + 32)));
        acc[r][0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(sm[2 * q]), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(sm[2 * q + 1]), acc[r][1]);
      }
    }
    if constexpr (t == kQ4_K) {
      const __m256 mins = _mm256_load_ps(sm + 8);
      for (int64_t r = 0; r < R; ++r)
        macc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + (m0 + r) * (K / 32) + 8 * j), macc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    y[(m0 + r) * N + n] = k_hsum(_mm512_add_ps(acc[r][0], acc[r][1])) - hsum((v8f)macc[r]);
}

// Q6_K, its codes kept in registers (q6k_codes) and each 16 weights dequantized once for the
// tile's rows, as ggml computes them ((d * sc) * (code - 32): the reference's values, bit for bit),
// then one multiply-add a row (ktile scales each row's sums per 16). 8192 x 2048 on one Zen 4
// thread, one row / four: 1.42 -> 1.36 / 4.05 -> 3.18 ms.
template <int64_t R>
inline void q6k_ktile(const float* x, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  constexpr int64_t bb = k_bytes(kQ6_K);
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m256i off = _mm256_set1_epi8(32);
  for (int64_t j = 0; j < K / 256; ++j) {
    const uint8_t* b = wrow + j * bb;
    prefetch_block<bb>(b);
    alignas(64) float sc[16];  // d * sc, per 16 weights
    _mm512_store_ps(sc, _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 208)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))))));
    __m256i q[8];
    q6k_codes(b, q);
    for (int v = 0; v < 8; ++v) {
      const __m256i c = _mm256_sub_epi8(q[v], off);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))), _mm512_set1_ps(sc[2 * v]));
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))), _mm512_set1_ps(sc[2 * v + 1]));
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * K + j * 256 + 32 * v;
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = k_hsum(_mm512_add_ps(acc[r][0], acc[r][1]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANTHEON_FIXED_K 1
// ---- AVX-512 VNNI: x as 23-bit fixed point, exact integer products ------------------------------
// Q4_K, Q5_K and Q6_K at one row were bound by the f32 kernel's instructions: every code converted
// to f32 and multiplied in f32. Here each 32 of x share a power of two: x = X * 2^(e-22) with
// |x| < 2^e, X an integer of at most 23 bits (rounded to nearest), held as three int8 planes (X =
// c2 * 2^16 + c1 * 2^8 + c0, c0 and c1 in -128..127). A sub-block's dot product is then an exact
// integer sum: vpdpbusd multiplies 64 codes by 64 plane bytes an instruction, the planes' sums
// combined in int32 (c2's shifted before c1's are added, then c0's); one conversion and one
// multiply-add apply d * sc times x's power of two. Only x's rounding to 23 bits of its 32's
// largest element differs from the f32 product; measured against float64, the error is the f32
// kernel's or smaller (test_native). A row's sums run over the same vectors in the same order in
// every tile, so a row never depends on its batch. 8192 x 2048 (cold, two Zen 4 threads), one row /
// four, f32 kernel -> this: Q4_K 0.54 -> 0.35 / 1.44 -> 0.80 ms, Q6_K 0.73 -> 0.39 / 1.50 -> 1.01;
// the 1 B-shape Q4_K_M decode step 42-43 -> 31 ms.
constexpr bool fixed_k(int64_t t) { return is_q_k(t) || is_group(t); }

// x's rows: per 64 weights, planes c2, c1, c0 (64 bytes each; in weight order for Q6_K, `sub` 16;
// for Q4_K/Q5_K, `sub` 32, a super-block's four vectors v hold weights 32 s + 8 v + i at byte
// 8 s + i, so that every vector's int32 lane L sums sub-block L / 2); per 256, 16 f32
// lanes of each sub-block's power of two relative to its row's largest, 2^(e - e_row) (`sub` 32:
// lanes 0-7, the rest 1; 16: lane i holds its 32's), NaN for a 32 that holds a NaN or an
// infinity, so the product is NaN as the f32 one would be; per row, 2^(e_row - 22), which scales
// its results once (the sums run relative to the row's largest 32, so no scale is subnormal where
// the row is not: a row of 1e-30 keeps its precision). 3.25 bytes a weight.
struct FixedRows {
  const int8_t* planes;     // [M * K / 64, 192]
  const float* scale;       // [M * K / 256, 16]
  const float* row_scale;   // [M]
};

// xsum: the rounded x's sums per `sub` (the min or -32 term), relative to the row as the products
// are: exact integer sums scaled once, so the product is the weights' exact product with the
// rounded x up to f32's rounding of the sums.
inline void fixed_rows(const float* x, int64_t M, int64_t K, int64_t sub, int8_t* planes, float* scale, float* row_scale,
                       float* xsum) {
  constexpr int kZeros = -1000, kNonFinite = -1001;  // a 32's exponent where it has none
  std::unique_ptr<int[]> exps(new int[K / 32]);
  for (int64_t m = 0; m < M; ++m) {
    int e_row = kZeros;
    for (int64_t i = 0; i < K / 32; ++i) {  // each 32's exponent: its largest |x| < 2^e
      const float* xg = x + m * K + 32 * i;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const bool finite = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_sub_ps(a, a), _mm512_sub_ps(b, b)), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      int e = finite ? kZeros : kNonFinite;
      if (finite && amax > 0.f) std::frexp(amax, &e);
      exps[i] = e, e_row = e > e_row ? e : e_row;
    }
    if (e_row == kZeros) e_row = 0;
    row_scale[m] = std::ldexp(1.f, e_row - 22);
    for (int64_t i = 0; i < K / 32; ++i) {
      const int64_t g = m * (K / 32) + i;  // the 32's index over all rows
      const bool bad = exps[i] == kNonFinite;
      const int e = bad ? 0 : exps[i] == kZeros ? e_row : exps[i];
      const float rel = bad ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.f, e - e_row);
      // x * 2^(22-e) is exact (a power of two, in range for every finite f32 once taken in two steps)
      const __m512 s1 = _mm512_set1_ps(std::ldexp(1.f, (22 - e) / 2)), s2 = _mm512_set1_ps(std::ldexp(1.f, (22 - e) - (22 - e) / 2));
      const float* xg = x + 32 * g;
      // natural order: 32s at 32 (g % 2) of their 64's planes; by sub-block: 8-weight pieces v of
      // sub-block s at 8 s of the super-block's vector v
      int8_t* p = sub == 16 ? planes + 192 * (g / 2) + 32 * (g % 2) : planes + 768 * (g / 8) + 8 * (g % 8);
      const auto put = [&](int8_t* at, int h, __m128i bytes) {
        if (sub == 16) return _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 16 * h), bytes);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(at + 192 * (2 * h)), bytes);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(at + 192 * (2 * h + 1)), _mm_unpackhi_epi64(bytes, bytes));
      };
      for (int h = 0; h < 2; ++h) {
        const __m512i X = bad ? _mm512_setzero_si512() : _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + 16 * h), s1), s2));
        const int32_t total = _mm512_reduce_add_epi32(X);  // |X| <= 2^22: 16 of them fit
        if (sub == 16) xsum[2 * g + h] = static_cast<float>(total) * rel;
        else if (h == 0) xsum[g] = static_cast<float>(total);
        else xsum[g] = (xsum[g] + static_cast<float>(total)) * rel;  // the two halves' sum: exact below 2^24
        const __m512i c0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);  // the low byte, signed
        const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, c0), 8);
        const __m512i c1 = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
        const __m512i c2 = _mm512_srai_epi32(_mm512_sub_epi32(X1, c1), 8);
        put(p, h, _mm512_cvtepi32_epi8(c2)), put(p + 64, h, _mm512_cvtepi32_epi8(c1)), put(p + 128, h, _mm512_cvtepi32_epi8(c0));
      }
      float* sv = scale + 16 * (g / 8);
      if (sub == 32)
        sv[g % 8] = rel, sv[8 + g % 8] = 1.f;
      else
        sv[2 * (g % 8)] = sv[2 * (g % 8) + 1] = rel;
    }
  }
}

// The exact integer dot of 64 codes (u8) with a 64-weight span's three planes, per 4 weights (16
// int32 lanes), as f32.
inline __m512 fixed_dot(__m512i codes, const int8_t* p) {
  __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(p));
  d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 8), codes, _mm512_loadu_si512(p + 64));
  d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 8), codes, _mm512_loadu_si512(p + 128));
  return _mm512_cvtepi32_ps(d);
}

// Per 16-bit word, a shift for the low 256 bits and another for the high.
inline __m512i halves16(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(lo)), _mm256_set1_epi16(static_cast<short>(hi)), 1);
}

// Q6_K's weights 64 q .. 64 q + 63 as unsigned codes (0..63, before ggml's -32) in weight order: 64
// bytes of ql (low nibbles for the first 64 of a 128, high for the second) and qh's 2-bit pairs
// moved to bits 4-5. Word shifts move bits across bytes; the mask keeps only those that belong.
inline __m512i fixed_codes6(const uint8_t* b, int q) {
  const int h = q / 2, v = q % 2;
  const __m512i ql = _mm512_loadu_si512(b + 64 * h);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
  const __m512i high = _mm512_and_si512(v ? _mm512_srlv_epi16(qh, halves16(0, 2)) : _mm512_sllv_epi16(qh, halves16(4, 2)),
                                        _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(v ? _mm512_srli_epi16(ql, 4) : ql, high, _mm512_set1_epi8(0x0F), 0xEC);  // (a & c) | b
}

// A row's sums for one output column, carried from one K tile of blocks to the next.
struct FixedAcc {
  __m512 acc;   // the products
  __m512 macc;  // Q6_K's -32 term (16 lanes), Q4_K/Q5_K's min term (the low 8)
};

// Q4_K/Q5_K, the codes in x's sub-block order (fixed_rows, `sub` 32): every vector's lane L sums
// 4 codes of sub-block L / 2, so a super-block's four vectors add up in int32 with no scale between
// them (each plane's 16 products a lane: at most 16 * 31 * 2^22 < 2^31 once combined), and the
// sums are combined, converted and scaled once a super-block, not once a vector: per row 12
// vpdpbusd and 6 other operations a super-block. Vector v's codes: qword v of each 32-byte group
// of qs (a transpose, one vpermt2q), low nibbles for the even sub-block, high for the odd; Q5_K's
// fifth bit for sub-block s is bit s of qh's byte 8 v + i.
template <int64_t t>
inline __m512i fixed_codes32(__m512i z0, __m512i z1, const uint8_t* b, int v) {
  const __m512i idx = _mm512_setr_epi64(v, v, 4 + v, 4 + v, 8 + v, 8 + v, 12 + v, 12 + v);
  const __m512i raw = _mm512_permutex2var_epi64(z0, idx, z1);
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi64(raw, _mm512_setr_epi64(0, 4, 0, 4, 0, 4, 0, 4)), _mm512_set1_epi8(0x0F));
  if constexpr (t == kQ4_K) return low;
  uint64_t h8;
  std::memcpy(&h8, b + 16 + 8 * v, 8);
  const __m512i bit = _mm512_slli_epi64(_mm512_srlv_epi64(_mm512_set1_epi64(static_cast<long long>(h8)), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)), 4);
  return _mm512_ternarylogic_epi32(low, bit, _mm512_set1_epi8(0x10), 0xF8);  // a | (b & c)
}

// Lane L of a Q4_K/Q5_K codes vector sums sub-block L / 2: the lanes' scales, from 8 of them.
inline __m512i lane_sub32() { return _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7); }

// A super-block's (or eight Q4_0/Q4_1 blocks') codes in x's sub-block order, four vectors, and its
// scales by sub-block: lanes 0-7 each sub-block's, 8-15 its min term (weight = scale * code - min).
// A Q4_0/Q4_1 block's 16 bytes hold weights 0-15 in their low nibbles and 16-31 in their high
// ones: vector v's qword s is block s's bytes 8 (v % 2) .. + 7, shifted by 4 (v / 2). Q4_0's min
// is 8 d (its codes centred), Q4_1's -m.
template <int64_t t>
inline __m512 fixed_group(const uint8_t* b, __m512i codes[4]) {
  if constexpr (is_group(t)) {
    constexpr int64_t bb = k_bytes(t) / 8, at = t == kG4_0 ? 2 : 4;
    const auto qs = [&](int s) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bb * s + at)); };
    __m512i z0 = _mm512_castsi128_si512(qs(0)), z1 = _mm512_castsi128_si512(qs(4));
    z0 = _mm512_inserti32x4(z0, qs(1), 1), z1 = _mm512_inserti32x4(z1, qs(5), 1);
    z0 = _mm512_inserti32x4(z0, qs(2), 2), z1 = _mm512_inserti32x4(z1, qs(6), 2);
    z0 = _mm512_inserti32x4(z0, qs(3), 3), z1 = _mm512_inserti32x4(z1, qs(7), 3);
    for (int v = 0; v < 4; ++v) {
      const __m512i idx = _mm512_add_epi64(_mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), _mm512_set1_epi64(v % 2));
      const __m512i raw = _mm512_permutex2var_epi64(z0, idx, z1);
      codes[v] = _mm512_and_si512(v < 2 ? raw : _mm512_srli_epi64(raw, 4), _mm512_set1_epi8(0x0F));
    }
    alignas(32) uint16_t h[16];  // d of each block, then Q4_0's d again or Q4_1's m
    for (int s = 0; s < 8; ++s) std::memcpy(h + s, b + bb * s, 2), std::memcpy(h + 8 + s, b + bb * s + (t == kG4_0 ? 0 : 2), 2);
    const __m512 dm = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
    const float lo = 1.f, hi = t == kG4_0 ? 8.f : -1.f;
    return _mm512_mul_ps(dm, _mm512_setr_ps(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
  } else {
    const uint8_t* qs = b + (t == kQ4_K ? 16 : 48);
    const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
    for (int v = 0; v < 4; ++v) codes[v] = fixed_codes32<t>(z0, z1, b, v);
    return q4k_scales16(b);  // d * sc (lanes 0-7), dmin * mn (8-15)
  }
}

template <int64_t t, int64_t R>
inline void fixed_ktile32(const FixedRows& xf, const float* xsum, const uint8_t* wblocks, int64_t K, int64_t m0,
                          int64_t j0, int64_t j1, FixedAcc* st) {
  constexpr int64_t bb = k_bytes(t);
  const __m512i lane_sub = lane_sub32();
  __m512 acc[R];
  __m256 macc[R];  // the min term
  for (int64_t r = 0; r < R; ++r) acc[r] = st[r].acc, macc[r] = _mm512_castps512_ps256(st[r].macc);
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* b = wblocks + (j - j0) * bb;
    prefetch_block<bb>(b);
    __m512i codes[4];
    const __m512 s16 = fixed_group<t>(b, codes);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t sb = ((m0 + r) * K) / 256 + j;  // x's super-block
      const int8_t* p = xf.planes + 768 * sb;
      __m512i d2 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512(), d0 = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        d2 = _mm512_dpbusd_epi32(d2, codes[v], _mm512_loadu_si512(p + 192 * v));
        d1 = _mm512_dpbusd_epi32(d1, codes[v], _mm512_loadu_si512(p + 192 * v + 64));
        d0 = _mm512_dpbusd_epi32(d0, codes[v], _mm512_loadu_si512(p + 192 * v + 128));
      }
      const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(d2, 8), d1), 8), d0);
      const __m512 sx = _mm512_mul_ps(s16, _mm512_loadu_ps(xf.scale + 16 * sb));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(lane_sub, sx), acc[r]);
      macc[r] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(s16, 1), _mm256_loadu_ps(xsum + (m0 + r) * (K / 32) + 8 * j), macc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) st[r].acc = acc[r], st[r].macc = _mm512_castps256_ps512(macc[r]);
}

// The 16-weight sub-block types (Q2_K, Q3_K, Q6_K) in weight order (`sub` 16): a super-block's
// unsigned codes, 64 a vector (weights 64 q .. 64 q + 63), its scale per 16 (lanes) and the
// coefficient of x's sum over each 16: w = scale * code - term_scale(t) * term. Q6_K: d * sc and
// code - 32, Q3_K: d * sc and code - 4 (the hmask bit set adds 4), both with term = scale; Q2_K:
// d * sc and dmin * mn. Lane L of vector q's dot products sums sub-block 4 q + L / 4
// (lane_sub16() + 4 q). Shared by the row tiles and the GEMM.
constexpr float term_scale(int64_t t) { return t == kQ6_K ? 32.f : t == kQ3_K ? 4.f : 1.f; }
inline __m512 q6k_scales16(const uint8_t* b) {
  return _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 208)),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
}
template <int64_t t>
inline __m512 scales16(const uint8_t* b, __m512& term) {
  if constexpr (t == kQ6_K) {
    return term = q6k_scales16(b);
  } else if constexpr (t == kQ3_K) {
    return term = _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 108)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3k_scales16(b))));
  } else {  // Q2_K: a byte per 16, the scale in its low nibble and the min in its high one
    const __m512i sm = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    term = _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4)));
    return _mm512_mul_ps(_mm512_set1_ps(fp16_at(b + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(0xF))));
  }
}
inline __m512i lane_sub16() { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }

// Q2_K/Q3_K: vector q's 64 weights are groups 2 v and 2 v + 1 (v = q % 2) of 128-weight half n =
// q / 2, each 32 bytes of qs (at 32 n) shifted by 2 per group: the 32 bytes in both halves of the
// register, shifted 4 v in the low half and 4 v + 2 in the high one. Q3_K's third bit is hmask bit
// 4 n + group of the same byte index (0..31), moved to bit 2. Word shifts move bits across bytes;
// the masks keep only those that belong.
template <int64_t t>
inline __m512i fixed_codes16(const uint8_t* b, int q) {
  if constexpr (t == kQ6_K) return fixed_codes6(b, q);
  const int n = q / 2, v = q % 2;
  const auto both = [](const uint8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(both(b + (t == kQ3_K ? 32 : 16) + 32 * n), halves16(4 * v, 4 * v + 2)),
                                       _mm512_set1_epi8(0x03));
  if constexpr (t == kQ2_K) return low;
  const int bit = 4 * n + 2 * v;  // the low half's; the high half's is the next
  const __m512i hm = both(b);
  const __m512i at2 = bit >= 2 ? _mm512_srlv_epi16(hm, halves16(bit - 2, bit - 1)) : _mm512_sllv_epi16(hm, halves16(2, 1));
  return _mm512_ternarylogic_epi32(low, at2, _mm512_set1_epi8(0x04), 0xF8);  // a | (b & c)
}

// Q2_K/Q3_K/Q6_K in weight order (`sub` 16): 64 codes a vector, lanes 4 i .. 4 i + 3 sub-block
// 4 q + i; each vector's three planes combined in int32 (4 products a lane: at most 4 * 63 * 2^22)
// and scaled at once. (Q6_K's codes in sub-block order, as Q4_K's, cost more to gather from ql/qh
// than they save: 0.39 -> 0.51 ms for an 8192 x 2048 product at one row.) xsum: x's sums per 16,
// for the term.
template <int64_t t, int64_t R>
inline void fixed_ktile16(const FixedRows& xf, const float* xsum, const uint8_t* wblocks, int64_t K, int64_t m0,
                          int64_t j0, int64_t j1, FixedAcc* st) {
  constexpr int64_t bb = k_bytes(t);
  const __m512i lane_sub = lane_sub16();
  __m512 acc[R], macc[R];  // macc: the term
  for (int64_t r = 0; r < R; ++r) acc[r] = st[r].acc, macc[r] = st[r].macc;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* b = wblocks + (j - j0) * bb;
    prefetch_block<bb>(b);
    __m512 term;
    const __m512 s16 = scales16<t>(b, term);  // d * sc per 16
    __m512 sx[R];  // per row: d * sc * x's power of two, by sub-block
    for (int64_t r = 0; r < R; ++r) sx[r] = _mm512_mul_ps(s16, _mm512_loadu_ps(xf.scale + 16 * (((m0 + r) * K) / 256 + j)));
    for (int q = 0; q < 4; ++q) {
      const __m512i codes = fixed_codes16<t>(b, q);
      const __m512i lanes = _mm512_add_epi32(lane_sub, _mm512_set1_epi32(4 * q));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t span = ((m0 + r) * K + j * 256) / 64 + q;
        acc[r] = _mm512_fmadd_ps(fixed_dot(codes, xf.planes + 192 * span), _mm512_permutexvar_ps(lanes, sx[r]), acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r)  // sum_s term_s * sum(x over s), times term_scale at the end
      macc[r] = _mm512_fmadd_ps(term, _mm512_loadu_ps(xsum + (m0 + r) * (K / 16) + 16 * j), macc[r]);
  }
  for (int64_t r = 0; r < R; ++r) st[r].acc = acc[r], st[r].macc = macc[r];
}

// ---- Many rows (a prefill chunk): the same products as a GEMM over columns decoded once ----------
// The row tiles above load three planes of x for every three vpdpbusd (one column at a time) and
// decode a column's codes again for every four rows: from 8 rows on, 24-35 cycles a row and
// super-block (one Zen 4 thread), where the vpdpbusd alone need 12. Here a block of columns is
// decoded once for all rows (codes in fixed_codes32's order, scales by lane), and a 2-row x
// 4-column tile loads each plane once for four columns' vpdpbusd and each column's codes once for
// two rows: 18-25 cycles from 8 rows to 512 (at 2 to 6 rows the decoding costs more than it saves,
// 25-40 against 20-32; other tiles, 1 x 4, 1 x 8, 2 x 2, 3 x 2, ran level or, 4 x 2, spilled
// registers). The 1 B-shape Q4_K_M model's exact prefill, 16 / 32 / 64 tokens: 332 / 589 / 1612 ->
// 241 / 497 / 944 ms (with the kernel now taking up to 256 rows, qmatmul.GEMM_KERNEL_ROWS). Every product's
// arithmetic is fixed_ktile32's, bit for bit: the same exact integer sums, combined, converted and
// scaled by the same values (permuting lanes commutes with the lane-wise product of the two scales)
// in the same order, so a row's result does not depend on which path its batch took.
struct DecodedK4 {  // one column's super-block
  __m512i codes[4];
  __m512 scale;  // d * sc, by lane (lane L: sub-block L / 2)
  __m256 mins;   // dmin * mn
};

template <int64_t t>
inline void decode_k4(const uint8_t* b, DecodedK4& o) {
  const __m512 s16 = fixed_group<t>(b, o.codes);
  o.scale = _mm512_permutexvar_ps(lane_sub32(), s16);
  o.mins = _mm512_extractf32x8_ps(s16, 1);
}

// Rows m0 .. m0 + R - 1 against C decoded columns (col[c * nsb + j]: column c's super-block j), all
// nsb super-blocks, into st[r * C + c].
template <int64_t R, int64_t C>
inline void fixed_gemm32(const FixedRows& xf, const float* xsum, const DecodedK4* col, int64_t nsb, int64_t K,
                         int64_t m0, FixedAcc* st) {
  __m512 acc[R * C];
  for (int64_t i = 0; i < R * C; ++i) acc[i] = st[i].acc;
  for (int64_t j = 0; j < nsb; ++j) {
    __m512i d[R][C][3];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) d[r][c][0] = d[r][c][1] = d[r][c][2] = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      __m512i codes[C];
      for (int64_t c = 0; c < C; ++c) codes[c] = col[c * nsb + j].codes[v];
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* p = xf.planes + 768 * (((m0 + r) * K) / 256 + j) + 192 * v;
        for (int k = 0; k < 3; ++k) {
          __m512i plane = _mm512_loadu_si512(p + 64 * k);
          __asm__("" : "+v"(plane));  // one load for the C columns, not one folded into each
          for (int64_t c = 0; c < C; ++c) d[r][c][k] = _mm512_dpbusd_epi32(d[r][c][k], codes[c], plane);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t sb = ((m0 + r) * K) / 256 + j;
      const __m512 xs = _mm512_permutexvar_ps(lane_sub32(), _mm512_loadu_ps(xf.scale + 16 * sb));
      const __m256 x8 = _mm256_loadu_ps(xsum + (m0 + r) * (K / 32) + 8 * j);
      for (int64_t c = 0; c < C; ++c) {
        const DecodedK4& w = col[c * nsb + j];
        const __m512i dd = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(d[r][c][0], 8), d[r][c][1]), 8), d[r][c][2]);
        acc[r * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), _mm512_mul_ps(w.scale, xs), acc[r * C + c]);
        FixedAcc& a = st[r * C + c];
        a.macc = _mm512_castps256_ps512(_mm256_fmadd_ps(w.mins, x8, _mm512_castps512_ps256(a.macc)));
      }
    }
  }
  for (int64_t i = 0; i < R * C; ++i) st[i].acc = acc[i];
}

// Q2_K/Q3_K/Q6_K the same way (`sub` 16, codes in weight order): a column's super-block decoded once
// (fixed_codes16's four vectors, scales16's scale and term per 16), a 2-row x 4-column tile loading
// each plane once for four columns. A product's arithmetic is fixed_ktile16's, bit for bit: per 64
// weights the same exact integer sum, converted and multiply-added with d * sc times x's power of
// two (permuted to the vector's lanes: permuting commutes with the lane-wise product), then the
// term once a super-block, in the same order. 2048 x 8192 (K-tiled) at 16 / 64 rows: 4.0 / 16.6
// -> 2.0 / 7.8 ms (two Zen 5 threads; dequantize + GEMM 6.9 / 10.7).
struct DecodedK16 {  // one column's super-block
  __m512i codes[4];  // weights 64 q .. 64 q + 63
  __m512 scale;      // d * sc per 16 weights
  __m512 term;       // the term's coefficient per 16 (scales16)
};

template <int64_t t>
inline void decode_k16(const uint8_t* b, DecodedK16& o) {
  for (int q = 0; q < 4; ++q) o.codes[q] = fixed_codes16<t>(b, q);
  o.scale = scales16<t>(b, o.term);
}

template <int64_t R, int64_t C>
inline void fixed_gemm16(const FixedRows& xf, const float* xsum, const DecodedK16* col, int64_t nsb, int64_t K,
                         int64_t m0, FixedAcc* st) {
  const __m512i lane_sub = lane_sub16();
  __m512 acc[R * C];
  for (int64_t i = 0; i < R * C; ++i) acc[i] = st[i].acc;
  for (int64_t j = 0; j < nsb; ++j) {
    __m512 xs[R];  // x's powers of two by sub-block
    for (int64_t r = 0; r < R; ++r) xs[r] = _mm512_loadu_ps(xf.scale + 16 * (((m0 + r) * K) / 256 + j));
    for (int q = 0; q < 4; ++q) {
      const __m512i lanes = _mm512_add_epi32(lane_sub, _mm512_set1_epi32(4 * q));
      __m512i codes[C];
      __m512 wq[C];
      for (int64_t c = 0; c < C; ++c) {
        codes[c] = col[c * nsb + j].codes[q];
        wq[c] = _mm512_permutexvar_ps(lanes, col[c * nsb + j].scale);
      }
      for (int64_t r = 0; r < R; ++r) {
        const int8_t* p = xf.planes + 192 * (((m0 + r) * K + j * 256) / 64 + q);
        __m512i p2 = _mm512_loadu_si512(p), p1 = _mm512_loadu_si512(p + 64), p0 = _mm512_loadu_si512(p + 128);
        __asm__("" : "+v"(p2), "+v"(p1), "+v"(p0));  // one load for the C columns
        const __m512 xq = _mm512_permutexvar_ps(lanes, xs[r]);
        for (int64_t c = 0; c < C; ++c) {
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], p2);
          d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 8), codes[c], p1);
          d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 8), codes[c], p0);
          acc[r * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(wq[c], xq), acc[r * C + c]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512 x16 = _mm512_loadu_ps(xsum + (m0 + r) * (K / 16) + 16 * j);
      for (int64_t c = 0; c < C; ++c) st[r * C + c].macc = _mm512_fmadd_ps(col[c * nsb + j].term, x16, st[r * C + c].macc);
    }
  }
  for (int64_t i = 0; i < R * C; ++i) st[i].acc = acc[i];
}

// From how many rows fixed_columns takes the GEMM. Measured cold (products streamed from memory, as
// in a decode step or a prefill chunk; two Zen 5 threads, the decoding prefetched), GEMM against
// row tiles: K-tiled (long rows) at 8 rows Q6_K 2048 x 8192 1.26 / 1.64 ms, Q4_K 1.14 / 1.39; rows of
// 2048, Q4_K 16384 x 2048 at 8 / 12 / 16 rows 1.80 / 2.45 / 3.24 against 1.70 / 2.62 / 3.31, Q6_K
// 49152 x 2048 at 8 / 12 / 16 / 24 / 32 rows 7.2 / 10.1 / 12.7 / 18.0 / 23.2 against 6.2 / 9.3 /
// 11.9 / 18.0 / 23.6. (All at 8 before: a batch of 8 decoding streams ran the 1 B's step at 88 ms
// against 34 for 4, the decoding unprefetched.)
constexpr int64_t gemm_rows(bool sub16, bool tiled) { return tiled ? 8 : sub16 ? 24 : 12; }
constexpr int64_t kGemmBlock = 32;  // columns decoded at once: 32 x 8 super-blocks (K 2048) in 96 KB


template <int64_t t>
void fixed_columns(const FixedRows& xf, const float* xsum, const uint8_t* w, bool tiled, float* y, int64_t M, int64_t N,
                   int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t bb = k_bytes(t);
  constexpr bool sub16 = k_sub(t) == 16;  // Q2_K, Q3_K, Q6_K
  const int64_t nsb = K / 256;
  // super-blocks [j0, j1) of rows m0.. of column n, from and into the sums in `st`
  const auto run = [&](auto R, int64_t m0, int64_t n, int64_t j0, int64_t j1, FixedAcc* st) {
    const uint8_t* wb = w + block_offset(tiled, n, j0, N, nsb, bb);
    if constexpr (sub16)
      fixed_ktile16<t, decltype(R)::value>(xf, xsum, wb, K, m0, j0, j1, st);
    else
      fixed_ktile32<t, decltype(R)::value>(xf, xsum, wb, K, m0, j0, j1, st);
  };
  const auto finish = [&](const FixedAcc& a, int64_t m, int64_t n) {
    const float mins = sub16 ? term_scale(t) * k_hsum(a.macc) : hsum((v8f)_mm512_castps512_ps256(a.macc));
    y[m * N + n] = (k_hsum(a.acc) - mins) * xf.row_scale[m];
  };
  // Q4_0/Q4_1 rows are read as the file holds them (not K-tiled): where a row tile's planes (3
  // bytes a weight, up to 4 rows) outgrow L1 they go in K tiles as K-tiled matrices do, reading
  // each row's tile of 8 super-blocks in place, and take the GEMM from as many rows. Cold, two Zen
  // 5 threads, Q4_0 2048 x 8192 at 2 / 4 / 8 rows 0.61 / 1.20 / 1.93-1.98 -> 0.46 / 0.60 /
  // 1.02-1.06 ms; 14336 x 4096 at 4 / 8 rows 2.70 / 4.94 -> 1.80-1.89 / 3.6-4.0; 4096 x 14336 at
  // one row 1.13 -> 1.07. (Rows whose planes fit: the row at once, as before; at one row of 8192
  // the K tiles cost 0.27 -> 0.37 ms.)
  const bool group_k_tiles = is_group(t) && std::min<int64_t>(M, 4) * K * 3 > 32 * 1024;
  if (M >= gemm_rows(sub16, tiled || group_k_tiles)) {
    using Decoded = std::conditional_t<sub16, DecodedK16, DecodedK4>;
    std::unique_ptr<Decoded[]> dec(new Decoded[kGemmBlock * nsb]);
    for (int64_t b0 = n0; b0 < n1; b0 += kGemmBlock) {
      const int64_t b1 = std::min(n1, b0 + kGemmBlock);
      for (int64_t n = b0; n < b1; ++n)
        for (int64_t j = 0; j < nsb; ++j) {
          const uint8_t* b = w + block_offset(tiled, n, j, N, nsb, bb);
          prefetch_block<bb>(b);
          if constexpr (sub16) decode_k16<t>(b, dec[(n - b0) * nsb + j]);
          else decode_k4<t>(b, dec[(n - b0) * nsb + j]);
        }
      // 2 rows x 4 columns, then what is left of either
      const auto tile = [&](auto R, auto C, int64_t m0, int64_t c0) {
        constexpr int64_t r_ = decltype(R)::value, c_ = decltype(C)::value;
        FixedAcc st[r_ * c_];
        for (auto& a : st) a.acc = a.macc = _mm512_setzero_ps();
        if constexpr (sub16) fixed_gemm16<r_, c_>(xf, xsum, &dec[(c0 - b0) * nsb], nsb, K, m0, st);
        else fixed_gemm32<r_, c_>(xf, xsum, &dec[(c0 - b0) * nsb], nsb, K, m0, st);
        for (int64_t r = 0; r < r_; ++r)
          for (int64_t c = 0; c < c_; ++c) finish(st[r * c_ + c], m0 + r, c0 + c);
      };
      const auto rows = [&](auto R, int64_t m0) {
        int64_t c0 = b0;
        for (; c0 + 4 <= b1; c0 += 4) tile(R, std::integral_constant<int64_t, 4>{}, m0, c0);
        for (; c0 < b1; ++c0) tile(R, std::integral_constant<int64_t, 1>{}, m0, c0);
      };
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2) rows(std::integral_constant<int64_t, 2>{}, m0);
      if (m0 < M) rows(std::integral_constant<int64_t, 1>{}, m0);
    }
    return;
  }
  if (!tiled && !group_k_tiles) {  // a column's whole row at once: its sums never leave the tile
    blocked_columns<4>(M, n0, n1, kColumnBlock, [&](auto R, int64_t m0, int64_t n) {
      FixedAcc st[decltype(R)::value];
      for (auto& a : st) a.acc = a.macc = _mm512_setzero_ps();
      run(R, m0, n, 0, nsb, st);
      for (int64_t r = 0; r < R; ++r) finish(st[r], m0 + r, n);
    });
    return;
  }
  // K tiles: every column's sums carried from one tile to the next, in the same order as above
  std::unique_ptr<FixedAcc[]> st(new FixedAcc[(n1 - n0) * M]);
  for (int64_t i = 0; i < (n1 - n0) * M; ++i) st[i].acc = st[i].macc = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < nsb; j0 += kTileBlocks)
    tiled_columns<4>(M, n0, n1, [&](auto R, int64_t m0, int64_t n) {
      run(R, m0, n, j0, std::min(nsb, j0 + kTileBlocks), &st[(n - n0) * M + m0]);
    });
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) finish(st[(n - n0) * M + m], m, n);
}

inline void fixed_columns(int64_t t, const FixedRows& xf, const float* xsum, const uint8_t* w, bool tiled, float* y,
                          int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  switch (t) {
    case kQ4_K: fixed_columns<kQ4_K>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    case kQ5_K: fixed_columns<kQ5_K>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    case kG4_0: fixed_columns<kG4_0>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    case kG4_1: fixed_columns<kG4_1>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    case kQ2_K: fixed_columns<kQ2_K>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    case kQ3_K: fixed_columns<kQ3_K>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
    default: fixed_columns<kQ6_K>(xf, xsum, w, tiled, y, M, N, K, n0, n1); break;
  }
}
#endif
#else  // AVX2: ktile's conversions (vpermps looks up 8 entries there, not 16)
constexpr bool lut_k(int64_t) { return false; }
inline void lut_order(bool, const float*, float*, int64_t, int64_t) {}
#endif
#if !defined(PANTHEON_FIXED_K)  // no VNNI: the f32 kernels (ktile, lut_ktile, q6k_ktile)
constexpr bool fixed_k(int64_t) { return false; }
#endif

template <int64_t t, int64_t R>
inline void ktile(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0,
                  int64_t n) {
  constexpr int64_t bb = k_bytes(t);
  constexpr int per_sub = static_cast<int>(k_sub(t) / kW), nv = 256 / kW;  // vectors per sub-block, per super-block
  const int64_t nsb = K / 256;
  vkf acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = k_set1(0.f);
  float macc[R] = {};
  SuperBlock sb;
  // A sub-block's codes converted once for the tile's rows, in registers (a whole super-block's 32
  // converted vectors went through the stack on AVX2's 16 registers: 16384 x 2048 cold on AVX2, two
  // / four rows, Q4_K 2.39 / 3.62 -> 1.32-1.41 / 1.98 ms, Q5_K four 3.69 -> 2.09, Q3_K 4.34 -> 2.13;
  // one row Q2_K 1.72 -> 1.18, Q3_K 2.01 -> 1.78, Q5_K 1.22 -> 1.07; the AVX2 1 B Q4_K_M decode step
  // at 2 / 4 / 8 rows 78-83 / 119-125 / 241-245 -> 53-54 / 78 / 152-157 ms). Each row's sums run in
  // the same order whatever R. (kcolumns gives Q4_K, IQ4_XS and Q6_K their own tiles on AVX-512,
  // Q4_K, Q2_K, Q3_K and Q6_K on AVX2.)
  for (int64_t j = 0; j < nsb; ++j) {
    prefetch_block<bb>(wrow + j * bb);
    codes_k<t>(wrow + j * bb, sb);
    for (int s = 0; s < nv / per_sub; ++s) {
      const int v0 = s * per_sub;
      vkf c[per_sub];
      for (int i = 0; i < per_sub; ++i) c[i] = k_codes(sb, v0 + i);
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * K + j * 256;
        vkf dot = k_mul(c[0], k_load(xr + kW * v0));
        for (int i = 1; i < per_sub; ++i) dot = k_fma(c[i], k_load(xr + kW * (v0 + i)), dot);
        acc[r] = k_fma(dot, k_set1(sb.scale[s]), acc[r]);
      }
    }
    if constexpr (has_k_min(t)) {
      constexpr int subs = static_cast<int>(256 / k_sub(t));
      for (int64_t r = 0; r < R; ++r) {
        const float* xs = xsum + (m0 + r) * (K / k_sub(t)) + j * subs;
        for (int s = 0; s < subs; ++s) macc[r] += sb.min[s] * xs[s];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = k_hsum(acc[r]) - macc[r];
}

#if !defined(__AVX512F__)
// Q4_K on AVX2 (what AVX2 CPUs run in `exact`): each 8 bytes of nibbles widened to int32 lanes
// once, masked for one sub-block's codes and shifted for the next one's, converted for the tile's
// rows with no pass storing a super-block's codes first; the min term one 8-lane multiply-add a
// super-block. Each row's products sum in ktile's order. These kernels are bound by their vector
// operations (the 8-bit products llama.cpp runs there are 4-5 a 32 weights; exact f32 ones ~14 at
// best, f32 or in integers), so every one saved counts: one thread, 2048-weight rows in L2, per 32
// weights at one / four rows, ktile -> this: Q4_K 2.0 / 1.19 -> 1.38 / 0.91 ns; Q6_K (below) 2.59
// / 1.56 -> 2.10-2.19 / 1.05-1.10 (two accumulators, or Q6_K's codes stored and re-read, slower).
// The 1 B Q4_K_M decode step on the AVX2 library (Zen 5) at 1 / 4 / 8 rows 40.9 / 79.3 / 155.0 ->
// 30.8 / 60.9 / 115.9 ms.
template <int64_t R>
inline void q4k_ktile8(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K,
                       int64_t m0, int64_t n) {
  const int64_t nsb = K / 256;
  v8f acc[R], macc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = macc[r] = v8f{};
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  const auto f32x8 = [](const uint8_t* v) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
  };
  for (int64_t j = 0; j < nsb; ++j) {
    const uint8_t* b = wrow + j * 144;
    prefetch_block<144>(b);
    alignas(16) uint8_t sc[8], mn[8];
    k4_scale_bytes(b + 4, sc, mn);
    alignas(32) float scale[8];
    store8(scale, (v8f{} + fp16_at(b)) * f32x8(sc));
    const v8f mins = (v8f{} + fp16_at(b + 2)) * f32x8(mn);
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p and 2p+1: the low and high nibbles of qs[32 p ..]
      const uint8_t* q = b + 16 + 32 * p;
      v8f c[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
        c[i] = (v8f)_mm256_cvtepi32_ps(_mm256_and_si256(raw, m4));
        c[4 + i] = (v8f)_mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
      }
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * p + h;
        for (int64_t r = 0; r < R; ++r) {
          const float* xr = x + (m0 + r) * K + j * 256 + 32 * s;
          v8f dot = c[4 * h] * load8(xr);
          for (int i = 1; i < 4; ++i) dot = fma8(c[4 * h + i], load8(xr + 8 * i), dot);
          acc[r] = fma8(dot, v8f{} + scale[s], acc[r]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) macc[r] = fma8(mins, load8(xsum + (m0 + r) * (K / 32) + 8 * j), macc[r]);
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) - hsum(macc[r]);
}
// The 16-weight sub-block types on AVX2 likewise (Q2_K, Q3_K, Q6_K): a super-block's unsigned
// codes in registers, 32 a vector in weight order (Q6_K 0..63 and Q3_K 0..7 before ggml's -32 and
// -4, Q2_K 0..3), widened from there; per 16 weights a scale and a term coefficient, weight =
// scale * code - coef (Q6_K: coef = 32 scale, Q3_K: 4 scale, Q2_K: dmin * min), the terms one
// multiply-add a super-block against x's sums per 16. Q3_K / Q2_K at one / four rows (ns per 32
// weights, as above): Q3_K 4.04-4.19 / 2.08-2.15 -> 2.21 / 1.02 (with q3k_scales16), Q2_K 3.80-3.99 /
// 2.16-2.20 -> 1.92-2.06 / 0.99-1.05; cold, two threads, 16384 x 2048 at one / four rows: Q3_K
// 1.95-2.03 / 2.52-2.56 -> 1.19 / 2.23-2.28 ms, Q2_K at four 2.82-2.98 -> 2.16.
// Scales and term coefficients of sub-blocks 0-7 (s[0], c[0]) and 8-15 (s[1], c[1]).
template <int64_t t>
inline void sub16_coefs(const uint8_t* b, v8f s[2], v8f c[2]) {
  const auto f32x8 = [](__m128i v) { return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); };
  if constexpr (t == kQ2_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), m4 = _mm_set1_epi8(0x0F);
    const __m128i scale = _mm_and_si128(sc, m4), mins = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
    const v8f d = v8f{} + fp16_at(b + 80), dmin = v8f{} + fp16_at(b + 82);
    s[0] = d * f32x8(scale), s[1] = d * f32x8(_mm_srli_si128(scale, 8));
    c[0] = dmin * f32x8(mins), c[1] = dmin * f32x8(_mm_srli_si128(mins, 8));
    return;
  }
  __m128i sc;
  float d;
  if constexpr (t == kQ3_K) {
    sc = q3k_scales16(b), d = fp16_at(b + 108);
  } else {
    sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), d = fp16_at(b + 208);
  }
  s[0] = (v8f{} + d) * f32x8(sc), s[1] = (v8f{} + d) * f32x8(_mm_srli_si128(sc, 8));
  const v8f off = v8f{} + static_cast<float>(code_offset(t));  // a power of two: an exact product
  c[0] = off * s[0], c[1] = off * s[1];
}
template <int64_t t, int64_t R>
inline void sub16_ktile8(const float* x, const float* xsum, const uint8_t* wrow, float* y, int64_t N, int64_t K,
                         int64_t m0, int64_t n) {
  constexpr int64_t bb = k_bytes(t);
  const int64_t nsb = K / 256;
  v8f acc[R], macc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = macc[r] = v8f{};
  for (int64_t j = 0; j < nsb; ++j) {
    const uint8_t* b = wrow + j * bb;
    prefetch_block<bb>(b);
    v8f sv[2], cv[2];
    sub16_coefs<t>(b, sv, cv);
    alignas(32) float scale[16];
    store8(scale, sv[0]), store8(scale + 8, sv[1]);
    __m256i q[8];
    sub16_codes<t>(b, q);
    for (int v = 0; v < 8; ++v) {  // weights 32 v .. 32 v + 31: sub-blocks 2 v, 2 v + 1
      const __m128i lo = _mm256_castsi256_si128(q[v]), hi = _mm256_extracti128_si256(q[v], 1);
      v8f c[4];
      c[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      c[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      c[2] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      c[3] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * K + j * 256 + 32 * v;
        const v8f d0 = fma8(c[1], load8(xr + 8), c[0] * load8(xr));
        const v8f d1 = fma8(c[3], load8(xr + 24), c[2] * load8(xr + 16));
        acc[r] = fma8(d0, v8f{} + scale[2 * v], acc[r]);
        acc[r] = fma8(d1, v8f{} + scale[2 * v + 1], acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* xs = xsum + (m0 + r) * (K / 16) + 16 * j;
      macc[r] = fma8(cv[1], load8(xs + 8), fma8(cv[0], load8(xs), macc[r]));
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) - hsum(macc[r]);
}
#endif

template <int64_t t>
void kcolumns(const float* x, const float* xsum, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
              int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 256 * k_bytes(t);
  blocked_columns<4>(M, n0, n1, kColumnBlock, [&](auto R, int64_t m0, int64_t n) {
#if defined(__AVX512F__)
    if constexpr (lut_k(t)) {
      lut_ktile<t, decltype(R)::value>(x, xsum, w + n * row_bytes, y, N, K, m0, n);
      return;
    } else if constexpr (t == kQ6_K) {
      q6k_ktile<decltype(R)::value>(x, w + n * row_bytes, y, N, K, m0, n);
      return;
    }
#else
    if constexpr (t == kQ4_K) {
      q4k_ktile8<decltype(R)::value>(x, xsum, w + n * row_bytes, y, N, K, m0, n);
      return;
    }
    if constexpr (t == kQ6_K || t == kQ3_K || t == kQ2_K) {
      sub16_ktile8<t, decltype(R)::value>(x, xsum, w + n * row_bytes, y, N, K, m0, n);
      return;
    }
#endif
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
    case kIQ4_XS: kcolumns<kIQ4_XS>(x, xsum, w, y, M, N, K, n0, n1); break;
    default: kcolumns<kQ6_K>(x, xsum, w, y, M, N, K, n0, n1); break;
  }
}

// ---- 8-bit activations (llamacpp numerics) ----------------------------------------------------
// As ggml-cpu's vec_dot_q*_K_q8_K: the activations are rounded per 256 to Q8_K (f32 scale, int8
// codes, int16 sums per 16), and each super-block's dot product is an exact integer sum of code x
// integer sub-block scale x activation (maddubs/madd) in 8 int32 lanes, and the f32 sums as ggml's
// AVX2 vec_dot keeps them: per super-block acc += (d_x * d) * lanes (8 f32 lanes), the min term
// (d_x * dmin) * sum_s(min_s * bsum_s) in 4 lanes of its own (Q4_K/Q5_K; Q2_K's 8 go into acc
// first), each reduced once at the end — so a rounding of the next layer's activations sees the
// value llama.cpp's non-repacked kernel computes. The jnp reference (numerics.int_product) scales
// each block's exact integer total instead: the same up to f32 rounding.

// x rows as Q8_K: quantize_row_q8_K_ref — the scale from the signed extreme (iscale = -127 / max),
// codes x * iscale rounded to nearest even, capped at 127; d = 1 / iscale.
inline void quantize_rows_q8k(const float* x, int64_t blocks, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * 256;
    float amax = 0.f, vmax = 0.f;
    for (int k = 0; k < 256; ++k) {
      const float ax = std::fabs(xb[k]);
      if (ax > amax) amax = ax, vmax = xb[k];
    }
    int8_t* qb = q + i * 256;
    if (amax == 0.f) {
      d[i] = 0.f;
      std::memset(qb, 0, 256);
      std::memset(bsums + i * 16, 0, 32);
      continue;
    }
    const float iscale = -127.f / vmax;
    for (int k = 0; k < 256; ++k) {
      const int v = static_cast<int>(std::nearbyint(iscale * xb[k]));
      qb[k] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int s = 0; s < 16; ++s) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += qb[16 * s + k];
      bsums[i * 16 + s] = static_cast<int16_t>(sum);
    }
    d[i] = 1.f / iscale;
  }
}

struct Q8KRows {
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K / 256]
  const int16_t* bsum;  // [M, K / 16]
};

// A super-block's integer sub-block scales (and mins) and its fp16 d (and dmin) as f32.
struct KInts {
  int16_t sc[16], mn[16];
  float d, dmin;
};

template <int64_t t>
inline void int_scales_k(const uint8_t* b, KInts& o) {
  o.dmin = 0.f;
  if constexpr (t == kQ4_K || t == kQ5_K) {
    o.d = fp16_at(b), o.dmin = fp16_at(b + 2);
    uint8_t sc[8], mn[8];
    k4_scale_bytes(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) o.sc[j] = sc[j], o.mn[j] = mn[j];
  } else if constexpr (t == kQ6_K) {
    o.d = fp16_at(b + 208);
    for (int k = 0; k < 16; ++k) o.sc[k] = reinterpret_cast<const int8_t*>(b + 192)[k];
  } else if constexpr (t == kIQ4_XS) {
    o.d = fp16_at(b);
    iq4xs_scales(b, o.sc);
  } else if constexpr (t == kQ3_K) {
    o.d = fp16_at(b + 108);
    int8_t s[16];
    q3k_scales(b, s);
    for (int k = 0; k < 16; ++k) o.sc[k] = s[k];
  } else {  // Q2_K
    o.d = fp16_at(b + 80), o.dmin = fp16_at(b + 82);
    for (int k = 0; k < 16; ++k) o.sc[k] = b[k] & 0xF, o.mn[k] = b[k] >> 4;
  }
}

// acc += s * lanes (f32), and the final sums of ggml's 8- and 4-lane accumulators.
inline v8f fma_lanes(float s, __m256i lanes, v8f acc) { return fma8(v8f{} + s, (v8f)_mm256_cvtepi32_ps(lanes), acc); }
inline __m128 fma_lanes4(float s, __m128i lanes, __m128 acc) {
  return _mm_fmadd_ps(_mm_set1_ps(s), _mm_cvtepi32_ps(lanes), acc);
}
inline float hsum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
// 8 int32 lanes -> 4: lane i = lanes 2i + 2i+1 (ggml's madd over 8 mins and 8 pair sums).
inline __m128i pairs4(__m256i v) {
  const __m256i h = _mm256_hadd_epi32(v, v);  // per 128-bit half: (0+1, 2+3, 0+1, 2+3)
  return _mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// R rows m0.. of output column n against a row of K-quant super-blocks, 8-bit activations. Codes
// are decoded once per super-block for the tile; signed codes (Q3_K, Q6_K) multiply as |code| with
// the sign moved onto the activations (maddubs takes an unsigned first operand), as ggml's Q8_0.
template <int64_t t, int64_t R>
inline void ktile8(const Q8KRows& a, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  constexpr int64_t bb = k_bytes(t);
  constexpr bool sub32 = k_sub(t) == 32, signed_codes = t == kQ3_K || t == kQ6_K || t == kIQ4_XS;
  const int64_t nsb = K / 256;
  v8f acc[R] = {};
  __m128 accm[R] = {};
  SuperBlock sb;
  KInts ki;
  __m256i w[8], sign[8], scale[8];
  for (int64_t j = 0; j < nsb; ++j) {
    prefetch_block<bb>(wrow + j * bb);
    codes_k<t>(wrow + j * bb, sb);
    int_scales_k<t>(wrow + j * bb, ki);
    for (int v = 0; v < 8; ++v) {
      const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(sb.q + 32 * v));
      if constexpr (signed_codes) {
        sign[v] = c;
        w[v] = _mm256_sign_epi8(c, c);
      } else {
        w[v] = c;
      }
      scale[v] = sub32 ? _mm256_set1_epi16(ki.sc[v])
                       : _mm256_set_m128i(_mm_set1_epi16(ki.sc[2 * v + 1]), _mm_set1_epi16(ki.sc[2 * v]));
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.q + row * K + j * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * v));
        if constexpr (signed_codes) xv = _mm256_sign_epi8(xv, sign[v]);
        // exact: |pair| <= 2 * 63 * 127 < 2^15, and scale * pair sums fit int32
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], xv), scale[v]));
      }
      const float dx = a.d[row * nsb + j];
      if constexpr (has_k_min(t)) {
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + row * (K / 16) + j * 16));
        if constexpr (sub32) {  // Q5_K: 8 mins, each over two bsums
          const __m128i mv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ki.mn));
          const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mv, mv), _mm_unpacklo_epi16(mv, mv));
          accm[r] = fma_lanes4(-dx * ki.dmin, pairs4(_mm256_madd_epi16(bs, mins)), accm[r]);
        } else {  // Q2_K: 16 mins, one per bsum
          const __m256i mins = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ki.mn));
          acc[r] = fma_lanes(-dx * ki.dmin, _mm256_madd_epi16(bs, mins), acc[r]);
        }
      }
      acc[r] = fma_lanes(dx * ki.d, isum, acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + hsum4(accm[r]);
}

// Q4_K's and Q6_K's 8-bit products, specialised (the bulk of a Q4_K_M file): codes split from the
// blocks straight into registers, scales unpacked by 32-bit words, no decoded super-block in
// memory. Their lanes are ktile8's (ggml's), so each output is bit for bit ktile8's.

template <int64_t R>
inline void q4k_tile8(const Q8KRows& a, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  const int64_t nsb = K / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  v8f acc[R] = {};
  __m128 accm[R] = {};
  for (int64_t j = 0; j < nsb; ++j) {
    const uint8_t* b = wrow + j * k_bytes(kQ4_K);
    prefetch_block<k_bytes(kQ4_K)>(b);
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    alignas(16) uint8_t sc[8], mn[8];
    k4_scale_bytes(b + 4, sc, mn);
    __m256i lo[4], hi[4], slo[4], shi[4];
    for (int c = 0; c < 4; ++c) {  // 64 weights: 32 low nibbles (sub-block 2c), 32 high (2c + 1)
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      lo[c] = _mm256_and_si256(raw, m4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      slo[c] = _mm256_set1_epi16(sc[2 * c]);
      shi[c] = _mm256_set1_epi16(sc[2 * c + 1]);
    }
    const __m128i mv = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));  // min_s at 2s and 2s + 1
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.q + row * K + j * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c + 32));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(lo[c], xl), slo[c]));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(hi[c], xh), shi[c]));
      }
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum + row * (K / 16) + j * 16));
      const float dx = a.d[row * nsb + j];
      accm[r] = fma_lanes4(-dx * dmin, pairs4(_mm256_madd_epi16(bs, mins)), accm[r]);
      acc[r] = fma_lanes(dx * d, isum, acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + hsum4(accm[r]);
}

// Q6_K: the six-bit codes unsigned (0..63) through maddubs, the offset of 32 taken off each pair
// sum (maddubs of 32 with x) before the scales, as ggml does: its lanes, exactly.
template <int64_t R>
inline void q6k_tile8(const Q8KRows& a, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  const int64_t nsb = K / 256;
  const __m256i m32 = _mm256_set1_epi8(32);
  v8f acc[R] = {};
  for (int64_t j = 0; j < nsb; ++j) {
    const uint8_t* b = wrow + j * k_bytes(kQ6_K);
    prefetch_block<k_bytes(kQ6_K)>(b);
    const float d = fp16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    __m256i q[8], s[8];
    q6k_codes(b, q);
    for (int v = 0; v < 8; ++v)  // 32 weights: sub-blocks 2v (low half) and 2v + 1
      s[v] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.q + row * K + j * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int v = 0; v < 8; ++v) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * v));
        const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q[v], xv), _mm256_maddubs_epi16(m32, xv));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, s[v]));
      }
      acc[r] = fma_lanes(a.d[row * nsb + j] * d, isum, acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]);
}

// IQ4_XS: per sub-block the 16 bytes of indices looked up into 32 int8 codes in registers, then
// ggml's signed product (|code| times x with code's sign, maddubs) and the 6-bit scale (madd): the
// lanes of ktile8 and of ggml's vec_dot_iq4_xs_q8_K, bit for bit, without a decoded super-block.
template <int64_t R>
inline void iq4xs_tile8(const Q8KRows& a, const uint8_t* wrow, float* y, int64_t N, int64_t K, int64_t m0, int64_t n) {
  const int64_t nsb = K / 256;
  v8f acc[R] = {};
  for (int64_t j = 0; j < nsb; ++j) {
    const uint8_t* b = wrow + j * k_bytes(kIQ4_XS);
    prefetch_block<k_bytes(kIQ4_XS)>(b);
    const float d = fp16_at(b);
    int16_t sc[8];
    iq4xs_scales(b, sc);
    __m256i q[8], mag[8], s[8];
    for (int i = 0; i < 8; ++i) {
      q[i] = iq4_codes(b + 8 + 16 * i);
      mag[i] = _mm256_sign_epi8(q[i], q[i]);
      s[i] = _mm256_set1_epi16(sc[i]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xq = a.q + row * K + j * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int i = 0; i < 8; ++i) {
        const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i)), q[i]);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[i], xv), s[i]));
      }
      acc[r] = fma_lanes(a.d[row * nsb + j] * d, isum, acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + n] = hsum(acc[r]);
}

template <int64_t t>
void kcolumns8(const Q8KRows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t row_bytes = K / 256 * k_bytes(t);
  tiled_columns<8>(M, n0, n1, [&](auto R, int64_t m0, int64_t n) {
    constexpr int64_t r = decltype(R)::value;
    if constexpr (t == kQ4_K) q4k_tile8<r>(a, w + n * row_bytes, y, N, K, m0, n);
    else if constexpr (t == kQ6_K) q6k_tile8<r>(a, w + n * row_bytes, y, N, K, m0, n);
    else if constexpr (t == kIQ4_XS) iq4xs_tile8<r>(a, w + n * row_bytes, y, N, K, m0, n);
    else ktile8<t, r>(a, w + n * row_bytes, y, N, K, m0, n);
  });
}

inline void kcolumns8(int64_t t, const Q8KRows& a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                      int64_t n0, int64_t n1) {
  switch (t) {
    case kQ2_K: kcolumns8<kQ2_K>(a, w, y, M, N, K, n0, n1); break;
    case kQ3_K: kcolumns8<kQ3_K>(a, w, y, M, N, K, n0, n1); break;
    case kQ4_K: kcolumns8<kQ4_K>(a, w, y, M, N, K, n0, n1); break;
    case kQ5_K: kcolumns8<kQ5_K>(a, w, y, M, N, K, n0, n1); break;
    case kIQ4_XS: kcolumns8<kIQ4_XS>(a, w, y, M, N, K, n0, n1); break;
    default: kcolumns8<kQ6_K>(a, w, y, M, N, K, n0, n1); break;
  }
}

}  // namespace pantheon
