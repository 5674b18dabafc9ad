// Attention read in place from the slot cache, as XLA FFI custom calls on the CPU. Decode: one
// query token per row, row b attending to keys 0..lens[b]-1 of slot slots[b] (a sliding layer's:
// the last `window` of them, from a ring where its cache is one, model/state.py). Prefill (below):
// a chunk's queries, each attending to the keys up to its own position. The jnp path
// (pantheon/pallas/attention.py: cached_attention_blocked) loops over key blocks with masks and
// rescales; these read the keys and values a query sees, in position order.
//
// Per query head: scores s = (q * D^-0.5) . k for every key, softmax over them (max, exp, sum),
// then sum_j p_j v_j / sum_j p_j, over key pieces fixed by absolute position and merged in order.
// Each row (each query) is computed alone, in a fixed order, so its result does not depend on its
// batch-mates. The cache may hold f32, f16, bf16 or q8_0 (--kv-dtype); each value is
// widened to f32 exactly as it is loaded (q8_0: d * code, as ggml dequantizes), and all arithmetic
// is f32.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

namespace pantheon {
namespace {

// e^x for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); 0 below
// -87.3, where the f32 result would be subnormal or 0. One definition for 8 and 16 lanes: `Ops`
// gives the vector operations (Lanes8 below, Lanes16 with the 16-wide prefill).
template <class Ops, class V = typename Ops::V>
inline V exp_lanes(V x) {
  const V lo = Ops::set1(-87.33654f);
  const auto under = Ops::less(x, lo);
  V v = Ops::max(x, lo);
  const V n = Ops::round(Ops::mul(v, Ops::set1(1.44269504088896341f)));
  v = Ops::fnmadd(n, Ops::set1(0.693359375f), v);
  v = Ops::fnmadd(n, Ops::set1(-2.12194440e-4f), v);
  V p = Ops::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = Ops::fmadd(p, v, Ops::set1(c));
  p = Ops::fmadd(Ops::mul(p, v), v, Ops::add(v, Ops::set1(1.f)));
  return Ops::zero_where(under, Ops::mul(p, Ops::pow2(n)));
}

struct Lanes8 {
  using V = __m256;
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V less(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V pow2(V n) {  // 2^n for integral n
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_where(V mask, V a) { return _mm256_andnot_ps(mask, a); }
};

inline v8f exp8(v8f x) { return (v8f)exp_lanes<Lanes8>((__m256)x); }

// Eight cache values as f32, from the cache's element type: f32, f16 (F16C) or bf16 (the upper
// half of an f32). Both conversions are exact, so a cache's values enter the same arithmetic.
inline v8f load_kv(const uint16_t* p, std::true_type /*f16*/) {
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
inline v8f load_kv(const uint16_t* p, std::false_type /*bf16*/) {
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// A cache type: T its storage; at(p, e) the address e values past p (e a multiple of 32: a head's or
// a position's start); load(p, e) values e .. e + 7 past p (e a multiple of 8) as f32; row(D) the
// T's a head's D values take.
template <class Elem, bool kF16>
struct PlainCache {
  using T = Elem;
  static const T* at(const T* p, int64_t e) { return p + e; }
  static v8f load(const T* p, int64_t e) {
    if constexpr (std::is_same_v<T, float>) return load8(p + e);
    else return load_kv(p + e, std::integral_constant<bool, kF16>{});
  }
  static int64_t row(int64_t D) { return D; }
};
using F32Cache = PlainCache<float, false>;
using F16Cache = PlainCache<uint16_t, true>;
using BF16Cache = PlainCache<uint16_t, false>;

// ggml's q8_0 (--kv-dtype q8_0): per 32 values an fp16 scale d, then 32 int8 codes; value = d * code.
struct Q8Cache {
  using T = uint8_t;
  static const T* at(const T* p, int64_t e) { return p + e / 32 * 34; }
  static v8f load(const T* p, int64_t e) {
    const T* b = p + e / 32 * 34;
    const float d = _cvtsh_ss(static_cast<unsigned short>(b[0] | b[1] << 8));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + e % 32))));
    return (v8f)_mm256_mul_ps(q, _mm256_set1_ps(d));
  }
  static int64_t row(int64_t D) { return D / 32 * 34; }
};

// Whether a cache's last dimension (its T's a head) holds a head of D values for this type.
template <class Cache>
bool head_fits(int64_t last, int64_t D) {
  return D % 8 == 0 && (std::is_same_v<Cache, Q8Cache> ? D % 32 == 0 : true) && last == Cache::row(D);
}

// s[j] -> e^(s[j] - m) for j < n8 (a multiple of 8; -inf scores give 0), returning their sum.
inline float exp_in_place(float* s, int64_t n8, float m) {
  v8f sum = v8f{};
  for (int64_t j = 0; j < n8; j += 8) {
    const v8f p = exp8(load8(s + j) - m);
    store8(s + j, p);
    sum += p;
  }
  return hsum(sum);
}

// Eight sums in one vector: a[i]'s eight lanes added as ((0+1)+(2+3)) + ((4+5)+(6+7)), a fixed
// tree, for eight keys at once (one hsum each was most of the scores' instructions).
inline v8f hsum8(const v8f* a) {
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 | a0..a3], [a4..a7 | a4..a7]
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Eight scores q . k_i in one vector: q's d8 vectors (scaled) against key i's at rows[i] + off, read
// by Cache (its type widened to f32), a chain of FMAs a key, the eight summed across lanes at once.
template <class Cache, class T = typename Cache::T>
inline v8f eight_scores(const float* q, const T* const* rows, int64_t off, int64_t d8) {
  v8f a[8];
  for (int i = 0; i < 8; ++i) a[i] = load8(q) * Cache::load(rows[i], off);
  for (int64_t c = 1; c < d8; ++c) {
    const v8f qc = load8(q + 8 * c);
    for (int i = 0; i < 8; ++i) a[i] = fma8(qc, Cache::load(rows[i], off + 8 * c), a[i]);
  }
  return hsum8(a);
}

// acc[g][0..NV) += sum_j p[g][j] v_j over n positions, for GN heads sharing one kv head (each value
// vector widened once for the GN heads), NV vectors of each head's output in registers; per lane
// the sum runs over positions in order. acc: head g's at acc + g * D; p: head g's at p + g * n8;
// v_j's values at off .. of position j (at v + j * step values).
template <int GN, int NV, class Cache, class T = typename Cache::T>
inline void head_group_values(float* acc, int64_t D, const float* p, int64_t n8, const T* v, int64_t off, int64_t step,
                              int64_t n) {
  v8f a[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = load8(acc + g * D + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    v8f vj[NV];
    const T* vrow = Cache::at(v, j * step);
    for (int c = 0; c < NV; ++c) vj[c] = Cache::load(vrow, off + 8 * c);
    for (int g = 0; g < GN; ++g) {
      const v8f pj = v8f{} + p[g * n8 + j];
      for (int c = 0; c < NV; ++c) a[g][c] = fma8(pj, vj[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NV; ++c) store8(acc + g * D + 8 * c, a[g][c]);
}

// One (row, key piece), every head: H query heads q [H, D] (G = H / K per kv head) against n
// positions at k, v (position j's K heads at k + j * step, step = K * D) -> per head the score max
// m, the sum l of e^(s - m), and acc = sum_j e^(s_j - m) v_j [H, D]. The positions are read in
// order, each one's heads together, and prefetched ahead: a task per kv head instead strode through
// the cache K times, and with the cache cold behind the weights (every decode step) that ran at a
// fifth of the memory's speed. scores: scratch of H * round_up(n, 8) floats.
template <class Cache, class T = typename Cache::T>
void attend_piece(const float* q, const T* k, const T* v, int64_t step, int64_t n, int64_t H, int64_t K, int64_t D,
                  float* scores, float* m_out, float* l_out, float* acc_out) {
  const int64_t n8 = (n + 7) / 8 * 8, d8 = D / 8, G = H / K;
  const float scale = 1.f / std::sqrt((float)D);
  std::vector<float> qs(H * D);
  for (int64_t i = 0; i < H * d8; ++i) store8(qs.data() + 8 * i, load8(q + 8 * i) * scale);
  // Scores eight positions at a time, head by head (a position past n reads position n - 1; its
  // score is unused); the next eight positions are prefetched while these are scored.
  for (int64_t j = 0; j < n; j += 8) {
    const T* kj[8];
    for (int i = 0; i < 8; ++i) kj[i] = Cache::at(k, std::min<int64_t>(j + i, n - 1) * step);
    if (j + 8 < n) {
      const char* next = reinterpret_cast<const char*>(Cache::at(k, (j + 8) * step));
      const int64_t bytes = std::min<int64_t>(8, n - j - 8) * Cache::row(step) * static_cast<int64_t>(sizeof(T));
      const char* next_v = reinterpret_cast<const char*>(Cache::at(v, (j + 8) * step));
      for (int64_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(next + o, _MM_HINT_T0);
        _mm_prefetch(next_v + o, _MM_HINT_T1);
      }
    }
    for (int64_t h = 0; h < H; ++h)
      store8(scores + h * n8 + j, eight_scores<Cache>(qs.data() + h * D, kj, (h / G) * D, d8));
  }
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores + h * n8;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = n; j < n8; ++j) s[j] = -INFINITY;  // exp -> 0
    m_out[h] = m;
    l_out[h] = exp_in_place(s, n8, m);
  }
  // Values in blocks of positions (a block stays in L1 while every head group reads it), 16 dims
  // of a group's heads at a time in registers.
  constexpr int64_t kBlock = 16;
  std::memset(acc_out, 0, sizeof(float) * H * D);
  for (int64_t j = 0; j < n; j += kBlock) {
    const int64_t nb = std::min(kBlock, n - j);
    if (j + kBlock < n) {  // the next block, fetched while this one is summed
      const char* next = reinterpret_cast<const char*>(Cache::at(v, (j + kBlock) * step));
      const int64_t bytes = std::min(kBlock, n - j - kBlock) * Cache::row(step) * static_cast<int64_t>(sizeof(T));
      for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    }
    const T* vb = Cache::at(v, j * step);  // this block's first position; a head's values at kh * D past it
    for (int64_t kh = 0; kh < K; ++kh) {
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, G - g0), h0 = kh * G + g0;
        const float* p = scores + h0 * n8 + j;
        for (int64_t c = 0; c < d8; c += 2) {
          float* acc = acc_out + h0 * D + 8 * c;
          switch (static_cast<int>(gn) * 2 + (d8 - c >= 2 ? 1 : 0)) {
            case 9: head_group_values<4, 2, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 8: head_group_values<4, 1, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 7: head_group_values<3, 2, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 6: head_group_values<3, 1, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 5: head_group_values<2, 2, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 4: head_group_values<2, 1, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            case 3: head_group_values<1, 2, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
            default: head_group_values<1, 1, Cache>(acc, D, p, n8, vb, kh * D + 8 * c, step, nb); break;
          }
        }
      }
    }
  }
}

// Keys per piece: a row's keys are split into pieces of this many (by absolute position, so the
// split depends only on the row's own length), attended in parallel, then merged in order. Small
// enough that one row's few hundred keys keep both threads busy.
constexpr int64_t kChunk = 64;

// A row's keys as pieces contiguous in its slot: [lo, len) by absolute position (lo = len - window
// with a sliding window, else 0), split at multiples of kChunk and, in a ring (position p at p % C),
// at multiples of C. The pieces depend only on the row's own length.
struct Piece {
  int64_t start, n;  // absolute position of the first key, and the number of keys
};

inline void row_pieces(int64_t len, int64_t window, int64_t C, bool ring, std::vector<Piece>& out) {
  out.clear();
  int64_t p = window > 0 ? std::max<int64_t>(len - window, 0) : 0;
  while (p < len) {
    int64_t end = std::min<int64_t>((p / kChunk + 1) * kChunk, len);
    if (ring) end = std::min<int64_t>(end, (p / C + 1) * C);
    out.push_back({p, end - p});
    p = end;
  }
}

template <class Cache>
ffi::Error AttendDecode(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k_cache,
                        ffi::AnyBuffer& v_cache, ffi::Buffer<ffi::S32>& slots, ffi::Buffer<ffi::S32>& lens,
                        ffi::ResultBuffer<ffi::F32>& out, int64_t window, bool ring) {
  using T = typename Cache::T;
  const auto qd = q.dimensions(), cd = k_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 4) return ffi::Error::InvalidArgument("attention_decode: q [B,H,D], caches [N,C,K,D]");
  const int64_t B = qd[0], H = qd[1], D = qd[2], N = cd[0], C = cd[1], K = cd[2];
  if (!head_fits<Cache>(cd[3], D) || K == 0 || H % K != 0)
    return ffi::Error::InvalidArgument("attention_decode: head dims do not match (D % 8 == 0, q8_0: D % 32 == 0; H % K == 0)");
  if (ring && (window <= 0 || window > C)) return ffi::Error::InvalidArgument("attention_decode: a ring needs a window it holds");
  const int32_t* sp = slots.typed_data();
  const int32_t* lp = lens.typed_data();
  for (int64_t b = 0; b < B; ++b)
    if (sp[b] < 0 || sp[b] >= N || (!ring && lp[b] > C)) return ffi::Error::InvalidArgument("attention_decode: slot or length out of range");
  const float* qp = q.typed_data();
  const T* kp = static_cast<const T*>(k_cache.untyped_data());
  const T* vp = static_cast<const T*>(v_cache.untyped_data());
  float* op = out->typed_data();
  // Tasks: (row, piece), every head; each writes its piece's m, l and acc, merged below per row.
  std::vector<int64_t> first(B + 1, 0);  // first task of each row
  std::vector<Piece> pieces, row;  // the tasks' pieces
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    row_pieces(lp[b] > 0 ? lp[b] : 0, window, C, ring, row);
    for (const Piece& piece : row) keys += piece.n;
    first[b + 1] = first[b] + static_cast<int64_t>(row.size());
    pieces.insert(pieces.end(), row.begin(), row.end());
  }
  const int64_t tasks = first[B];
  std::vector<float> ms(tasks * H), ls(tasks * H), accs(tasks * H * D);
  const int64_t threads = keys * K * D >= (int64_t{1} << 16) ? pool_threads(pool) : 1;
  std::vector<int64_t> owner(tasks);  // task -> its row
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = first[b]; t < first[b + 1]; ++t) owner[t] = b;
  parallel_for(pool, threads, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = owner[t];
      const int64_t base = (int64_t)sp[b] * C * K * D;
      const int64_t start = pieces[t].start % C, n = pieces[t].n;  // a piece never wraps a ring
      scores.resize(H * ((n + 7) / 8 * 8));
      attend_piece<Cache>(qp + b * H * D, Cache::at(kp, base + start * K * D), Cache::at(vp, base + start * K * D), K * D, n, H, K, D,
                          scores.data(), &ms[t * H], &ls[t * H], &accs[t * H * D]);
    }
  });
  // Merge each (row, head)'s pieces, in order; in parallel only where rows have hundreds of pieces
  // (waking a pool thread again costs more than a few thousand sums).
  const int64_t merge_threads = tasks * H * D >= (int64_t{1} << 20) ? threads : 1;
  parallel_for(pool, merge_threads, B * H, std::max<int64_t>(1, H / 4), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      float* o = op + i * D;
      if (first[b] == first[b + 1]) {  // no key visible: zeros, as the reference
        std::memset(o, 0, sizeof(float) * D);
        continue;
      }
      float m = -INFINITY;
      for (int64_t t = first[b]; t < first[b + 1]; ++t) m = std::max(m, ms[t * H + h]);
      float l = 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t t = first[b]; t < first[b + 1]; ++t) {
        const float w = std::exp(ms[t * H + h] - m);
        l += w * ls[t * H + h];
        for (int64_t d = 0; d < D; ++d) o[d] += w * accs[(t * H + h) * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= l;
    }
  });
  return ffi::Error::Success();
}

