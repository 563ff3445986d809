// The decode kernel's vector path (block_partials.cpp runs it): one block's scores by vector dot products, each key
// row read once for all query rows of its head as the row is read (a slot's heads lie together in the cache, so a
// page of consecutive slots is read front to back), and its weighted V sum by vector FMAs. K/V are converted in
// registers (bf16, fp16, float8 e4m3fn / e5m2), so the cache is read once at its stored width.
#pragma once
#include <type_traits>

#include "kernel_math.h"

// Whether v16 is one register (AVX-512); else the vector path's scores take AVX2 halves (kernel_math.h says why).
#if defined(__AVX512F__)
constexpr bool kWideVectors = true;
#else
constexpr bool kWideVectors = false;
#endif
// Where a block's lines are fetched from memory: the AVX2 build fetches only the first head's V lines while it
// scores the block, each next head's during the V sum of the one before, and the next block's first key rows
// during the V sum too: the score pass had fetched every K and V line and the V sum none, so with rows at random
// slots (pages of size 1) the scores waited on twice the traffic the block averages (docs/kernel-performance.md).
constexpr bool kVLinesAhead = !kWideVectors;

// Whether vector_weighted_v fetches those lines for pr: a bf16, fp16 or float8 cache (float32 measured no gain),
// and the first query rows and all columns of a head go through weighted_v. Where not, the score pass fetches them.
template <class L>
static inline bool v_lines_in_v_pass(const Problem& pr) {
  return kVLinesAhead && sizeof(typename L::T) < 4 && pr.G != 3 && pr.Dv % 64 == 0;
}

