// The decode kernel's merge, per row: a run of blocks folded into one partial, the row's partials merged into
// its output, and verify's draft keys computed as one more partial of the row.
#pragma once
#include "kernel_math.h"

// Folds one block's partials (bm, bl, bo) into a running one (m, l, o), per query row: the log-sum-exp rule.
static void fold_partials(int64_t R, int64_t Dv, float* m, float* l, float* o, const float* bm, const float* bl,
                          const float* bo) {
  for (int64_t r = 0; r < R; ++r) {
    const float mx = std::max(m[r], bm[r]), a = std::exp(m[r] - mx), c = std::exp(bm[r] - mx);
    m[r] = mx;
    l[r] = l[r] * a + bl[r] * c;
    for (int64_t d = 0; d < Dv; d += kNat)
      storen(o + r * Dv + d, loadn(o + r * Dv + d) * a + loadn(bo + r * Dv + d) * c);
  }
}

// Row r's draft keys (verify: the slots of its k new tokens, after a window's edge keys) as one more partial, in
// float32 as the vector path, for KV heads [h0, h1): per query row i of a KV head, over the keys the mask shows its
// token (i / (G / tokens)), the max score dm (the lowest float32 when it sees none), the sum of exp dl and the
// weighted V sum do (indexed by i = h * G + g, as the row's partials). Returns false when a key some token sees
// has its slot outside the caches (left out, never read). The few keys (k + a window's edge) cost a fraction of the
// prefix; as ATen ops around the kernel (gathers, two batched matmuls, the join of the two parts) they had cost
// several times that. A key's K/V rows are converted once per head for all its query rows; the scores come four
// keys to a horizontal sum, and the softmax and the V sums take 16 query rows at a time (lanes), each key's
// weights one vector.
struct DraftScratch {
  std::vector<float> kf, vf, st, q;  // [nd, D], [nd, Dv] converted rows; [nd, 16] the scores, then weights, of 16
                                    // query rows; [D] a query row, where the queries are bf16 as the caller holds them
  std::vector<int64_t> ids, seq;    // [nd] the keys some token of the row sees; 0 .. nd - 1 (weighted_rows' ids)
  std::vector<const float*> vp;     // [nd] their value rows
  std::vector<i32x16> sees;         // [G / 16 rounded up, nd] which of each 16 query rows see each of them
  void start(const Problem& pr) {
    kf.resize(pr.nd * pr.D), vf.resize(pr.nd * pr.Dv), st.resize(pr.nd * 16), ids.resize(pr.nd), vp.resize(pr.nd);
    q.resize(pr.D), seq.resize(pr.nd), sees.resize((pr.G + 15) / 16 * pr.nd);
    for (int64_t c = 0; c < pr.nd; ++c) seq[c] = c;
  }
};

template <class L>
static bool draft_partial(const Problem& pr, int64_t r, int64_t h0, int64_t h1, DraftScratch& ds, float* dm, float* dl,
                          float* dout) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t nd = pr.nd, D = pr.D, Dv = pr.Dv, G = pr.G, per_token = G / pr.tokens;
  const int64_t* slots = pr.draft_slots + r * nd;
  const uint8_t* mask = pr.draft_mask + r * pr.tokens * nd;
  bool inside = true;
  int64_t n = 0;  // the keys some token sees: ds.ids[0 .. n)
  for (int64_t j = 0; j < nd; ++j) {
    uint8_t any = 0;
    for (int64_t t = 0; t < pr.tokens; ++t) any |= mask[t * nd + j];
    if (any && (slots[j] < 0 || slots[j] >= pr.num_slots)) any = 0, inside = false;
    if (any) ds.ids[n++] = j;
  }
  const std::vector<int64_t>& key = ds.ids;
  float* st = ds.st.data();
  // which of each 16 query rows (lanes) of a head see each key: the lane's row is token (g0 + lane) / per_token's
  for (int64_t g0 = 0; g0 < G; g0 += 16)
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t t = g0 + lane < G ? (g0 + lane) / per_token : -1;
      for (int64_t c = 0; c < n; ++c) ds.sees[g0 / 16 * nd + c][lane] = t >= 0 && mask[t * nd + key[c]] ? -1 : 0;
    }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t c = 0; c < n; ++c) {
      row_to_float<L>(kc + slots[key[c]] * pr.k_row + h * pr.k_head, D, pr.k_mul, ds.kf.data() + c * D);
      row_to_float<L>(vc + slots[key[c]] * pr.v_row + h * pr.v_head, Dv, pr.v_mul, ds.vf.data() + c * Dv);
      ds.vp[c] = ds.vf.data() + c * Dv;
    }
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const int64_t lanes = std::min<int64_t>(16, G - g0);
      for (int64_t lane = 0; lane < lanes; ++lane) {  // the scores, st[c * 16 + lane]
        const int64_t i = h * G + g0 + lane;
        const float* q = pr.qs ? pr.qs + (r * pr.hkv * G + i) * D : ds.q.data();
        if (!pr.qs) row_to_float<BF16>(query_bf16(pr, r, i), D, 1.0f, ds.q.data());
        for (int64_t c = 0; c < n; c += 4) {  // four keys at a time: four independent sums
          const float* k0 = ds.kf.data() + c * D;
          const float* k1 = ds.kf.data() + std::min(c + 1, n - 1) * D;
          const float* k2 = ds.kf.data() + std::min(c + 2, n - 1) * D;
          const float* k3 = ds.kf.data() + std::min(c + 3, n - 1) * D;
#if defined(__AVX512F__)
          v16 a0{}, a1{}, a2{}, a3{};
          for (int64_t d = 0; d < D; d += 16) {
            const v16 x = loadf(q + d);
            a0 += x * loadf(k0 + d), a1 += x * loadf(k1 + d), a2 += x * loadf(k2 + d), a3 += x * loadf(k3 + d);
          }
          const v4f t = hsum4(a0, a1, a2, a3);
#else
          v8f a[4][2] = {};
          const float* ks[4] = {k0, k1, k2, k3};
          for (int64_t d = 0; d < D; d += 16)
            for (int hh = 0; hh < 2; ++hh) {
              const v8f x = loadf8(q + d + 8 * hh);
              for (int u = 0; u < 4; ++u) a[u][hh] += x * loadf8(ks[u] + d + 8 * hh);
            }
          const v4f t = hsum4_halves(a);
#endif
          for (int u = 0; u < 4 && c + u < n; ++u) st[(c + u) * 16 + lane] = t[u];
        }
      }
      const i32x16* sees = ds.sees.data() + g0 / 16 * nd;