// The caches' element type picks the loader: f32, f16, bf16 or q8_0 (u8 blocks; --kv-dtype), both alike;
// run(Cache{}) with the matching one.
template <class Run>
ffi::Error by_cache_type(const char* kernel, ffi::AnyBuffer& k_cache, ffi::AnyBuffer& v_cache, Run&& run) {
  const auto type = k_cache.element_type();
  if (v_cache.element_type() != type) return ffi::Error::InvalidArgument(std::string(kernel) + ": k and v caches differ in type");
  switch (type) {
    case ffi::DataType::F32: return run(F32Cache{});
    case ffi::DataType::F16: return run(F16Cache{});
    case ffi::DataType::BF16: return run(BF16Cache{});
    case ffi::DataType::U8: return run(Q8Cache{});
    default: return ffi::Error::InvalidArgument(std::string(kernel) + ": caches must be f32, f16, bf16 or q8_0 (u8)");
  }
}

// window > 0: a sliding window, keys len - window .. len - 1; ring != 0: the caches are rings.
ffi::Error AttentionDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> lens,
                           ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t ring) {
  return by_cache_type("attention_decode", k_cache, v_cache, [&](auto cache) {
    return AttendDecode<decltype(cache)>(pool, q, k_cache, v_cache, slots, lens, out, window, ring != 0);
  });
}

