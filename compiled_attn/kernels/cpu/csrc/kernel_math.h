// Vector arithmetic shared by the decode kernel's paths (block_partials.cpp, tile_blocks.h, wide_blocks.h,
// row_merge.h): 16-float vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones), loaders from
// each cache dtype to float32, horizontal sums, exp; and the Problem one kernel call solves.
#pragma once
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

// (not v16{} + x: strict IEEE arithmetic keeps that addition of +0, an instruction before every broadcast)
static inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 loadf(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
static inline void storef(float* p, v16 v) { std::memcpy(p, &v, 64); }

static inline float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Steps of horizontal sums over two vectors at once: halves_sum(x, y) holds x's lanes i + lanes i + 8 in its first 8
// lanes and y's in the next 8; quarters_sum(x, y) likewise with lanes i and i + 4 of each half.
static inline v16 halves_sum(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16 quarters_sum(v16 x, v16 y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}

// The sums of four vectors as one 4-lane vector: a tree of shuffles shared by the four (a quarter of the
// instructions of four separate horizontal sums, which were a third of the scoring time).
static inline v4f hsum4(v16 a, v16 b, v16 c, v16 d) {
  const v16 x = quarters_sum(halves_sum(a, b), halves_sum(c, d));  // per vector 4 partial sums, in order
  const v16 y = __builtin_shufflevector(x, x, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(x, x, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
}

// The sums of eight vectors (a's four, then b's) as one 8-lane vector: the same tree over both, a quarter fewer
// instructions than two hsum4s, in the same order of additions.
typedef float v8f __attribute__((vector_size(32)));
static inline v8f hsum4x2(v16 a0, v16 a1, v16 a2, v16 a3, v16 b0, v16 b1, v16 b2, v16 b3) {
  const v16 xa = quarters_sum(halves_sum(a0, a1), halves_sum(a2, a3));
  const v16 xb = quarters_sum(halves_sum(b0, b1), halves_sum(b2, b3));
  const v16 y = __builtin_shufflevector(xa, xb, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(xa, xb, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y, y, 1, 3, 5, 7, 9, 11, 13, 15);
}

// 16 IEEE half-precision bit patterns -> float32.
static inline v16 half_to_float(u16x16 w) {
  v16 f;
#if defined(__AVX512F__)
  __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&w)));
  std::memcpy(&f, &r, 64);
#elif defined(__F16C__)
  const __m128i* x = reinterpret_cast<const __m128i*>(&w);
  __m256 ra = _mm256_cvtph_ps(_mm_loadu_si128(x)), rb = _mm256_cvtph_ps(_mm_loadu_si128(x + 1));
  std::memcpy(&f, &ra, 32);
  std::memcpy(reinterpret_cast<char*>(&f) + 32, &rb, 32);
#else
  u32x16 x = __builtin_convertvector(w, u32x16);
  u32x16 bits = ((x & 0x8000) << 16) | ((x & 0x7fff) << 13);
  std::memcpy(&f, &bits, 64);
  f = f * 5.192296858534828e+33f;  // 2^112, half's exponent bias (15) to float's (127); exact for subnormals
#endif
  return f;
}

// Loaders: 16 stored elements -> float32. E4M3 comes out times 2^-8 (its bits placed as a half's, whose bias is
// 8 more), which the caller folds into the scale; float8 NaN codes become finite (a quantised cache holds
// finite values), as in kv_dtype.fp8_to.
struct F32 {
  typedef float T;
  static v16 load(const float* p) { return loadf(p); }
};
struct BF16 {
  typedef uint16_t T;
  static v16 load(const uint16_t* p) {
    u16x16 x;
    std::memcpy(&x, p, 32);
    u32x16 w = __builtin_convertvector(x, u32x16) << 16;
    v16 f;
    std::memcpy(&f, &w, 64);
    return f;
  }
};
struct F16 {
  typedef uint16_t T;
  static v16 load(const uint16_t* p) {
    u16x16 x;
    std::memcpy(&x, p, 32);
    return half_to_float(x);
  }
};
struct E5M2 {  // the upper byte of a half
  typedef uint8_t T;
  static v16 load(const uint8_t* p) {
    u8x16 x;
    std::memcpy(&x, p, 16);
    return half_to_float(__builtin_convertvector(x, u16x16) << 8);
  }
};
struct E4M3 {
  typedef uint8_t T;
  static v16 load(const uint8_t* p) {
    i8x16 x;
    std::memcpy(&x, p, 16);
    // the sign-extended byte moved 7 left: its exponent and mantissa land in a half's, and of the copies of its
    // sign above them the mask keeps only the top one (three instructions where a separate sign took five)
    u16x16 w = (u16x16)__builtin_convertvector(x, i16x16) << 7;
    return half_to_float(w & 0xBF80);
  }
};

#include "half_vectors.h"

// 32 stored elements -> float32, the first 16 into a and the next 16 into b. The float8 formats widen all 32 bytes
// in one 512-bit register and convert its two halves: a quarter fewer instructions than two 16-element loads.
template <class L>
static inline void load32(const typename L::T* p, v16& a, v16& b) {
  a = L::load(p), b = L::load(p + 16);
}
#if defined(__AVX512BW__)
static inline void halves_to_float(__m512i w, v16& a, v16& b) {
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
  std::memcpy(&a, &lo, 64);
  std::memcpy(&b, &hi, 64);
}
template <>
inline void load32<E5M2>(const uint8_t* p, v16& a, v16& b) {
  halves_to_float(_mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 8),
                  a, b);
}
template <>
inline void load32<E4M3>(const uint8_t* p, v16& a, v16& b) {  // E4M3::load's bits, 32 at a time
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  halves_to_float(_mm512_and_si512(_mm512_slli_epi16(x, 7), _mm512_set1_epi16((short)0xBF80)), a, b);
}
#endif

// N x 16 stored elements -> N float32 vectors, 32 elements at a time through load32.
template <class L, int N>
static inline void load_vectors(const typename L::T* p, v16* out) {
  for (int j = 0; j + 1 < N; j += 2) load32<L>(p + 16 * j, out[j], out[j + 1]);
  if constexpr (N % 2) out[N - 1] = L::load(p + 16 * (N - 1));
}

// n (a multiple of 16) stored elements times mul -> float32 at dst, 32 at a time through load32.
template <class L>
static inline void row_to_float(const typename L::T* p, int64_t n, float mul, float* dst) {
#if !defined(__AVX512F__)
  for (int64_t d = 0; d < n; d += 8) storef8(dst + d, load8<L>(p + d) * mul);
#else
  int64_t d = 0;
  for (v16 a, b; d + 32 <= n; d += 32) {
    load32<L>(p + d, a, b);
    storef(dst + d, a * mul), storef(dst + d + 16, b * mul);
  }
  if (d < n) storef(dst + d, L::load(p + d) * mul);
#endif
}

// The cache formats whose values bfloat16 holds exactly (a half-precision cache keeps its 11-bit significands on
// the float32 paths).
template <class L> struct Bf16Exact { static constexpr bool ok = false; };
template <> struct Bf16Exact<BF16> { static constexpr bool ok = true; };
template <> struct Bf16Exact<E4M3> { static constexpr bool ok = true; };
template <> struct Bf16Exact<E5M2> { static constexpr bool ok = true; };

#if defined(__AVX512BF16__)
// 32 stored elements -> bf16 in a register, exactly (the formats of Bf16Exact)
template <class L>
static inline __m512i load32_bf16(const typename L::T* src) {
  v16 a, b;
  load32<L>(src, a, b);
  return (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a);
}
template <>
inline __m512i load32_bf16<BF16>(const uint16_t* src) {
  return _mm512_loadu_si512(src);
}

// n (a multiple of 32) floats times mul -> bf16, rounded to nearest even
static inline void to_bf16_rows(const float* x, float mul, int64_t n, uint16_t* out) {
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i + 16), m),
                                           _mm512_mul_ps(_mm512_loadu_ps(x + i), m));
    std::memcpy(out + i, &y, 64);
  }
}
#endif