// out[g, :] = v_mul * sum_p w[g, p] * V[slot p, :] for GN query rows and DN x 16 columns, in registers. A bf16 V
// row is read 32 elements a vector and split into its even and odd elements (a shift and a mask, no widening
// shuffles), the sums kept in that order and interleaved back once at the end.
template <class L, int GN, int DN>
static inline void weighted_v(const typename L::T* vb, const int64_t* slot, const uint8_t* val, int64_t B,
                              int64_t v_row, const float* w, int64_t Bp, float* out, int64_t Dv, float v_mul,
                              const typename L::T* next) {
#if !defined(__AVX512F__)
  // AVX2: CH 16-column chunks a pass over the positions, GN x CH x 2 half sums in 8 of the 16 registers (GN x DN
  // v16 sums were 32 registers); a bf16 chunk is one 32-byte load split into its even and odd elements. next (or
  // null): the same columns of the next head, whose lines are fetched into L2 over the passes (vector_weighted_v)
  constexpr int CH = GN >= 4 ? 1 : 4 / GN;
  static_assert(DN % CH == 0, "whole passes");
  for (int c0 = 0; c0 < DN; c0 += CH) {
    v8f acc[GN][CH][2] = {};
    for (int64_t p = 0; p < B; ++p) {
      if (!val[p]) continue;
      const typename L::T* vr = vb + slot[p] * v_row + 16 * c0;
      if (next) prefetch_lines<2>(next + slot[p] * v_row + 16 * c0, 16 * CH * (int64_t)sizeof(typename L::T));
      v8f vv[CH][2];
      for (int c = 0; c < CH; ++c) key16<L>(vr + 16 * c, vv[c]);
      for (int g = 0; g < GN; ++g) {
        const v8f x = splat8(w[g * Bp + p]);
        for (int c = 0; c < CH; ++c) acc[g][c][0] += x * vv[c][0], acc[g][c][1] += x * vv[c][1];
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int c = 0; c < CH; ++c)
        store16_in_order<L>(out + g * Dv + 16 * (c0 + c), acc[g][c][0], acc[g][c][1], splat8(v_mul));
  }
#else
  (void)next;
  constexpr bool split = std::is_same<L, BF16>::value && DN % 2 == 0;
  v16 acc[GN][DN] = {};
  for (int64_t p = 0; p < B; ++p) {
    if (!val[p]) continue;
    const typename L::T* vr = vb + slot[p] * v_row;
    v16 vv[DN];
    if constexpr (split) {
      for (int j = 0; j < DN; j += 2) {
        u32x16 x;
        std::memcpy(&x, vr + 16 * j, 64);
        const u32x16 even = x << 16, odd = x & 0xFFFF0000u;
        std::memcpy(&vv[j], &even, 64);
        std::memcpy(&vv[j + 1], &odd, 64);
      }
    } else {
      load_vectors<L, DN>(vr, vv);
    }
    for (int g = 0; g < GN; ++g) {
      const float x = w[g * Bp + p];
      for (int j = 0; j < DN; ++j) acc[g][j] += x * vv[j];
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < DN; ++j) {
      if constexpr (split) {
        if (j % 2) continue;
        const v16 e = acc[g][j], o = acc[g][j + 1];
        storef(out + g * Dv + 16 * j,
               __builtin_shufflevector(e, o, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23) * v_mul);
        storef(out + g * Dv + 16 * j + 16,
               __builtin_shufflevector(e, o, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31) * v_mul);
      } else {
        storef(out + g * Dv + 16 * j, acc[g][j] * v_mul);
      }
    }
#endif
}

template <class L>
static void weighted_v_any(int gn, int dn, const typename L::T* vb, const int64_t* slot, const uint8_t* val,
                           int64_t B, int64_t v_row, const float* w, int64_t Bp, float* out, int64_t Dv,
                           float v_mul) {
  for (int g = 0; g < gn; ++g)
    for (int j = 0; j < dn; ++j) {
#if defined(__AVX512F__)
      v16 acc{};
      for (int64_t p = 0; p < B; ++p)
        if (val[p]) acc += w[g * Bp + p] * L::load(vb + slot[p] * v_row + 16 * j);
      storef(out + g * Dv + 16 * j, acc * v_mul);
#else
      v8f lo{}, hi{};
      for (int64_t p = 0; p < B; ++p)
        if (val[p]) {
          const typename L::T* vr = vb + slot[p] * v_row + 16 * j;
          const v8f x = splat8(w[g * Bp + p]);
          lo += x * load8<L>(vr), hi += x * load8<L>(vr + 8);
        }
      storef8(out + g * Dv + 16 * j, lo * v_mul), storef8(out + g * Dv + 16 * j + 8, hi * v_mul);
#endif
    }
}



// Scores of one block by vector dot products: s[r, p] for the R query rows, -inf at invalid positions. Each key
// row is read once, for all query rows of its head. DV: D / 16 for a compiled-in head size (the key row lives in
// registers), else 0. q: qv [R, D] float32, the queries times k_mul; with PAIRS (a bf16 query, D / 16
// even, G a multiple of 4, AVX512-BF16) qb [R, D] bf16, q exactly (the queries divided by q_bf16_scale): each
// key row is loaded as bf16 (a bf16 cache as it is, float8 converted exactly), two elements per lane multiplied
// exactly and summed in float32, the sums then scaled by the scale times K's scale: half the instructions of the
// float32 products and no conversion of a bf16 row.
template <class L, int DV, bool PAIRS>
static void vector_scores(const Problem& pr, const int64_t* slot, const uint8_t* val, const void* q, float* s,
                          int64_t Bp) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t D = DV ? DV * 16 : pr.D, G = pr.G, hkv = pr.hkv, B = pr.B, Dv = pr.Dv, R = hkv * G;
  const bool v_in_pass = v_lines_in_v_pass<L>(pr);
  for (int64_t p = 0; p < B; ++p) {
    if (!val[p]) {
      for (int64_t r = 0; r < R; ++r) s[r * Bp + p] = -INFINITY;
      continue;
    }
    // with PAIRS, and in the AVX2 build, two valid positions at once (each query row loaded once for both key
    // rows, their sums reduced together); their K and V lines then one position ahead of each, so the next pair's
    // first comes a pair ahead (two ahead of each, as one position at a time takes them, was slower:
    // docs/measuring.md)
    const int64_t np = (PAIRS || !kWideVectors) && p + 1 < B && val[p + 1] ? 2 : 1;
    const int64_t lookahead = np == 2 ? 1 : kPrefetch;
    bool ahead[2], far[2];
    int64_t ps[2], pf[2];
    for (int64_t i = 0; i < np; ++i) {
      const int64_t x = p + i;
      ahead[i] = x + lookahead < B && val[x + lookahead];
      ps[i] = ahead[i] ? slot[x + lookahead] : 0;
      // and K of position x + kFarKeys into L2 where the slots are not in order (page size 1 after the pool has
      // churned): rows in order the hardware streams by itself
      far[i] = x + kFarKeys < B && val[x + kFarKeys] && slot[x + kFarKeys] != slot[x] + kFarKeys;
      pf[i] = far[i] ? slot[x + kFarKeys] : 0;
    }
    for (int64_t h = 0; h < hkv; ++h) {
      // the K and V lines of the positions ahead, head by head: spread over the heads' work, not issued as one
      // burst of a whole row (a burst fills the line-fill buffers and stalls the arithmetic behind it)
      for (int64_t i = 0; i < np; ++i) {
        if (ahead[i]) {  // K for the next read, V kept a little longer (read after the block's softmax)
          prefetch_lines(kc + ps[i] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
          if (h == 0 || !v_in_pass)
            prefetch_lines<2>(vc + ps[i] * pr.v_row + h * pr.v_head, Dv * (int64_t)sizeof(T));
        }
        if (far[i]) prefetch_lines<2>(kc + pf[i] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
      }
      const T* kr = kc + slot[p] * pr.k_row + h * pr.k_head;
      float* sp = s + h * G * Bp + p;
      if constexpr (PAIRS) {
#if defined(__AVX512BF16__)
        constexpr int NV = DV / 2;  // registers per key row
        const float mul = pr.q_bf16_scale * pr.k_mul;
        auto rows = [&](auto two) {  // the head's query rows against one key row, or (two) against two
          constexpr bool TWO = decltype(two)::value;
          __m512bh kv[NV], kw[NV];
          for (int j = 0; j < NV; ++j) kv[j] = (__m512bh)load32_bf16<L>(kr + 32 * j);
          if constexpr (TWO) {
            const T* kr1 = kc + slot[p + 1] * pr.k_row + h * pr.k_head;
            for (int j = 0; j < NV; ++j) kw[j] = (__m512bh)load32_bf16<L>(kr1 + 32 * j);
          }
          for (int64_t g = 0; g < G; g += 4) {
            const uint16_t* qg = static_cast<const uint16_t*>(q) + (h * G + g) * D;
            __m512 a[4], b[4];
            for (int i = 0; i < 4; ++i) {
              a[i] = b[i] = _mm512_setzero_ps();
              for (int j = 0; j < NV; ++j) {
                const __m512bh qj = (__m512bh)_mm512_loadu_si512(qg + i * D + 32 * j);
                a[i] = _mm512_dpbf16_ps(a[i], qj, kv[j]);
                if constexpr (TWO) b[i] = _mm512_dpbf16_ps(b[i], qj, kw[j]);
              }
            }
            if constexpr (TWO) {
              const v8f t = hsum4x2((v16)a[0], (v16)a[1], (v16)a[2], (v16)a[3], (v16)b[0], (v16)b[1], (v16)b[2],
                                    (v16)b[3]) * mul;
              for (int i = 0; i < 4; ++i) sp[(g + i) * Bp] = t[i], sp[(g + i) * Bp + 1] = t[4 + i];
            } else {
              const v4f t = hsum4((v16)a[0], (v16)a[1], (v16)a[2], (v16)a[3]) * mul;
              for (int i = 0; i < 4; ++i) sp[(g + i) * Bp] = t[i];
            }
          }
        };
        if (np == 2) rows(std::true_type{});
        else rows(std::false_type{});
#endif
      } else if (!kWideVectors) {
#if !defined(__AVX512F__)
        // AVX2: four query rows against one key row, or (np == 2) two, 16 elements a step (key16: q is kept in
        // its order), each query vector loaded once for both key rows
        const float* q0 = static_cast<const float*>(q) + h * G * D;
        const T* kr1 = kc + slot[p + np - 1] * pr.k_row + h * pr.k_head;
        int64_t g = 0;
        for (; g + 4 <= G && np == 2; g += 4) {
          const float* qg = q0 + g * D;
          v8f a[4][2] = {};
          for (int64_t d = 0; d < D; d += 16) {
            v8f k0[2], k1[2];
            key16<L>(kr + d, k0), key16<L>(kr1 + d, k1);
            for (int c = 0; c < 2; ++c) in_register(k0[c]), in_register(k1[c]);  // (a float32 row's loads)
            for (int i = 0; i < 4; ++i) {
              v8f x = loadf8(qg + i * D + d), y = loadf8(qg + i * D + d + 8);
              in_register(x), in_register(y);  // one load for both key rows
              // a product and an FMA off the sum's chain, then one add on it (two FMAs on it were latency-bound)
              a[i][0] += x * k0[0] + y * k0[1], a[i][1] += x * k1[0] + y * k1[1];
            }
          }
          const v8f t = hsum8(a);
          for (int i = 0; i < 4; ++i) sp[(g + i) * Bp] = t[2 * i], sp[(g + i) * Bp + 1] = t[2 * i + 1];
        }
        for (; g + 4 <= G; g += 4) {
          const float* qg = q0 + g * D;
          v8f a[4][2] = {};
          for (int64_t d = 0; d < D; d += 16) {
            v8f k0[2];
            key16<L>(kr + d, k0);
            for (int i = 0; i < 4; ++i)
              a[i][0] += loadf8(qg + i * D + d) * k0[0], a[i][1] += loadf8(qg + i * D + d + 8) * k0[1];
          }
          const v4f t = hsum4_halves(a);
          for (int i = 0; i < 4; ++i) sp[(g + i) * Bp] = t[i];
        }
        for (; g < G; ++g)
          for (int64_t i = 0; i < np; ++i) {
            const T* ki = i ? kr1 : kr;
            v8f lo{}, hi{};
            for (int64_t d = 0; d < D; d += 16) {
              v8f k0[2];
              key16<L>(ki + d, k0);
              lo += loadf8(q0 + g * D + d) * k0[0], hi += loadf8(q0 + g * D + d + 8) * k0[1];
            }
            sp[g * Bp + i] = hsum_halves(lo, hi);
          }
#endif
      } else if (DV && G % 4 == 0) {
        const float* q0 = static_cast<const float*>(q) + h * G * D;
        v16 kv[DV ? DV : 1];
        load_vectors<L, DV>(kr, kv);
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
        const float* q0 = static_cast<const float*>(q) + h * G * D;
        for (int64_t g = 0; g < G; ++g) {
          v16 acc{};
          for (int64_t d = 0; d < D; d += 16) acc += loadf(q0 + g * D + d) * L::load(kr + d);
          sp[g * Bp] = hsum(acc);
        }
      }
    }
    p += np - 1;
  }
}

// The weighted V sum of one block by vector FMAs: o[r, :] = v_mul * sum_p w[r, p] V[slot p, head of r, :], per
// head 4 query rows x 64 output columns at a time.
template <class L>
static void vector_weighted_v(const Problem& pr, const int64_t* slot, const uint8_t* val, const float* s, int64_t Bp,
                              float* oo, const int64_t* next_slot, const uint8_t* next_keep, const void* next_k) {
  typedef typename L::T T;
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t G = pr.G, B = pr.B, Dv = pr.Dv;
  const bool ahead = v_lines_in_v_pass<L>(pr);
  for (int64_t h = 0; h < pr.hkv; ++h) {
    // AVX2: the next block's first kFarKeys key rows of this head, into L2 (the score pass fetches each later one
    // kFarKeys positions ahead)
    for (int64_t p = 0; ahead && next_slot && p < std::min(kFarKeys, B); ++p)
      if (next_keep[p])
        prefetch_lines<2>(static_cast<const T*>(next_k) + next_slot[p] * pr.k_row + h * pr.k_head,
                          pr.D * (int64_t)sizeof(T));
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        const int gn = (int)std::min<int64_t>(4, G - g0), dn = (int)(std::min<int64_t>(64, Dv - d0) / 16);
        const float* w = s + (h * G + g0) * Bp;
        float* out = oo + (h * G + g0) * Dv + d0;
        const T* vb = vc + h * pr.v_head + d0;
        // AVX2: the next head's V lines are fetched here, spread over this head's passes (kVLinesAhead)
        const T* next = ahead && g0 == 0 && h + 1 < pr.hkv ? vb + pr.v_head : nullptr;
        if (gn == 4 && dn == 4) weighted_v<L, 4, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul, next);
        else if (gn == 1 && dn == 4) weighted_v<L, 1, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul, next);
        else if (gn == 2 && dn == 4) weighted_v<L, 2, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul, next);
        else weighted_v_any<L>(gn, dn, vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
      }
  }
}