// ---- prefill: many queries a row, causal, read in place ------------------------------------------
//
// Row b's queries t (absolute positions pos[b, t]; < 0: no key, zeros) attend to keys 0..pos[b, t]
// of slot slots[b]; with a window (a sliding layer), to keys pos[b, t] - window + 1..pos[b, t]
// only, and with a ring (its cache a ring of C positions, state.ring_len) key p sits at p % C.
// A task is (row, block of kQueries consecutive queries, kv head): its G query
// heads x kQueries queries run over the keys up to the block's last position in blocks of kKeys
// (by absolute position), each block's keys and values widened to f32 once for all of them, with
// an online softmax per query (f32: the max, a rescale by e^(m_old - m_new) and the sums). A
// query's result depends only on its own position and the cache (not on the chunk it came in,
// its block, or its batch-mates): the key blocks are fixed by absolute position and a query skips
// the keys past its own.
constexpr int64_t kQueries = 16, kKeys = 64;

// The keys a query at position p sees: first..last (none when last < 0). Without a ring a final
// chunk's padding may sit past the cache (its query sees the cache); a ring holds positions mod C.
struct KeySpan {
  int64_t first, last;
};
inline KeySpan key_span(int64_t p, int64_t C, int64_t window, bool ring) {
  const int64_t last = ring ? p : std::min<int64_t>(p, C - 1);
  return {window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, last};
}

