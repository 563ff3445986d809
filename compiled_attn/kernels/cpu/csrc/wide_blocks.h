// The decode kernel's wide path: blocks whose KV heads have 16 query rows or a multiple of 16 (verify's draft
// tokens times GQA's groups) where the tile path does not serve (a float32 query or cache, a CPU without AMX).
// float32 arithmetic, exact products as on the vector path.
//
// Why: the vector path scores a key row against each query row with a dot product and a horizontal sum, so its
// work per key grows with the rows at a poor rate (and at 32 rows verify had gone to the slower flash op). Here the
// scores are outer products, lanes = 16 query rows: per key element one broadcast and one FMA per 16 rows, eight
// independent sums in flight; they come out position-major, so the softmax is column_softmax.h's, and the V sum
// broadcasts each weight over a value row read in place (AVX2: bf16 and fp16 rows too, wide_in_place).
#pragma once
#include <type_traits>

#include "column_softmax.h"

constexpr int64_t kWideSpan = 64;  // positions of V converted to float32 at a time (other cache dtypes)

// One thread's buffers: the running softmax (score block sb = h * groups + t holds query rows 16 sb ..), one row's
// queries transposed, converted key and value rows.
struct WideScratch {
  int64_t groups = 0, q_row = -1;  // q_row: the row whose queries qt holds
  ColumnState cs;
  std::vector<float> qt;       // [hkv, groups, D, 16] the queries times k_mul, lanes = query rows
  std::vector<float> kf, vf;   // [8, D] key rows as float32; [kWideSpan, Dv] value rows (not for a float32 cache)
  std::vector<int64_t> ids;    // [Bp] the block's valid positions
  std::vector<const float*> vp;  // [kWideSpan] a span's value rows as float32 (in the cache, or in vf)
  std::vector<const uint16_t*> vr;  // [kWideSpan] a span's bf16 or fp16 value rows in the cache (wide_in_place)

  // pr: a work unit's problem (its KV heads); all_heads: the heads a row's packed queries hold
  void start(const Problem& pr, int64_t Bp, int64_t all_heads) {
    groups = pr.G / 16;
    cs.start(pr.hkv * groups, Bp, pr.hkv * pr.G, pr.Dv);
    qt.resize(all_heads * pr.G * pr.D), kf.resize(8 * pr.D), vf.resize(kWideSpan * pr.Dv), ids.resize(Bp);
    vp.resize(kWideSpan), vr.resize(kWideSpan);
    q_row = -1;
  }
};

static bool wide_fit(const Problem& pr) { return pr.G >= 16 && pr.G % 16 == 0; }

static void pack_wide_queries(const Problem& pr, int64_t row, WideScratch& ws) {
  const int64_t D = pr.D, G = pr.G;
  for (int64_t h = 0; h < pr.hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const float* q = pr.qs + ((row * pr.hkv + h) * G + g) * D;
      float* dst = ws.qt.data() + (h * G + g / 16 * 16) * D + g % 16;
      for (int64_t d = 0; d < D; ++d) dst[d * 16] = q[d] * pr.k_mul;
    }
  ws.q_row = row;
}