#if !defined(__AVX512F__)
      // AVX2: the lanes as two halves held in registers (kernel_math.h)
      v8f m[2] = {splat8(-FLT_MAX), splat8(-FLT_MAX)}, l[2] = {};
      for (int64_t c = 0; c < n; ++c)
        for (int hh = 0; hh < 2; ++hh) {
          float* sc = st + c * 16 + 8 * hh;
          if (pr.cap > 0.f)
            for (int64_t lane = 0; lane < 8; ++lane) sc[lane] = pr.cap * std::tanh(sc[lane] / pr.cap);
          i32x8 see;
          std::memcpy(&see, reinterpret_cast<const int32_t*>(&sees[c]) + 8 * hh, 32);
          const v8f x = see ? loadf8(sc) : splat8(-FLT_MAX);
          storef8(sc, x);
          m[hh] = x > m[hh] ? x : m[hh];
        }
      for (int64_t c = 0; c < n; ++c)
        for (int hh = 0; hh < 2; ++hh) {
          i32x8 see;
          std::memcpy(&see, reinterpret_cast<const int32_t*>(&sees[c]) + 8 * hh, 32);
          const v8f e = see ? vexp8(loadf8(st + c * 16 + 8 * hh) - m[hh]) : v8f{};
          storef8(st + c * 16 + 8 * hh, e);
          l[hh] += e;
        }
      for (int64_t lane = 0; lane < lanes; ++lane)
        dm[h * G + g0 + lane] = m[lane / 8][lane % 8], dl[h * G + g0 + lane] = l[lane / 8][lane % 8];
#else
      v16 m = splat(-FLT_MAX), l{};
      for (int64_t c = 0; c < n; ++c) {
        v16 x = loadf(st + c * 16);
        if (pr.cap > 0.f)
          for (int64_t lane = 0; lane < 16; ++lane) x[lane] = pr.cap * std::tanh(x[lane] / pr.cap);
        x = sees[c] ? x : splat(-FLT_MAX);
        storef(st + c * 16, x);
        m = x > m ? x : m;
      }
      for (int64_t c = 0; c < n; ++c) {
        const v16 e = sees[c] ? vexp(loadf(st + c * 16) - m) : v16{};
        storef(st + c * 16, e);
        l += e;
      }
      for (int64_t lane = 0; lane < lanes; ++lane) dm[h * G + g0 + lane] = m[lane], dl[h * G + g0 + lane] = l[lane];
#endif
      // the V sums: four query rows at a time over each 64 columns, from zero (value row c's weights at st[c * 16])
      float* o = dout + (h * G + g0) * Dv;
      const int64_t* seq = ds.seq.data();
      std::memset(o, 0, sizeof(float) * lanes * Dv);
      for (int64_t cb = 0; cb < Dv; cb += 64) {
        const int64_t nch = std::min<int64_t>(4, (Dv - cb) / 16);
        int64_t rr = 0;
        for (; rr + 4 <= lanes; rr += 4)
          weighted_rows_n<4>(nch, seq, ds.vp.data(), n, st + rr, cb, o + rr * Dv + cb, Dv);
        for (; rr < lanes; ++rr)  // the last 1 - 3 rows one at a time
          weighted_rows_n<1>(nch, seq, ds.vp.data(), n, st + rr, cb, o + rr * Dv + cb, Dv);
      }
    }
  }
  return inside;
}