// Keys any of a task's nq queries sees: from the key block holding the earliest first (blocks stay
// fixed by absolute position) to reach - 1.
inline void keys_reached(const int32_t* pos, int64_t nq, int64_t C, int64_t window, bool ring, int64_t& start,
                         int64_t& reach) {
  int64_t first = INT64_MAX;
  reach = 0;
  for (int64_t t = 0; t < nq; ++t) {
    const KeySpan span = key_span(pos[t], C, window, ring);
    if (span.last < span.first) continue;
    first = std::min(first, span.first);
    reach = std::max(reach, span.last + 1);
  }
  start = reach > 0 ? first / kKeys * kKeys : 0;
}

// Positions j0 .. j0 + n of kv head kh (position j at k, v + j * step) widened to f32 once for
// every query of a task: kf, vf [n, D].
template <class Cache, class T = typename Cache::T>
inline void widen_keys(const T* k, const T* v, int64_t j0, int64_t n, int64_t step, int64_t ring, int64_t kh,
                       int64_t D, float* kf, float* vf) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = (ring ? (j0 + j) % ring : j0 + j) * step;  // ring: its length, else 0
    for (int64_t c = 0; c < D / 8; ++c) {
      store8(kf + j * D + 8 * c, Cache::load(Cache::at(k, at), kh * D + 8 * c));
      store8(vf + j * D + 8 * c, Cache::load(Cache::at(v, at), kh * D + 8 * c));
    }
  }
}