// U key rows (kf [U, D], float32) against T groups of 16 query rows: out[u * T + t] = the 16 scores of position u.
// (The rows copied side by side, float32 ones too: one base address for the U broadcasts, where U pointers into
// the cache had been reloaded from the stack at every step.)
#if defined(__AVX512F__)
#define WIDE_PRODUCTS_LINKAGE static inline
#else  // a function of its own: inlined into wide_block, its loop's addresses were reloaded from the stack
#define WIDE_PRODUCTS_LINKAGE __attribute__((noinline)) static
#endif
template <int U, int T>
WIDE_PRODUCTS_LINKAGE void wide_products(const float* kf, const float* q, int64_t D, v16* out) {
#if !defined(__AVX512F__)
  // AVX2: four positions against one group's two halves a pass (the U x T v16 sums were 16 to 32 registers), the
  // two query vectors loaded once a step (in_register; folded into their FMAs they made 12 loads per 8 FMAs)
  static_assert(U % 4 == 0, "whole passes");
  for (int t = 0; t < T; ++t)
    for (int u0 = 0; u0 < U; u0 += 4) {
      v8f a[4][2] = {};
      const float* qt = q + t * D * 16;
      const float *k0 = kf + u0 * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
      for (int64_t d = 0; d < D; ++d) {
        v8f x0 = loadf8(qt + d * 16), x1 = loadf8(qt + d * 16 + 8);
        in_register(x0), in_register(x1);
        const v8f b0 = splat8(k0[d]), b1 = splat8(k1[d]), b2 = splat8(k2[d]), b3 = splat8(k3[d]);
        a[0][0] += b0 * x0, a[0][1] += b0 * x1, a[1][0] += b1 * x0, a[1][1] += b1 * x1;
        a[2][0] += b2 * x0, a[2][1] += b2 * x1, a[3][0] += b3 * x0, a[3][1] += b3 * x1;
      }
      for (int u = 0; u < 4; ++u) {
        float* o = reinterpret_cast<float*>(out + (u0 + u) * T + t);
        storef8(o, a[u][0]), storef8(o + 8, a[u][1]);
      }
    }
#else
  v16 a[U][T] = {};
  for (int64_t d = 0; d < D; ++d) {
    v16 x[T];
    for (int t = 0; t < T; ++t) x[t] = loadf(q + (t * D + d) * 16);
    for (int u = 0; u < U; ++u) {
      const v16 k = splat(kf[u * D + d]);
      for (int t = 0; t < T; ++t) a[u][t] += k * x[t];
    }
  }
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < T; ++t) out[u * T + t] = a[u][t];
#endif
}

// AVX2 reads bf16 and fp16 value rows in place (converting each row to float32 first cost 15-25% of an MLA step;
// float8 rows, read four times by the V sums, stay converted once): the V sums (weighted_rows) through key16, whose
// order the running sums keep until the item's last block writes them.
template <class L> constexpr bool wide_in_place() {
#if !defined(__AVX512F__)
  return std::is_same<L, BF16>::value || std::is_same<L, F16>::value;
#else
  return false;
#endif
}

// AVX2 reads bf16 key rows in place too (wide_products_bf16).
template <class L> constexpr bool wide_keys_in_place() {
#if !defined(__AVX512F__)
  return std::is_same<L, BF16>::value;
#else
  return false;
#endif
}

#if !defined(__AVX512F__)
// wide_products over U bf16 key rows in place (kr): per step two elements of four rows, each pair's 32 bits one
// broadcast split into its even element (a shift) and its odd one (a mask).
template <int U, int T>
__attribute__((noinline)) static void wide_products_bf16(const uint16_t* const* kr, const float* q, int64_t D,
                                                         v16* out) {
  static_assert(U % 4 == 0, "whole passes");
  for (int t = 0; t < T; ++t)
    for (int u0 = 0; u0 < U; u0 += 4) {
      v8f a[4][2] = {};
      const float* qt = q + t * D * 16;
      for (int64_t d = 0; d < D; d += 2) {
        v8f x0 = loadf8(qt + d * 16), x1 = loadf8(qt + d * 16 + 8), y0 = loadf8(qt + d * 16 + 16),
            y1 = loadf8(qt + d * 16 + 24);
        in_register(x0), in_register(x1), in_register(y0), in_register(y1);
        for (int u = 0; u < 4; ++u) {
          float pair;
          std::memcpy(&pair, kr[u0 + u] + d, 4);
          const v8f wf = splat8(pair);
          u32x8 w;
          std::memcpy(&w, &wf, 32);
          const u32x8 ei = w << 16, oi = w & 0xFFFF0000u;
          v8f e, o;
          std::memcpy(&e, &ei, 32), std::memcpy(&o, &oi, 32);
          a[u][0] += e * x0, a[u][1] += e * x1;
          a[u][0] += o * y0, a[u][1] += o * y1;
        }
      }
      for (int u = 0; u < 4; ++u) {
        float* o = reinterpret_cast<float*>(out + (u0 + u) * T + t);
        storef8(o, a[u][0]), storef8(o + 8, a[u][1]);
      }
    }
}
#endif

