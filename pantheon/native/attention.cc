// Decode attention read in place from the slot cache, as an XLA FFI custom call on the CPU: one
// query token per row, row b attending to keys 0..lens[b]-1 of slot slots[b] (a sliding layer's:
// the last `window` of them, from a ring where its cache is one, model/state.py). The jnp path
// (pantheon/pallas/attention.py: cached_attention_blocked) loops over key blocks with masks and
// rescales; this reads each row's keys and values once, at memory speed.
//
// Per (row, kv head): scores s = (q * D^-0.5) . k for every key, softmax over them (max, exp, sum),
// then sum_j p_j v_j / sum_j p_j. Each row is computed alone, in a fixed order, so its result does
// not depend on its batch-mates. The cache may hold f32, f16 or bf16 (--kv-dtype); each value is
// widened to f32 exactly as it is loaded, and all arithmetic is f32.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace pantheon {
namespace {

// e^x for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); 0 below
// -87.3, where the f32 result would be subnormal or 0.
inline v8f exp8(v8f x) {
  const __m256 xs = (__m256)x;
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(xs, lo, _CMP_LT_OQ);
  __m256 v = _mm256_max_ps(xs, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), v);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, v), v, _mm256_add_ps(v, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return (v8f)_mm256_andnot_ps(under, r);
}

// Eight cache values as f32, from the cache's element type: f32, f16 (F16C) or bf16 (the upper
// half of an f32). Both conversions are exact, so a cache's values enter the same arithmetic.
inline v8f load_kv(const uint16_t* p, std::true_type /*f16*/) {
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
inline v8f load_kv(const uint16_t* p, std::false_type /*bf16*/) {
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
struct F32Cache { using T = float; static v8f load(const float* p) { return load8(p); } };
struct F16Cache { using T = uint16_t; static v8f load(const uint16_t* p) { return load_kv(p, std::true_type{}); } };
struct BF16Cache { using T = uint16_t; static v8f load(const uint16_t* p) { return load_kv(p, std::false_type{}); } };

// One (row, kv head, key chunk): G query heads q [G, D] against n keys/values at k, v (stride
// `step` floats between positions) -> per head the score max m, the sum l of e^(s - m), and
// acc = sum_j e^(s_j - m) v_j [G, D]. scores: scratch of G * round_up(n, 8) floats.
template <class Cache, class T = typename Cache::T>
void attend_part(const float* q, const T* k, const T* v, int64_t step, int64_t n, int64_t G, int64_t D,
                 float* scores, float* m_out, float* l_out, float* acc_out) {
  const int64_t n8 = (n + 7) / 8 * 8, d8 = D / 8;
  const float scale = 1.f / std::sqrt((float)D);
  std::vector<v8f> qs(G * d8);
  for (int64_t i = 0; i < G * d8; ++i) qs[i] = load8(q + 8 * i) * scale;
  // Scores four keys at a time: four independent FMA chains instead of one latency-bound chain.
  // Each score is the same sequence of operations either way.
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* kj = k + j * step;
    for (int64_t g = 0; g < G; ++g) {
      const v8f* qg = qs.data() + g * d8;
      v8f a0 = qg[0] * Cache::load(kj), a1 = qg[0] * Cache::load(kj + step), a2 = qg[0] * Cache::load(kj + 2 * step),
          a3 = qg[0] * Cache::load(kj + 3 * step);
      for (int64_t c = 1; c < d8; ++c) {
        a0 = fma8(qg[c], Cache::load(kj + 8 * c), a0);
        a1 = fma8(qg[c], Cache::load(kj + step + 8 * c), a1);
        a2 = fma8(qg[c], Cache::load(kj + 2 * step + 8 * c), a2);
        a3 = fma8(qg[c], Cache::load(kj + 3 * step + 8 * c), a3);
      }
      float* s = scores + g * n8 + j;
      s[0] = hsum(a0), s[1] = hsum(a1), s[2] = hsum(a2), s[3] = hsum(a3);
    }
  }
  for (; j < n; ++j) {
    const T* kj = k + j * step;
    for (int64_t g = 0; g < G; ++g) {
      const v8f* qg = qs.data() + g * d8;
      v8f acc = qg[0] * Cache::load(kj);
      for (int64_t c = 1; c < d8; ++c) acc = fma8(qg[c], Cache::load(kj + 8 * c), acc);
      scores[g * n8 + j] = hsum(acc);
    }
  }
  std::vector<v8f> acc(G * d8, v8f{});
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n8;
    float m = s[0];
    for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = n; j < n8; ++j) s[j] = -INFINITY;  // exp -> 0
    v8f sum = v8f{};
    for (int64_t j = 0; j < n8; j += 8) {
      const v8f p = exp8(load8(s + j) - m);
      store8(s + j, p);
      sum += p;
    }
    m_out[g] = m;
    l_out[g] = hsum(sum);
    v8f* a = acc.data() + g * d8;
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + j * step;
      const v8f p = v8f{} + s[j];
      for (int64_t c = 0; c < d8; ++c) a[c] = fma8(p, Cache::load(vj + 8 * c), a[c]);
    }
    for (int64_t c = 0; c < d8; ++c) store8(acc_out + g * D + 8 * c, a[c]);
  }
}