// A task's rows (r = t * G + g: query t, head kh * G + g) out: acc[r] / l[r], zeros where no key was seen.
inline void write_rows(const float* acc, const float* l, int64_t rows, int64_t G, int64_t H, int64_t kh, int64_t D,
                       float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((r / G) * H + kh * G + r % G) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t c = 0; c < D / 8; ++c) store8(dst + 8 * c, load8(acc + r * D + 8 * c) * inv);
  }
}

template <class Cache, class T = typename Cache::T>
void prefill_task(const float* q, const T* k, const T* v, const int32_t* pos, int64_t nq, int64_t C, int64_t H,
                  int64_t K, int64_t D, int64_t kh, int64_t window, bool ring, float* out, float* scratch) {
  const int64_t G = H / K, d8 = D / 8, rows = nq * G;
  const float scale = 1.f / std::sqrt((float)D);
  // scratch: qs [rows, D], acc [rows, D], kf [kKeys, D], vf [kKeys, D], m [rows], l [rows]
  float* qs = scratch;
  float* acc = qs + rows * D;
  float* kf = acc + rows * D;
  float* vf = kf + kKeys * D;
  float* m = vf + kKeys * D;
  float* l = m + rows;
  int64_t start, reach;
  keys_reached(pos, nq, C, window, ring, start, reach);
  for (int64_t t = 0; t < nq; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float* src = q + (t * H + kh * G + g) * D;
      for (int64_t c = 0; c < d8; ++c) store8(qs + r * D + 8 * c, load8(src + 8 * c) * scale);
      std::memset(acc + r * D, 0, sizeof(float) * D);
      m[r] = -INFINITY, l[r] = 0.f;
    }
  const int64_t step = K * D;  // between positions in the cache
  for (int64_t j0 = start; j0 < reach; j0 += kKeys) {
    const int64_t n = std::min(kKeys, reach - j0);
    widen_keys<Cache>(k, v, j0, n, step, ring ? C : 0, kh, D, kf, vf);
    for (int64_t t = 0; t < nq; ++t) {
      const KeySpan span = key_span(pos[t], C, window, ring);
      const int64_t seen = std::min<int64_t>(n, span.last + 1 - j0);  // keys j0 .. j0 + seen - 1: up to t's
      const int64_t skip = std::max<int64_t>(0, span.first - j0);      // the first `skip`: before t's window
      if (seen <= skip) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g;
        const float* qr = qs + r * D;
        float s[kKeys];
        for (int64_t j = 0; j < seen; j += 8) {  // eight scores at once; a key past `seen` scores -inf
          const float* rows[8];
          for (int i = 0; i < 8; ++i) rows[i] = kf + std::min<int64_t>(j + i, seen - 1) * D;
          v8f sc = eight_scores<F32Cache>(qr, rows, 0, d8);
          for (int64_t i = seen - j; i < 8; ++i) sc[i] = -INFINITY;
          for (int64_t i = 0; i < std::min<int64_t>(8, skip - j); ++i) sc[i] = -INFINITY;
          store8(s + j, sc);
        }
        const int64_t seen8 = (seen + 7) / 8 * 8;
        float mx = m[r];
        for (int64_t j = 0; j < seen; ++j) mx = s[j] > mx ? s[j] : mx;
        const float rescale = std::exp(m[r] - mx);  // 0 on the first block (m = -inf)
        m[r] = mx;
        l[r] = l[r] * rescale + exp_in_place(s, seen8, mx);
        float* ar = acc + r * D;
        for (int64_t c0 = 0; c0 < d8; c0 += 8) {  // 64 dims of the output at a time, in registers
          const int64_t nc = std::min<int64_t>(8, d8 - c0);
          v8f o[8];
          for (int64_t c = 0; c < nc; ++c) o[c] = load8(ar + 8 * (c0 + c)) * rescale;
          for (int64_t j = 0; j < seen; ++j) {
            const v8f p = v8f{} + s[j];
            for (int64_t c = 0; c < nc; ++c) o[c] = fma8(p, load8(vf + j * D + 8 * (c0 + c)), o[c]);
          }
          for (int64_t c = 0; c < nc; ++c) store8(ar + 8 * (c0 + c), o[c]);
        }
      }
    }
  }
  write_rows(acc, l, rows, G, H, kh, D, out);
}

