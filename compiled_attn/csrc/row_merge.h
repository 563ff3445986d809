// The decode kernel's merged form, per row: a run of blocks folded into one partial, the row's partials merged into
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
    for (int64_t d = 0; d < Dv; d += 16) storef(o + r * Dv + d, loadf(o + r * Dv + d) * a + loadf(bo + r * Dv + d) * c);
  }
}

// Row r's draft keys (verify: the slots of its k new tokens, after a window's edge keys) as one more partial, in
// float32 as the vector path: per query row i of a KV head, over the keys the mask shows its token (i / (G /
// tokens)), the max score dm (the lowest float32 when it sees none), the sum of exp dl and the weighted V sum do.
// A key's K/V rows are converted once per head for all its query rows; a row's scores come four keys to a
// horizontal sum and sixteen to an exp. Returns false when a key some token sees has its slot outside the caches
// (left out, never read). The few keys (k + a window's edge) cost a fraction of the prefix; as ATen ops around the
// kernel (gathers, two batched matmuls, the join of the two parts) they had cost several times that.
struct DraftScratch {
  std::vector<float> kf, vf, s, q;  // [nd, D], [nd, Dv] converted rows; [nd + 16] one query row's scores; [D] its
                                   // query, where the queries are bf16 as the caller holds them
  std::vector<int64_t> ids;      // [nd] the keys a query row sees
  std::vector<uint8_t> seen;     // [nd] keys some token of the row sees
  void start(const Problem& pr) {
    kf.resize(pr.nd * pr.D), vf.resize(pr.nd * pr.Dv), s.resize(pr.nd + 16), ids.resize(pr.nd), seen.resize(pr.nd);
    q.resize(pr.D);
  }
};

template <class L>
static bool draft_partial(const Problem& pr, int64_t r, DraftScratch& ds, float* dm, float* dl, float* dout) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t nd = pr.nd, D = pr.D, Dv = pr.Dv, G = pr.G, per_token = G / pr.tokens;
  const int64_t* slots = pr.draft_slots + r * nd;
  const uint8_t* mask = pr.draft_mask + r * pr.tokens * nd;
  bool inside = true;
  for (int64_t j = 0; j < nd; ++j) {
    uint8_t any = 0;
    for (int64_t t = 0; t < pr.tokens; ++t) any |= mask[t * nd + j];
    if (any && (slots[j] < 0 || slots[j] >= pr.num_slots)) any = 0, inside = false;
    ds.seen[j] = any;
  }
  for (int64_t h = 0; h < pr.hkv; ++h) {
    for (int64_t j = 0; j < nd; ++j) {
      if (!ds.seen[j]) continue;
      const T* kr = kc + slots[j] * pr.k_row + h * pr.k_head;
      const T* vr = vc + slots[j] * pr.v_row + h * pr.v_head;
      row_to_float<L>(kr, D, pr.k_mul, ds.kf.data() + j * D);
      row_to_float<L>(vr, Dv, pr.v_mul, ds.vf.data() + j * Dv);
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = h * G + g;
      const float* q = pr.qs ? pr.qs + (r * pr.hkv * G + i) * D : ds.q.data();
      if (!pr.qs) row_to_float<BF16>(query_bf16(pr, r, i), D, 1.0f, ds.q.data());
      const uint8_t* shows = mask + (g / per_token) * nd;
      int64_t n = 0;
      for (int64_t j = 0; j < nd; ++j)
        if (ds.seen[j] && shows[j]) ds.ids[n++] = j;
      float* s = ds.s.data();
      for (int64_t c = 0; c < n; c += 4) {  // four keys at a time: four independent sums
        const float* k0 = ds.kf.data() + ds.ids[c] * D;
        const float* k1 = ds.kf.data() + ds.ids[std::min(c + 1, n - 1)] * D;
        const float* k2 = ds.kf.data() + ds.ids[std::min(c + 2, n - 1)] * D;
        const float* k3 = ds.kf.data() + ds.ids[std::min(c + 3, n - 1)] * D;
        v16 a0{}, a1{}, a2{}, a3{};
        for (int64_t d = 0; d < D; d += 16) {
          const v16 x = loadf(q + d);
          a0 += x * loadf(k0 + d), a1 += x * loadf(k1 + d), a2 += x * loadf(k2 + d), a3 += x * loadf(k3 + d);
        }
        const v4f t = hsum4(a0, a1, a2, a3);
        for (int u = 0; u < 4; ++u) s[c + u] = t[u];
      }
      float m = -FLT_MAX, l = 0.0f;
      for (int64_t c = 0; c < n; ++c) {
        if (pr.cap > 0.f) s[c] = pr.cap * std::tanh(s[c] / pr.cap);
        m = std::max(m, s[c]);
      }
      for (int64_t c = 0; c < n; c += 16) {
        const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16 e = vexp(loadf(s + c) - m);
        e = lane < (int32_t)(n - c) ? e : v16{};  // 0 past the row's keys
        storef(s + c, e);
        l += hsum(e);
      }
      float* o = dout + i * Dv;
      for (int64_t d = 0; d < Dv; d += 64) {  // 64 columns at a time in registers (Dv: a multiple of 16)
        const int64_t w = std::min<int64_t>(64, Dv - d);
        v16 o0{}, o1{}, o2{}, o3{};
        for (int64_t c = 0; c < n; ++c) {
          const float* vr = ds.vf.data() + ds.ids[c] * Dv + d;
          const v16 e = splat(s[c]);
          o0 += e * loadf(vr);
          if (w > 16) o1 += e * loadf(vr + 16);
          if (w > 32) o2 += e * loadf(vr + 32);
          if (w > 48) o3 += e * loadf(vr + 48);
        }
        storef(o + d, o0);
        if (w > 16) storef(o + d + 16, o1);
        if (w > 32) storef(o + d + 32, o2);
        if (w > 48) storef(o + d + 48, o3);
      }
      dm[i] = m, dl[i] = l;
    }
  }
  return inside;
}