// The block's softmax in place, per query row r of s [R, Bp] (positions B.. Bp padding; the vector path's layout):
// the soft-cap on valid scores, then m[r] = the max (the lowest float32 when no position is valid), s = exp(s - m)
// (0 where s was -inf), l[r] = its sum.
static void softmax_rows(float* s, const uint8_t* val, int64_t B, int64_t Bp, int64_t R, float cap, float* m_out,
                         float* l_out) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * Bp;
    if (cap > 0.f)
      for (int64_t p = 0; p < B; ++p)
        if (val[p]) sr[p] = cap * std::tanh(sr[p] / cap);
    for (int64_t p = B; p < Bp; ++p) sr[p] = -INFINITY;
#if defined(__AVX512F__)
    v16 mx = splat(-INFINITY);
    for (int64_t p = 0; p < Bp; p += 16) {
      v16 x = loadf(sr + p);
      mx = x > mx ? x : mx;
    }
    float m = mx[0];
    for (int i = 1; i < 16; ++i) m = std::max(m, mx[i]);
#else
    v8f mx = splat8(-INFINITY);
    for (int64_t p = 0; p < Bp; p += 8) {
      const v8f x = loadf8(sr + p);
      mx = x > mx ? x : mx;
    }
    float m = mx[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, mx[i]);
#endif
    if (m == -INFINITY) m = -FLT_MAX;  // no valid key in the block
#if defined(__AVX512F__)
    v16 sum{};
    for (int64_t p = 0; p < Bp; p += 16) {
      v16 x = loadf(sr + p);
      v16 e = x == -INFINITY ? v16{} : vexp(x - m);
      storef(sr + p, e);
      sum += e;
    }
    l_out[r] = hsum(sum);
#else
    v8f lo{}, hi{};  // lanes 0-7 and 8-15 of each 16 positions, as a v16's sum
    for (int64_t p = 0; p < Bp; p += 16) {
      const v8f x = loadf8(sr + p), y = loadf8(sr + p + 8);
      const v8f e = x == -INFINITY ? v8f{} : vexp8(x - m), f = y == -INFINITY ? v8f{} : vexp8(y - m);
      storef8(sr + p, e), storef8(sr + p + 8, f);
      lo += e, hi += f;
    }
    l_out[r] = hsum_halves(lo, hi);
#endif
    m_out[r] = m;
  }
}