#if defined(__AVX512F__)
// ---- prefill on AVX-512: a key block as two small GEMMs ------------------------------------------
//
// The same computation as prefill_task, per query (row: query x head) the same operations in the
// same order, laid out for 16-wide vectors: the task's rows are vector lanes. Scores for a key
// block come as S^T [kKeys, rows] (q transposed once a task, keys broadcast from their widened
// block), so a row's max, exponentials and sum run down its lane with no horizontal step; then
// acc[rows, D] += P . V in tiles of 6 rows x 64 dims, P broadcast from S^T. 2.5-3x the 8-wide
// kernel, where a long prompt's attention was a quarter of its prefill (1 B shape, 4096 tokens).

typedef __m512 v16f;

struct Lanes16 {
  using V = __m512;
  static V set1(float f) { return _mm512_set1_ps(f); }
  static __mmask16 less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_where(__mmask16 mask, V a) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~mask), a); }
};

// exp8's e^x on 16 lanes (the same operations, so the same values).
inline v16f exp16(v16f x) { return exp_lanes<Lanes16>(x); }

constexpr int64_t kTileKeys = 3, kTileRows = 6, kTileDims = 64;

// st[j][lanes of RV vectors] = sum_d qt[d][lane] * k_j[d] for keys j0 .. j0 + KT: two FMA chains
// (even and odd d, D is even), added at the end: half a single chain's rounding error.
template <int RV, int KT>
inline void score_tile(const float* qt, int64_t rp, const float* kf, int64_t D, int64_t j0, float* st) {
  v16f a[2][KT][RV];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < KT; ++j)
      for (int v = 0; v < RV; ++v) a[h][j][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2)
    for (int h = 0; h < 2; ++h) {
      v16f q[RV];
      for (int v = 0; v < RV; ++v) q[v] = _mm512_loadu_ps(qt + (d + h) * rp + 16 * v);
      for (int j = 0; j < KT; ++j) {
        const v16f k = _mm512_set1_ps(kf[(j0 + j) * D + d + h]);
        for (int v = 0; v < RV; ++v) a[h][j][v] = _mm512_fmadd_ps(q[v], k, a[h][j][v]);
      }
    }
  for (int j = 0; j < KT; ++j)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + (j0 + j) * rp + 16 * v, _mm512_add_ps(a[0][j][v], a[1][j][v]));
}

template <int RV>
inline void score_keys(const float* qt, int64_t rp, const float* kf, int64_t D, int64_t n, float* st) {
  int64_t j = 0;
  for (; j + kTileKeys <= n; j += kTileKeys) score_tile<RV, kTileKeys>(qt, rp, kf, D, j, st);
  for (; j < n; ++j) score_tile<RV, 1>(qt, rp, kf, D, j, st);
}