// exp(x) for x <= 0 (scores minus their max): range reduction to 2^n * e^r, |r| <= ln2 / 2, and e^r = 1 + r +
// r^2 q(r) with q a cubic fitted for relative error (at most 1.7e-7, float32's rounding is 6e-8); 2^n applied by
// vscalefps where there is AVX-512 (one instruction for what the exponent bits took four). Inputs below -87 give
// about e^-87 (callers mask where they need 0).
static inline v16 vexp(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 q = splat(8.312533609569073e-3f);
  q = q * r + 4.189012572169304e-2f;
  q = q * r + 1.6667114198207855e-1f;
  q = q * r + 4.99992311000824e-1f;
  const v16 y = q * (r * r) + (r + 1.0f);
#if defined(__AVX512F__)
  v16 out;
  const __m512 z = _mm512_scalef_ps((__m512)y, (__m512)n);
  std::memcpy(&out, &z, 64);
  return out;
#else
  i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  v16 s;
  std::memcpy(&s, &e, 64);
  return y * s;
#endif
}

struct Problem {
  const float* qs;           // [rows, hkv, G, D] queries: a score is qs . K times k_mul
  const int64_t* block_req;  // [n] query row of each block
  const int64_t* slots;      // [n, B] KV slot of each block position
  const uint8_t* valid;      // [n, B]
  const void* k;             // cache rows: element (slot, head, d) at slot * k_row + head * k_head + d
  const void* v;
  int64_t k_row, k_head, v_row, v_head;
  int64_t n, hkv, G, D, Dv, B;
  int64_t num_slots;        // rows of the caches: a valid position's slot outside them is refused, never read
  float k_mul, v_mul, cap;  // dequantisation scales (the E4M3 factor folded in); cap: logit soft-cap or 0
  int threads;
  // blocks whose block_req is >= rows are skipped, then each row's blocks are merged (log-sum-exp rule), with
  // sinks [hkv * G] joining every denominator, into out: token-major [rows * out_tokens, hkv * G / out_tokens, Dv]
  // (query row h * G + t * (G / out_tokens) + g of row r at token r * out_tokens + t, head h * G / out_tokens + g),
  // float32 or (out_bf16) bfloat16
  int64_t rows;
  const float* sinks;
  void* out;
  int64_t out_tokens;
  bool out_bf16;
  // > 0: qs is a bfloat16 query times this scale, which the tile path (tile_blocks.h) takes back to bf16 exactly
  float q_bf16_scale;
  // verify: nd more keys per row (draft_slots [rows, nd]), seen by query row i of a KV head where
  // draft_mask [rows, tokens, nd] shows them to its token i / (G / tokens); nullptr: none
  const int64_t* draft_slots;
  const uint8_t* draft_mask;
  int64_t nd, tokens;
  // the bf16 queries as the caller holds them (token-major, out_tokens a row), where qs is null: the
  // tile path packs them as they are, other paths convert them first (run_blocks), the draft block a row at a time
  const uint16_t* q_bf16 = nullptr;
  // [hkv * G] where query row i of a row lies among the row's token-major rows (token_major_offset's
  // r = 0, width 1): the output's and the bf16 queries' offsets, looked up (their divisions per query row had cost
  // as much as the merge's arithmetic)
  const int64_t* token_rows = nullptr;
  // which path computes the blocks (KernelPath): chosen by the caller (compiled_attn/forms.py), refused by the
  // kernel where this build or the call's shapes cannot run it (path_fits)
  int path = 0;
};