// n (a multiple of 16) floats -> bfloat16, rounded to nearest even (NaN stays NaN), as torch converts.
static inline void store_bf16(uint16_t* dst, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#elif defined(__AVX512F__)
    u32x16 b;
    std::memcpy(&b, x + i, 64);
    const u32x16 nan = (u32x16)((b & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
    const u32x16 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const u16x16 h = __builtin_convertvector((r & ~nan) | (((b >> 16) | 0x40u) & nan), u16x16);
    std::memcpy(dst + i, &h, 32);
#else
    for (int64_t k = i; k < i + 16; k += 8) {
      u32x8 b;
      std::memcpy(&b, x + k, 32);
      const u32x8 nan = (u32x8)((b & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
      const u32x8 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
      const u16x8 h = __builtin_convertvector((r & ~nan) | (((b >> 16) | 0x40u) & nan), u16x8);
      std::memcpy(dst + k, &h, 16);
    }
#endif
  }
}

// Row r's output for its query rows [i0, i1): sum_b o_b e^(m_b - M) / (sum_b l_b e^(m_b - M) + e^(sink - M)), M
// the max of the m_b and the sink, over row r's partials b in [b0, b1) of pm [., R], pl [., R], po [., R, Dv] and,
// with dm, the draft partial (dm, dl, dout); zeros for a row with none. The weights of 16 query rows at a time
// (lanes; w: scratch for a vector per part), then each row's sum in acc [Dv], stored where Problem::out says.
static void merge_row(const Problem& pr, int64_t r, int64_t i0, int64_t i1, int64_t b0, int64_t b1, const float* pm,
                      const float* pl, const float* po, const float* dm, const float* dl, const float* dout,
                      std::vector<float>& w, float* acc) {
  const int64_t R = pr.hkv * pr.G, Dv = pr.Dv, nb = b1 - b0, parts = nb + (dm != nullptr);
  if ((int64_t)w.size() < parts * 16) w.resize(parts * 16);
  auto part_m = [&](int64_t p) { return p < nb ? pm + (b0 + p) * R : dm; };
  auto part_l = [&](int64_t p) { return p < nb ? pl + (b0 + p) * R : dl; };
  for (int64_t c = i0; c < i1; c += 16) {
    const int64_t lanes = std::min<int64_t>(16, i1 - c);
#if !defined(__AVX512F__)
    // AVX2: the 16 lanes as two halves held in registers (kernel_math.h), the same arithmetic per lane
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t n8 = lanes - 8 * hh, c8 = c + 8 * hh;  // lanes of this half (<= 0: none)
      auto first8 = [&](const float* p, float fill) { return load_first8(p, n8, fill); };
      v8f mx = pr.sinks ? first8(pr.sinks + c8, -INFINITY) : splat8(-INFINITY);
      for (int64_t p = 0; p < parts; ++p) {
        const v8f m = first8(part_m(p) + c8, -INFINITY);
        mx = m > mx ? m : mx;
      }
      v8f den = pr.sinks ? vexp8(first8(pr.sinks + c8, 0.0f) - mx) : v8f{};
      for (int64_t p = 0; p < parts; ++p) {
        const v8f e = vexp8(first8(part_m(p) + c8, 0.0f) - mx);
        den += e * first8(part_l(p) + c8, 0.0f);
        storef8(w.data() + p * 16 + 8 * hh, e);
      }
      const v8f inv = den > 0.0f ? 1.0f / den : v8f{};
      for (int64_t p = 0; p < parts; ++p) storef8(w.data() + p * 16 + 8 * hh, loadf8(w.data() + p * 16 + 8 * hh) * inv);
    }
#else
    v16 mx = pr.sinks ? load_first(pr.sinks + c, lanes, -INFINITY) : splat(-INFINITY);
    for (int64_t p = 0; p < parts; ++p) {
      const v16 m = load_first(part_m(p) + c, lanes, -INFINITY);
      mx = m > mx ? m : mx;
    }
    // (mx is -inf only with no part and no sink: den stays 0, the row zeros)
    v16 den = pr.sinks ? vexp(load_first(pr.sinks + c, lanes, 0.0f) - mx) : v16{};
    for (int64_t p = 0; p < parts; ++p) {
      const v16 e = vexp(load_first(part_m(p) + c, lanes, 0.0f) - mx);
      den += e * load_first(part_l(p) + c, lanes, 0.0f);
      storef(w.data() + p * 16, e);
    }
    const v16 inv = den > 0.0f ? 1.0f / den : v16{};
    for (int64_t p = 0; p < parts; ++p) storef(w.data() + p * 16, loadf(w.data() + p * 16) * inv);
#endif
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const int64_t i = c + lane;
      for (int64_t d = 0; d < Dv; d += kNat) {
        vnat o{};
        for (int64_t p = 0; p < parts; ++p)
          o += w[p * 16 + lane] * loadn((p < nb ? po + ((b0 + p) * R + i) * Dv : dout + i * Dv) + d);
        storen(acc + d, o);
      }
      const int64_t at = (r * R + pr.token_rows[i]) * Dv;
      if (pr.out_bf16) store_bf16(static_cast<uint16_t*>(pr.out) + at, acc, Dv);
      else std::memcpy(static_cast<float*>(pr.out) + at, acc, sizeof(float) * Dv);
    }
  }
}