// Keys per chunk: a long row is split into chunks of this many keys (by absolute position, so the
// split depends only on the row's own length), attended in parallel, then merged in order.
constexpr int64_t kChunk = 1024;

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
  if (cd[3] != D || D % 8 != 0 || K == 0 || H % K != 0)
    return ffi::Error::InvalidArgument("attention_decode: head dims do not match (D % 8 == 0, H % K == 0)");
  if (ring && (window <= 0 || window > C)) return ffi::Error::InvalidArgument("attention_decode: a ring needs a window it holds");
  const int32_t* sp = slots.typed_data();
  const int32_t* lp = lens.typed_data();
  for (int64_t b = 0; b < B; ++b)
    if (sp[b] < 0 || sp[b] >= N || (!ring && lp[b] > C)) return ffi::Error::InvalidArgument("attention_decode: slot or length out of range");
  const int64_t G = H / K;
  const float* qp = q.typed_data();
  const T* kp = static_cast<const T*>(k_cache.untyped_data());
  const T* vp = static_cast<const T*>(v_cache.untyped_data());
  float* op = out->typed_data();
  // Tasks: (row, kv head, piece); each writes its piece's m, l and acc, merged below per (row, head).
  std::vector<int64_t> first(B * K + 1, 0);  // first task of each (row, head)
  std::vector<Piece> pieces, row;  // the tasks' pieces
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    row_pieces(lp[b] > 0 ? lp[b] : 0, window, C, ring, row);
    for (const Piece& piece : row) keys += piece.n;
    for (int64_t kh = 0; kh < K; ++kh) {
      first[b * K + kh + 1] = first[b * K + kh] + static_cast<int64_t>(row.size());
      pieces.insert(pieces.end(), row.begin(), row.end());
    }
  }
  const int64_t tasks = first[B * K];
  std::vector<float> ms(tasks * G), ls(tasks * G), accs(tasks * G * D);
  const int64_t threads = keys * K * D >= (int64_t{1} << 16) ? pool_threads(pool) : 1;
  std::vector<int64_t> owner(tasks);  // task -> its (row, head)
  for (int64_t i = 0; i < B * K; ++i)
    for (int64_t t = first[i]; t < first[i + 1]; ++t) owner[t] = i;
  parallel_for(pool, threads, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = owner[t], b = i / K, kh = i % K;
      const int64_t base = ((int64_t)sp[b] * C * K + kh) * D;
      const int64_t start = pieces[t].start % C, n = pieces[t].n;  // a piece never wraps a ring
      scores.resize(G * ((n + 7) / 8 * 8));
      attend_part<Cache>(qp + (b * H + kh * G) * D, kp + base + start * K * D, vp + base + start * K * D, K * D, n, G, D,
                  scores.data(), &ms[t * G], &ls[t * G], &accs[t * G * D]);
    }
  });
  for (int64_t i = 0; i < B * K; ++i) {  // merge each (row, head)'s chunks, in order
    float* o = op + ((i / K) * H + (i % K) * G) * D;
    if (first[i] == first[i + 1]) {  // no key visible: zeros, as the reference
      std::memset(o, 0, sizeof(float) * G * D);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      float m = -INFINITY;
      for (int64_t t = first[i]; t < first[i + 1]; ++t) m = std::max(m, ms[t * G + g]);
      float l = 0.f;
      for (int64_t d = 0; d < D; ++d) o[g * D + d] = 0.f;
      for (int64_t t = first[i]; t < first[i + 1]; ++t) {
        const float w = std::exp(ms[t * G + g] - m);
        l += w * ls[t * G + g];
        for (int64_t d = 0; d < D; ++d) o[g * D + d] += w * accs[(t * G + g) * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[g * D + d] /= l;
    }
  }
  return ffi::Error::Success();
}

// The caches' element type picks the loader: f32, f16 or bf16 (--kv-dtype), both caches alike.
// window > 0: a sliding window, keys len - window .. len - 1; ring != 0: the caches are rings.
ffi::Error AttentionDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> lens,
                           ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t ring) {
  const auto type = k_cache.element_type();
  if (v_cache.element_type() != type) return ffi::Error::InvalidArgument("attention_decode: k and v caches differ in type");
  switch (type) {
    case ffi::DataType::F32: return AttendDecode<F32Cache>(pool, q, k_cache, v_cache, slots, lens, out, window, ring != 0);
    case ffi::DataType::F16: return AttendDecode<F16Cache>(pool, q, k_cache, v_cache, slots, lens, out, window, ring != 0);
    case ffi::DataType::BF16: return AttendDecode<BF16Cache>(pool, q, k_cache, v_cache, slots, lens, out, window, ring != 0);
    default: return ffi::Error::InvalidArgument("attention_decode: caches must be f32, f16 or bf16");
  }
}

}  // namespace
}  // namespace pantheon

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonAttentionDecode, pantheon::AttentionDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("ring"));