// The kernel's paths: the vector path (float32 products; bf16 pair products with AVX512-BF16), the wide path
// (float32 outer products, 16 query rows a vector: wide_blocks.h) and the tile path (AMX bf16: tile_blocks.h).
enum KernelPath : int { kVector = 0, kVectorBf16 = 1, kWide = 2, kTile = 3 };

// Where query row i (h * G + t * (G / tokens) + g) of row r starts in token-major rows [rows * tokens, hkv * G /
// tokens, width] (the queries as the caller holds them, the output): token r * tokens + t, head
// h * G / tokens + g.
static inline int64_t token_major_offset(int64_t r, int64_t i, int64_t tokens, int64_t hkv, int64_t G,
                                         int64_t width) {
  const int64_t per_token = G / tokens, h = i / G, t = i % G / per_token, g = i % per_token;
  return ((r * tokens + t) * hkv * per_token + h * per_token + g) * width;
}

// Query row i of row r in the token-major bf16 queries.
static inline const uint16_t* query_bf16(const Problem& pr, int64_t r, int64_t i) {
  return pr.q_bf16 + (r * pr.hkv * pr.G + pr.token_rows[i]) * pr.D;
}

// The first n (<= 16) of p's floats, `fill` in the other lanes.
static inline v16 load_first(const float* p, int64_t n, float fill) {
  if (n >= 16) return loadf(p);
  float x[16];
  for (int64_t i = 0; i < 16; ++i) x[i] = i < n ? p[i] : fill;
  return loadf(x);
}