// acc[r][c0 .. c0 + 16 NV) = acc * rescale[r] + sum_{j < n} st[j][r] v_j, rows r0 .. r0 + R.
template <int R, int NV>
inline void value_tile(float* acc, int64_t D, const float* st, int64_t rp, const float* rescale, const float* vf,
                       int64_t n, int64_t r0, int64_t c0) {
  v16f a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * D + c0 + 16 * c), _mm512_set1_ps(rescale[r0 + r]));
  for (int64_t j = 0; j < n; ++j) {
    v16f v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(vf + j * D + c0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const v16f p = _mm512_set1_ps(st[j * rp + r0 + r]);
      for (int c = 0; c < NV; ++c) a[r][c] = _mm512_fmadd_ps(p, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (r0 + r) * D + c0 + 16 * c, a[r][c]);
}

template <int R>
inline void value_rows(float* acc, int64_t D, const float* st, int64_t rp, const float* rescale, const float* vf,
                       int64_t n, int64_t r0) {
  for (int64_t c0 = 0; c0 < D; c0 += kTileDims) {
    switch (std::min<int64_t>(4, (D - c0) / 16)) {
      case 4: value_tile<R, 4>(acc, D, st, rp, rescale, vf, n, r0, c0); break;
      case 3: value_tile<R, 3>(acc, D, st, rp, rescale, vf, n, r0, c0); break;
      case 2: value_tile<R, 2>(acc, D, st, rp, rescale, vf, n, r0, c0); break;
      default: value_tile<R, 1>(acc, D, st, rp, rescale, vf, n, r0, c0); break;
    }
  }
}

// prefill_task's contract, D % 16 == 0. Rows r = t * G + g as there, padded to rp (a multiple of 16)
// with rows that see no key.
template <class Cache, class T = typename Cache::T>
void prefill_task_wide(const float* q, const T* k, const T* v, const int32_t* pos, int64_t nq, int64_t C, int64_t H,
                       int64_t K, int64_t D, int64_t kh, int64_t window, bool ring, float* out, float* scratch) {
  const int64_t G = H / K, rows = nq * G, rp = (rows + 15) / 16 * 16;
  const float scale = 1.f / std::sqrt((float)D);
  // scratch: qt [D, rp], acc [rp, D], kf [kKeys, D], vf [kKeys, D], st [kKeys, rp], m, l, rescale,
  // last, first (each row's last and first visible position; last -1: none) [rp]
  float* qt = scratch;
  float* acc = qt + D * rp;
  float* kf = acc + rp * D;
  float* vf = kf + kKeys * D;
  float* st = vf + kKeys * D;
  float* m = st + kKeys * rp;
  float* l = m + rp;
  float* rescale = l + rp;
  float* last = rescale + rp;
  float* first = last + rp;
  int64_t start, reach;
  keys_reached(pos, nq, C, window, ring, start, reach);
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t t = r / G, g = r % G;
    const bool real = r < rows;
    for (int64_t d = 0; d < D; ++d) qt[d * rp + r] = real ? q[(t * H + kh * G + g) * D + d] * scale : 0.f;
    std::memset(acc + r * D, 0, sizeof(float) * D);
    m[r] = -INFINITY, l[r] = 0.f;
    const KeySpan span = key_span(real ? pos[t] : -1, C, window, ring);  // a padding row's: none
    last[r] = static_cast<float>(span.last), first[r] = static_cast<float>(span.first);
  }
  const int64_t step = K * D;
  const int64_t rv = rp / 16;
  for (int64_t j0 = start; j0 < reach; j0 += kKeys) {
    const int64_t n = std::min(kKeys, reach - j0);
    widen_keys<Cache>(k, v, j0, n, step, ring ? C : 0, kh, D, kf, vf);
    for (int64_t v0 = 0; v0 < rv; v0 += 4) {
      const float* qv = qt + 16 * v0;
      float* sv = st + 16 * v0;
      switch (std::min<int64_t>(4, rv - v0)) {
        case 4: score_keys<4>(qv, rp, kf, D, n, sv); break;
        case 3: score_keys<3>(qv, rp, kf, D, n, sv); break;
        case 2: score_keys<2>(qv, rp, kf, D, n, sv); break;
        default: score_keys<1>(qv, rp, kf, D, n, sv); break;
      }
    }
    // Per lane (row): keys past its position or before its window score -inf; its max, e^(s - max)
    // in place, their sum in key order. A row that sees none of these keys keeps m, l and acc
    // (rescale 1, p 0).
    for (int64_t v0 = 0; v0 < rv; ++v0) {
      const v16f lastv = _mm512_loadu_ps(last + 16 * v0), firstv = _mm512_loadu_ps(first + 16 * v0);
      const __mmask16 sees = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j0)), lastv, _CMP_LE_OQ) &
                             _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j0 + n - 1)), firstv, _CMP_GE_OQ);
      const v16f mold = _mm512_loadu_ps(m + 16 * v0);
      v16f mx = mold;
      for (int64_t j = 0; j < n; ++j) {
        float* s = st + j * rp + 16 * v0;
        const v16f key = _mm512_set1_ps(static_cast<float>(j0 + j));
        const __mmask16 visible = _mm512_cmp_ps_mask(key, lastv, _CMP_LE_OQ) & _mm512_cmp_ps_mask(key, firstv, _CMP_GE_OQ);
        const v16f sj = _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(s));
        _mm512_storeu_ps(s, sj);
        mx = _mm512_max_ps(mx, sj);
      }
      const v16f resc = _mm512_mask_blend_ps(sees, _mm512_set1_ps(1.f), exp16(_mm512_sub_ps(mold, mx)));
      v16f sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        float* s = st + j * rp + 16 * v0;
        const v16f p = _mm512_maskz_mov_ps(sees, exp16(_mm512_sub_ps(_mm512_loadu_ps(s), mx)));
        _mm512_storeu_ps(s, p);
        sum = _mm512_add_ps(sum, p);
      }
      const v16f lold = _mm512_loadu_ps(l + 16 * v0);
      _mm512_storeu_ps(l + 16 * v0, _mm512_mask_blend_ps(sees, lold, _mm512_fmadd_ps(lold, resc, sum)));
      _mm512_storeu_ps(m + 16 * v0, _mm512_mask_blend_ps(sees, mold, mx));
      _mm512_storeu_ps(rescale + 16 * v0, resc);
    }
    int64_t r0 = 0;
    for (; r0 + kTileRows <= rows; r0 += kTileRows) value_rows<kTileRows>(acc, D, st, rp, rescale, vf, n, r0);
    for (; r0 + 4 <= rows; r0 += 4) value_rows<4>(acc, D, st, rp, rescale, vf, n, r0);
    for (; r0 + 2 <= rows; r0 += 2) value_rows<2>(acc, D, st, rp, rescale, vf, n, r0);
    for (; r0 < rows; ++r0) value_rows<1>(acc, D, st, rp, rescale, vf, n, r0);
  }
  write_rows(acc, l, rows, G, H, kh, D, out);
}
#endif