// The scores of U = 4 (two) or 8 key rows (kr in the cache, kf: as float32 where not wide_keys_in_place) against
// one or two groups of 16 query rows (q).
template <class L>
static inline void wide_scores(bool two, const typename L::T* const* kr, const float* kf, const float* q, int64_t D,
                               v16* s) {
#if !defined(__AVX512F__)
  if constexpr (wide_keys_in_place<L>()) {
    if (two) wide_products_bf16<4, 2>(kr, q, D, s);
    else wide_products_bf16<8, 1>(kr, q, D, s);
    return;
  }
#endif
  if (two) wide_products<4, 2>(kf, q, D, s);
  else wide_products<8, 1>(kf, q, D, s);
}

// One block, folded into its work item's running softmax (first / last as tile_block); qt: pr's first KV head's
// packed queries (in ws.qt).
template <class L>
static void wide_block(const Problem& pr, const float* qt, const int64_t* slot, const uint8_t* val, int64_t Bp,
                       WideScratch& ws, float* mo, float* lo, float* oo, bool first, bool last) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t D = pr.D, Dv = pr.Dv, hkv = pr.hkv, B = pr.B, groups = ws.groups;
  ColumnState& cs = ws.cs;
  const auto row_of = [](int64_t sb, int64_t lane) { return sb * 16 + lane; };
  if (first) cs.begin_item();
  int64_t c_lo, c_hi;
  live_range(val, B, Bp, c_lo, c_hi);
  int64_t n = 0, live_chunks = 0;
  for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
    const int64_t n0 = n;
    for (int64_t p = c0; p < std::min(c0 + 32, B); ++p)
      if (val[p]) ws.ids[n++] = p;
    cs.live[c0 / 32] = n > n0;
    live_chunks += n > n0;
  }
  if (n) {
    // scores: eight positions against one group of rows, or four against two, per step
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t t = 0; t < groups; t += 2) {
        const bool two = t + 1 < groups;
        const int U = two ? 4 : 8;
        const float* q = qt + (h * groups + t) * D * 16;
        for (int64_t i = 0; i < n; i += U) {
          const T* kr[8];
          for (int u = 0; u < U; ++u) {
            const int64_t p = ws.ids[std::min<int64_t>(i + u, n - 1)];  // the last repeated past the end
            const T* row = kc + slot[p] * pr.k_row + h * pr.k_head;
            if constexpr (wide_keys_in_place<L>()) kr[u] = row;
            else row_to_float<L>(row, D, 1.0f, ws.kf.data() + u * D);
            // the key rows two steps ahead (past the head's last, the next head's first)
            const int64_t a = i + 2 * U + u, ah = a < n ? h : h + 1, ai = a < n ? a : a - n;
            if (ah < hkv && ai < n)
              prefetch_lines(kc + slot[ws.ids[ai]] * pr.k_row + ah * pr.k_head, D * (int64_t)sizeof(T));
          }
          v16 s[8];
          wide_scores<L>(two, kr, ws.kf.data(), q, D, s);
          for (int u = 0; u < U && i + u < n; ++u)
            for (int tt = 0; tt < (two ? 2 : 1); ++tt)
              storef(cs.st.data() + ((h * groups + t + tt) * Bp + ws.ids[i + u]) * 16, s[u * (two ? 2 : 1) + tt]);
        }
      }
    // value rows come into L1 a slice at a time during arithmetic that reads no memory of its own (read on demand,
    // the V sums waited on them): head 0's first span during the softmax, each next span (or the next head's
    // first) during a span's sums. Slice `call` of `calls`: every calls-th position.
    auto fetch_values = [&](int64_t h, int64_t j0, int64_t j1, int64_t call, int64_t calls) {
      for (int64_t j = j0 + call; j < j1; j += calls)
        prefetch_lines(vc + slot[ws.ids[j]] * pr.v_row + h * pr.v_head, Dv * (int64_t)sizeof(T));
    };
    int64_t emits = 0;  // of cs.nsb * live_chunks
    column_softmax(pr, val, c_lo, c_hi, Bp, 1.0f, cs, [&](int64_t sb, int64_t c0, v16* e) {
      fetch_values(0, 0, std::min(n, kWideSpan), emits++, cs.nsb * live_chunks);
      for (int i = 0; i < 32; ++i) storef(cs.st.data() + (sb * Bp + c0 + i) * 16, e[i]);
    });
    if (!first) rescale_sums(cs, Dv, row_of);
    // weighted V, head by head and kWideSpan positions at a time: per four query rows and 64 columns, each value
    // row (read in place, or converted once for the span) times the four rows' weights, in registers (four value
    // loads and four broadcasts per 16 FMAs; two rows x 128 columns took twelve loads)
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t i0 = 0; i0 < n; i0 += kWideSpan) {
        const int64_t i1 = std::min(n, i0 + kWideSpan);
        for (int64_t i = i0; i < i1; ++i) {  // the span's value rows: in place, or converted
          const T* vr = vc + slot[ws.ids[i]] * pr.v_row + h * pr.v_head;
          if constexpr (wide_in_place<L>()) {
            ws.vr[i - i0] = vr;
          } else if constexpr (std::is_same<L, F32>::value) {
            ws.vp[i - i0] = vr;
          } else {
            row_to_float<L>(vr, Dv, 1.0f, ws.vf.data() + (i - i0) * Dv);
            ws.vp[i - i0] = ws.vf.data() + (i - i0) * Dv;
          }
        }
        const int64_t next_h = i1 < n ? h : h + 1, next_i0 = i1 < n ? i1 : 0;  // the span after this one
        const int64_t calls = groups * ((Dv + 63) / 64) * 4;
        int64_t call = 0;
        for (int64_t t = 0; t < groups; ++t) {
          const int64_t sb = h * groups + t;
          const float* w = cs.st.data() + sb * Bp * 16;
          for (int64_t cb = 0; cb < Dv; cb += 64) {
            const int64_t nch = std::min<int64_t>(4, (Dv - cb) / 16);
            for (int64_t rr = 0; rr < 16; rr += 4) {
              if (next_h < hkv) fetch_values(next_h, next_i0, std::min(n, next_i0 + kWideSpan), call++, calls);
              float* o = cs.acc.data() + (sb * 16 + rr) * Dv + cb;
              const float* wr = w + rr;
              if constexpr (wide_in_place<L>())
                weighted_rows_n<4, L>(nch, ws.ids.data() + i0, ws.vr.data(), i1 - i0, wr, cb, o, Dv);
              else
                weighted_rows_n<4>(nch, ws.ids.data() + i0, ws.vp.data(), i1 - i0, wr, cb, o, Dv);
            }
          }
        }
      }
  }
  if (!last) return;
  write_max_and_sum(cs, 1.0f, mo, lo, row_of);
  const vnat mul = splatn(pr.v_mul);
#if !defined(__AVX512F__)
  if constexpr (wide_in_place<L>()) {  // the sums in key16's order
    for (int64_t r = 0; r < hkv * pr.G; ++r)
      for (int64_t d = 0; d < Dv; d += 16)
        store16_in_order<L>(oo + r * Dv + d, loadf8(cs.acc.data() + r * Dv + d),
                            loadf8(cs.acc.data() + r * Dv + d + 8), mul);
    return;
  }
#endif
  for (int64_t r = 0; r < hkv * pr.G; ++r)
    for (int64_t d = 0; d < Dv; d += kNat) storen(oo + r * Dv + d, loadn(cs.acc.data() + r * Dv + d) * mul);
}