// NR query rows' weighted sums over n value rows (vp: the rows, float32 or, AVX2, L's rows read through key16, whose
// column order the sums then keep; ids: where each one's weights are) for NCH x 16 columns from cb: row j's
// o + j * Dv += w[ids[i] * 16 + j] times value row i's columns, in registers (each value load serves the NR rows).
template <int NR, int NCH, class L = F32>
static inline void weighted_rows(const int64_t* ids, const typename L::T* const* vp, int64_t n, const float* w,
                                 int64_t cb, float* o, int64_t Dv) {
#if !defined(__AVX512F__)
  // AVX2: CH chunks of 16 columns a pass over the value rows, NR x CH x 2 half sums in at most 8 registers (NR x
  // NCH v16 sums were up to 32)
  constexpr int CH = NR >= 4 ? 1 : NR >= 2 ? (NCH % 2 ? 1 : 2) : NCH;
  for (int j0 = 0; j0 < NCH; j0 += CH) {
    float* oj = o + 16 * j0;
    v8f a[NR][CH][2];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < CH; ++j)
        a[r][j][0] = loadf8(oj + r * Dv + 16 * j), a[r][j][1] = loadf8(oj + r * Dv + 16 * j + 8);
    for (int64_t i = 0; i < n; ++i) {
      const float* wp = w + ids[i] * 16;
      const typename L::T* vr = vp[i] + cb + 16 * j0;
      v8f v[CH][2];
      for (int j = 0; j < CH; ++j) key16<L>(vr + 16 * j, v[j]);
      for (int r = 0; r < NR; ++r) {
        const v8f wr = splat8(wp[r]);
        for (int j = 0; j < CH; ++j) a[r][j][0] += wr * v[j][0], a[r][j][1] += wr * v[j][1];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < CH; ++j)
        storef8(oj + r * Dv + 16 * j, a[r][j][0]), storef8(oj + r * Dv + 16 * j + 8, a[r][j][1]);
  }
#else
  static_assert(std::is_same<L, F32>::value, "float32 rows");
  v16 a[NR][NCH];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NCH; ++j) a[r][j] = loadf(o + r * Dv + 16 * j);
  for (int64_t i = 0; i < n; ++i) {
    const float* wp = w + ids[i] * 16;
    const float* vr = vp[i] + cb;
    v16 v[NCH];
    for (int j = 0; j < NCH; ++j) v[j] = loadf(vr + 16 * j);
    for (int r = 0; r < NR; ++r) {
      const v16 wr = splat(wp[r]);
      for (int j = 0; j < NCH; ++j) a[r][j] += wr * v[j];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NCH; ++j) storef(o + r * Dv + 16 * j, a[r][j]);
#endif
}

// weighted_rows for nch (1 to 4) chunks of 16 columns known at run time: each count compiled on its own, so that the
// sums stay in registers.
template <int NR, class L = F32>
static inline void weighted_rows_n(int64_t nch, const int64_t* ids, const typename L::T* const* vp, int64_t n,
                                   const float* w, int64_t cb, float* o, int64_t Dv) {
  switch (nch) {
    case 4: weighted_rows<NR, 4, L>(ids, vp, n, w, cb, o, Dv); break;
    case 3: weighted_rows<NR, 3, L>(ids, vp, n, w, cb, o, Dv); break;
    case 2: weighted_rows<NR, 2, L>(ids, vp, n, w, cb, o, Dv); break;
    default: weighted_rows<NR, 1, L>(ids, vp, n, w, cb, o, Dv); break;
  }
}

// A per-call buffer left uninitialised (every element is written before it is read): a std::vector's zero fill of
// the tile path's buffers was a memset of megabytes per call.
template <class T>
struct Scratch {
  std::unique_ptr<T[]> p;
  int64_t n = 0;
  void resize(int64_t size) {
    if (size > n) p.reset(new T[size]), n = size;
  }
  T* data() { return p.get(); }
};

constexpr int64_t kFarKeys = 8;  // key positions ahead whose rows go into L2 where slots are out of order
constexpr int64_t kPrefetch = 2;  // key positions ahead: random rows (page size 1) come from memory, not a stream

// Prefetches the lines of `bytes` bytes at p (locality 3: into L1; 2: into L2).
template <int locality = 3>
static inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* a = static_cast<const char*>(p);
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(a + c, 0, locality);
}