// n (a multiple of 16) floats -> bfloat16, rounded to nearest even (NaN stays NaN), as torch converts.
static inline void store_bf16(uint16_t* dst, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#else
    u32x16 b;
    std::memcpy(&b, x + i, 64);
    const u32x16 nan = (u32x16)((b & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
    const u32x16 r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const u16x16 h = __builtin_convertvector((r & ~nan) | (((b >> 16) | 0x40u) & nan), u16x16);
    std::memcpy(dst + i, &h, 32);
#endif
  }
}

// Row r's output: sum_b o_b e^(m_b - M) / (sum_b l_b e^(m_b - M) + e^(sink - M)), M the max of the m_b and the
// sink, over row r's partials b in [b0, b1) of pm [., R], pl [., R], po [., R, Dv] and, with dm, the draft partial
// (dm, dl, dout); zeros for a row with none. Each query row summed in acc [Dv], then stored where Problem::out says.
static void merge_row(const Problem& pr, int64_t r, int64_t b0, int64_t b1, const float* pm, const float* pl,
                      const float* po, const float* dm, const float* dl, const float* dout, float* acc) {
  const int64_t R = pr.hkv * pr.G, Dv = pr.Dv;
  for (int64_t i = 0; i < R; ++i) {
    float* o = acc;
    std::memset(o, 0, sizeof(float) * Dv);
    float mx = pr.sinks ? pr.sinks[i] : -INFINITY;
    for (int64_t b = b0; b < b1; ++b) mx = std::max(mx, pm[b * R + i]);
    if (dm) mx = std::max(mx, dm[i]);
    float den = mx == -INFINITY ? 0.0f : pr.sinks ? std::exp(pr.sinks[i] - mx) : 0.0f;  // -inf: no part, no sink
    auto add = [&](float m, float l, const float* ob) {
      const float w = std::exp(m - mx);
      den += w * l;
      for (int64_t d = 0; d < Dv; d += 16) storef(o + d, loadf(o + d) + w * loadf(ob + d));
    };
    for (int64_t b = b0; b < b1 && mx != -INFINITY; ++b) add(pm[b * R + i], pl[b * R + i], po + (b * R + i) * Dv);
    if (dm && mx != -INFINITY) add(dm[i], dl[i], dout + i * Dv);
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int64_t d = 0; d < Dv; d += 16) storef(o + d, loadf(o + d) * inv);
    const int64_t at = token_major_offset(r, i, pr.out_tokens, pr.hkv, pr.G, Dv);
    if (pr.out_bf16) store_bf16(static_cast<uint16_t*>(pr.out) + at, o, Dv);
    else std::memcpy(static_cast<float*>(pr.out) + at, o, sizeof(float) * Dv);
  }
}
