// Decode attention's per-block partial softmax over a paged KV cache, read in place: the CPU kernel behind
// compiled_attn/native_decode.py, which builds this file with the machine's compiler on first use and calls it
// through ctypes (that module says why a hand-written kernel).
//
// One work item is one block of B key positions of one request. All its query rows (Hkv heads x G rows) are
// scored against each key row as the row is read (a slot's heads lie together in the cache, so a page of
// consecutive slots is read front to back), then softmaxed, then V is summed with the weights. K/V are converted
// to float32 in registers (bf16, fp16, float8 e4m3fn / e5m2), so the cache is read once at its stored width.
// Invalid positions (past a request's end, a page's unwritten tail) are never read. The outputs are those of
// decode_fused.fused_block_partials: per block and query row the max score m, the sum of exp(score - m) and the
// unnormalised weighted V sum; a block with no valid key gives the lowest float32, 0 and zeros.
//
// Portable C++ with GCC/Clang vector extensions (16 float lanes: one AVX-512 register, two AVX2 ones), built
// with -march=native; half precision converts with F16C/AVX-512 instructions when the target has them.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
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

static inline v16 splat(float x) { return v16{} + x; }
static inline v16 loadf(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
static inline void storef(float* p, v16 v) { std::memcpy(p, &v, 64); }

static inline float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The sums of four vectors as one 4-lane vector: a tree of shuffles shared by the four (a quarter of the
// instructions of four separate horizontal sums, which were a third of the scoring time).
static inline v4f hsum4(v16 a, v16 b, v16 c, v16 d) {
  v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
          __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v16 y = __builtin_shufflevector(x, x, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
          __builtin_shufflevector(x, x, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
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

// exp(x) for x <= 0 (scores minus their max): range reduction to 2^n * e^r, |r| <= ln2 / 2, and a degree-6
// polynomial; relative error about 1e-7. Inputs below -87 give about e^-87 (callers mask where they need 0).
static inline v16 vexp(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  v16 y = p * (r * r) + r + 1.0f;
  i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  v16 s;
  std::memcpy(&s, &e, 64);
  return y * s;
}

// out[g, :] = v_mul * sum_p w[g, p] * V[slot p, :] for GN query rows and DN x 16 columns, in registers.
template <class L, int GN, int DN>
static inline void weighted_v(const typename L::T* vb, const int64_t* slot, const uint8_t* val, int64_t B,
                              int64_t v_row, const float* w, int64_t Bp, float* out, int64_t Dv, float v_mul) {
  v16 acc[GN][DN] = {};
  for (int64_t p = 0; p < B; ++p) {
    if (!val[p]) continue;
    const typename L::T* vr = vb + slot[p] * v_row;
    v16 vv[DN];
    for (int j = 0; j < DN; ++j) vv[j] = L::load(vr + 16 * j);
    for (int g = 0; g < GN; ++g) {
      const float x = w[g * Bp + p];
      for (int j = 0; j < DN; ++j) acc[g][j] += x * vv[j];
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < DN; ++j) storef(out + g * Dv + 16 * j, acc[g][j] * v_mul);
}

template <class L>
static void weighted_v_any(int gn, int dn, const typename L::T* vb, const int64_t* slot, const uint8_t* val,
                           int64_t B, int64_t v_row, const float* w, int64_t Bp, float* out, int64_t Dv,
                           float v_mul) {
  for (int g = 0; g < gn; ++g)
    for (int j = 0; j < dn; ++j) {
      v16 acc{};
      for (int64_t p = 0; p < B; ++p)
        if (val[p]) acc += w[g * Bp + p] * L::load(vb + slot[p] * v_row + 16 * j);
      storef(out + g * Dv + 16 * j, acc * v_mul);
    }
}

struct Problem {
  const float* qs;           // [rows, hkv, G, D] scaled queries
  const int64_t* block_req;  // [n] query row of each block
  const int64_t* runs;       // [n, B / unit] first slot / unit of each run of unit consecutive slots
  const uint8_t* valid;      // [n, B]
  const void* k;             // cache rows: element (slot, head, d) at slot * k_row + head * k_head + d
  const void* v;
  int64_t k_row, k_head, v_row, v_head;
  int64_t n, hkv, G, D, Dv, B, unit;
  int64_t num_slots;        // rows of the caches: a valid position's slot outside them is refused, never read
  float k_mul, v_mul, cap;  // dequantisation scales (the E4M3 factor folded in); cap: logit soft-cap or 0
  float *m, *l, *o;         // [n, hkv, G], [n, hkv, G], [n, hkv, G, Dv]
  int threads;
  // merged form (out != nullptr): blocks whose block_req is >= rows are skipped, then each row's blocks are
  // merged into out [rows, hkv, G, Dv] (log-sum-exp rule), with sinks [hkv * G] joining every denominator
  int64_t rows;
  const float* sinks;
  float* out;
};

// out[r] = sum_b o_b e^(m_b - M) / (sum_b l_b e^(m_b - M) + e^(sink - M)), M the max of the m_b and the sink, over
// the blocks b of row r (first[r] .. first[r + 1] in order); zeros for a row with no block.
static void merge_row(const Problem& pr, int64_t r, const int64_t* first, const int64_t* order) {
  const int64_t R = pr.hkv * pr.G, Dv = pr.Dv;
  float* out = pr.out + r * R * Dv;
  std::memset(out, 0, sizeof(float) * R * Dv);
  for (int64_t i = 0; i < R; ++i) {
    float mx = pr.sinks ? pr.sinks[i] : -INFINITY;
    for (int64_t j = first[r]; j < first[r + 1]; ++j) mx = std::max(mx, pr.m[order[j] * R + i]);
    if (mx == -INFINITY) continue;  // no block, no sink
    float den = pr.sinks ? std::exp(pr.sinks[i] - mx) : 0.0f;
    float* o = out + i * Dv;
    for (int64_t j = first[r]; j < first[r + 1]; ++j) {
      const int64_t b = order[j];
      const float w = std::exp(pr.m[b * R + i] - mx);
      den += w * pr.l[b * R + i];
      const float* ob = pr.o + (b * R + i) * Dv;
      for (int64_t d = 0; d < Dv; d += 16) storef(o + d, loadf(o + d) + w * loadf(ob + d));
    }
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int64_t d = 0; d < Dv; d += 16) storef(o + d, loadf(o + d) * inv);
  }
}

constexpr int64_t kPrefetch = 4;  // key positions ahead: random rows (page size 1) come from memory, not a stream

// DV: D / 16 when the head size is one of the compiled-in sizes (the key row lives in registers), else 0.
// Returns 1 when a valid position's slot lay outside the cache (that position left out, nothing read there).
template <class L, int DV>
static int run_blocks(const Problem& pr) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t D = DV ? DV * 16 : pr.D, G = pr.G, hkv = pr.hkv, B = pr.B, Dv = pr.Dv;
  const int64_t nruns = B / pr.unit, R = hkv * G, Bp = (B + 15) / 16 * 16;
  // the merged form: each row's blocks in order (a counting sort of block_req), unused blocks dropped
  std::vector<int64_t> first, order;
  if (pr.out) {
    first.assign(pr.rows + 2, 0);
    for (int64_t b = 0; b < pr.n; ++b) first[std::min(pr.block_req[b], pr.rows) + 1]++;
    for (int64_t r = 0; r <= pr.rows; ++r) first[r + 1] += first[r];
    order.resize(pr.n);
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t b = 0; b < pr.n; ++b) order[fill[std::min(pr.block_req[b], pr.rows)]++] = b;
  }
  const int64_t used = pr.out ? first[pr.rows] : pr.n;  // the merged form computes order[0 .. used) only
  std::atomic<int> outside{0};
#pragma omp parallel num_threads(pr.threads)
  {
    std::vector<float> s(R * Bp), qv(R * D);
    std::vector<int64_t> slot(B);
    std::vector<uint8_t> keep(B);
#pragma omp for schedule(dynamic, 2)
    for (int64_t i = 0; i < used; ++i) {
      const int64_t b = pr.out ? order[i] : i;
      const float* qb = pr.qs + pr.block_req[b] * R * D;
      for (int64_t i = 0; i < R * D; ++i) qv[i] = qb[i] * pr.k_mul;  // K's scale applied to the queries
      for (int64_t p = 0; p < B; ++p) {
        slot[p] = pr.runs[b * nruns + p / pr.unit] * pr.unit + p % pr.unit;
        keep[p] = pr.valid[b * B + p];
        if (keep[p] && (slot[p] < 0 || slot[p] >= pr.num_slots)) {
          keep[p] = 0;
          outside.store(1, std::memory_order_relaxed);
        }
      }
      const uint8_t* val = keep.data();
      // scores: each key row is read once, for all query rows of its head
      for (int64_t p = 0; p < B; ++p) {
        const bool ahead = p + kPrefetch < B && val[p + kPrefetch];
        const int64_t ps = ahead ? slot[p + kPrefetch] : 0;
        if (!val[p]) {
          for (int64_t r = 0; r < R; ++r) s[r * Bp + p] = -INFINITY;
          continue;
        }
        for (int64_t h = 0; h < hkv; ++h) {
          // the K and V lines of position p + kPrefetch, head by head: spread over the heads' work, not issued as
          // one burst of a whole row (a burst fills the line-fill buffers and stalls the arithmetic behind it)
          if (ahead) {
            const char* ka = reinterpret_cast<const char*>(kc + ps * pr.k_row + h * pr.k_head);
            for (int64_t c = 0; c < D * (int64_t)sizeof(T); c += 64) __builtin_prefetch(ka + c);
            const char* va = reinterpret_cast<const char*>(vc + ps * pr.v_row + h * pr.v_head);
            for (int64_t c = 0; c < Dv * (int64_t)sizeof(T); c += 64) __builtin_prefetch(va + c, 0, 2);
          }
          const T* kr = kc + slot[p] * pr.k_row + h * pr.k_head;
          const float* q0 = qv.data() + h * G * D;
          float* sp = s.data() + h * G * Bp + p;
          if (DV && G % 4 == 0) {
            v16 kv[DV ? DV : 1];
            for (int j = 0; j < DV; ++j) kv[j] = L::load(kr + 16 * j);
            for (int64_t g = 0; g < G; g += 4) {
              const float* qg = q0 + g * D;
              v16 a0 = loadf(qg) * kv[0], a1 = loadf(qg + D) * kv[0], a2 = loadf(qg + 2 * D) * kv[0],
                  a3 = loadf(qg + 3 * D) * kv[0];
              for (int j = 1; j < DV; ++j) {
                a0 += loadf(qg + 16 * j) * kv[j];
                a1 += loadf(qg + D + 16 * j) * kv[j];
                a2 += loadf(qg + 2 * D + 16 * j) * kv[j];
                a3 += loadf(qg + 3 * D + 16 * j) * kv[j];
              }
              v4f t = hsum4(a0, a1, a2, a3);
              for (int i = 0; i < 4; ++i) sp[(g + i) * Bp] = t[i];
            }
          } else {
            for (int64_t g = 0; g < G; ++g) {
              v16 acc{};
              for (int64_t d = 0; d < D; d += 16) acc += loadf(q0 + g * D + d) * L::load(kr + d);
              sp[g * Bp] = hsum(acc);
            }
          }
        }
      }
      float* mo = pr.m + b * R;
      float* lo = pr.l + b * R;
      float* oo = pr.o + b * R * Dv;
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s.data() + r * Bp;
        if (pr.cap > 0.f)
          for (int64_t p = 0; p < B; ++p)
            if (val[p]) sr[p] = pr.cap * std::tanh(sr[p] / pr.cap);
        for (int64_t p = B; p < Bp; ++p) sr[p] = -INFINITY;
        v16 mx = splat(-INFINITY);
        for (int64_t p = 0; p < Bp; p += 16) {
          v16 x = loadf(sr + p);
          mx = x > mx ? x : mx;
        }
        float m = mx[0];
        for (int i = 1; i < 16; ++i) m = std::max(m, mx[i]);
        if (m == -INFINITY) m = -FLT_MAX;  // no valid key in the block
        v16 sum{};
        for (int64_t p = 0; p < Bp; p += 16) {
          v16 x = loadf(sr + p);
          v16 e = x == -INFINITY ? v16{} : vexp(x - m);
          storef(sr + p, e);
          sum += e;
        }
        mo[r] = m;
        lo[r] = hsum(sum);
      }
      // weighted V: per head, 4 query rows x 64 output columns at a time
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t g0 = 0; g0 < G; g0 += 4)
          for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
            const int gn = (int)std::min<int64_t>(4, G - g0), dn = (int)(std::min<int64_t>(64, Dv - d0) / 16);
            const float* w = s.data() + (h * G + g0) * Bp;
            float* out = oo + (h * G + g0) * Dv + d0;
            const T* vb = vc + h * pr.v_head + d0;
            if (gn == 4 && dn == 4) weighted_v<L, 4, 4>(vb, slot.data(), val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
            else if (gn == 1 && dn == 4) weighted_v<L, 1, 4>(vb, slot.data(), val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
            else if (gn == 2 && dn == 4) weighted_v<L, 2, 4>(vb, slot.data(), val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
            else weighted_v_any<L>(gn, dn, vb, slot.data(), val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
          }
    }
    if (pr.out) {
#pragma omp for schedule(dynamic, 4)
      for (int64_t r = 0; r < pr.rows; ++r) merge_row(pr, r, first.data(), order.data());
    }
  }
  return outside.load();
}

template <class L>
static int run_head_size(const Problem& pr) {
  if (pr.D == 128) return run_blocks<L, 8>(pr);
  if (pr.D == 64) return run_blocks<L, 4>(pr);
  if (pr.D == 256) return run_blocks<L, 16>(pr);
  return run_blocks<L, 0>(pr);
}

// kind: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn, 4 float8_e5m2. m, l, o: the blocks' partials (the
// output, or the merged form's scratch); out: nullptr, or the merged form's [rows, hkv, G, Dv] (sinks may be
// nullptr); num_slots: the caches' rows. Returns 0; 1 when a head size is not a multiple of 16, 2 for an unknown
// kind (the caller checks both before calling); 3 when a valid position's slot lay outside the caches (left out
// of the result, never read).
extern "C" int ca_block_partials(int kind, const float* qs, const int64_t* block_req, const int64_t* runs,
                                 const uint8_t* valid, const void* k, const void* v, int64_t k_row, int64_t k_head,
                                 int64_t v_row, int64_t v_head, int64_t n, int64_t hkv, int64_t G, int64_t D,
                                 int64_t Dv, int64_t B, int64_t unit, float k_scale, float v_scale, float cap,
                                 float* m, float* l, float* o, int threads, int64_t rows, const float* sinks,
                                 float* out, int64_t num_slots) {
  if (D % 16 || Dv % 16) return 1;
  const float f = kind == 3 ? 256.0f : 1.0f;
  Problem pr{qs, block_req, runs, valid, k, v, k_row, k_head, v_row, v_head, n, hkv, G, D, Dv, B, unit, num_slots,
             k_scale * f, v_scale * f, cap, m, l, o, threads, rows, sinks, out};
  int outside = 0;
  switch (kind) {
    case 0: outside = run_head_size<F32>(pr); break;
    case 1: outside = run_head_size<BF16>(pr); break;
    case 2: outside = run_head_size<F16>(pr); break;
    case 3: outside = run_head_size<E4M3>(pr); break;
    case 4: outside = run_head_size<E5M2>(pr); break;
    default: return 2;
  }
  return outside ? 3 : 0;
}