template <class Cache>
ffi::Error AttendPrefill(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k_cache,
                         ffi::AnyBuffer& v_cache, ffi::Buffer<ffi::S32>& slots, ffi::Buffer<ffi::S32>& positions,
                         ffi::ResultBuffer<ffi::F32>& out, int64_t window, bool ring) {
  using T = typename Cache::T;
  const auto qd = q.dimensions(), cd = k_cache.dimensions();
  if (qd.size() != 4 || cd.size() != 4) return ffi::Error::InvalidArgument("attention_prefill: q [B,T,H,D], caches [N,C,K,D]");
  const int64_t B = qd[0], Tq = qd[1], H = qd[2], D = qd[3], N = cd[0], C = cd[1], K = cd[2];
  if (!head_fits<Cache>(cd[3], D) || K == 0 || H % K != 0)
    return ffi::Error::InvalidArgument("attention_prefill: head dims do not match (D % 8 == 0, q8_0: D % 32 == 0; H % K == 0)");
  if (window < 0 || (ring && (window == 0 || window + Tq > C)))
    return ffi::Error::InvalidArgument("attention_prefill: a ring must hold the window and the chunk");
  const int32_t* sp = slots.typed_data();
  const int32_t* pp = positions.typed_data();
  for (int64_t b = 0; b < B; ++b)
    if (sp[b] < 0 || sp[b] >= N) return ffi::Error::InvalidArgument("attention_prefill: slot out of range");
  const T* kp = static_cast<const T*>(k_cache.untyped_data());
  const T* vp = static_cast<const T*>(v_cache.untyped_data());
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  const int64_t blocks = (Tq + kQueries - 1) / kQueries, tasks = B * blocks * K, G = H / K;
#if defined(__AVX512F__)
  const bool wide = D % 16 == 0;
#else
  const bool wide = false;
#endif
  const int64_t rp = (kQueries * G + 15) / 16 * 16;
  const int64_t scratch = wide ? 2 * rp * D + 2 * kKeys * D + kKeys * rp + 5 * rp
                               : (2 * kQueries * G + 2 * kKeys) * D + 2 * kQueries * G;
  parallel_for(pool, tasks > 1 ? pool_threads(pool) : 1, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer(scratch);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / (blocks * K), qb = (task / K) % blocks, kh = task % K;
      const int64_t first = qb * kQueries, nq = std::min(kQueries, Tq - first);
      const int64_t base = (int64_t)sp[b] * C * K * D;
      const float* qf = qp + (b * Tq + first) * H * D;
      float* of = op + (b * Tq + first) * H * D;
#if defined(__AVX512F__)
      if (wide) {
        prefill_task_wide<Cache>(qf, Cache::at(kp, base), Cache::at(vp, base), pp + b * Tq + first, nq, C, H, K, D, kh, window, ring, of,
                                 buffer.data());
        continue;
      }
#endif
      prefill_task<Cache>(qf, Cache::at(kp, base), Cache::at(vp, base), pp + b * Tq + first, nq, C, H, K, D, kh, window, ring, of,
                                 buffer.data());
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttentionPrefill(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                            ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> positions,
                            ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t ring) {
  return by_cache_type("attention_prefill", k_cache, v_cache, [&](auto cache) {
    return AttendPrefill<decltype(cache)>(pool, q, k_cache, v_cache, slots, positions, out, window, ring != 0);
  });
}

}  // namespace
}  // namespace pantheon

// Both kernels take q, the two caches, the rows' slots and an int32 per row or query (lengths,
// positions) and return f32.
static auto attention_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
      .Arg<xla::ffi::AnyBuffer>()
      .Arg<xla::ffi::AnyBuffer>()
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonAttentionDecode, pantheon::AttentionDecode,
                              attention_binding().Attr<int64_t>("window").Attr<int64_t>("ring"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonAttentionPrefill, pantheon::AttentionPrefill,
                              attention_binding().Attr<int64_t>("window").Attr<int64_t>("ring"));
