// The tile path's softmax (tile_blocks.h has the path): per score block, down the positions of a block's
// position-major scores, continuing its work item's running softmax, the weights rounded to bf16 into the rows the
// V products take.
#pragma once
#include "tile_setup.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)

// One chunk's weights: per pair of positions e = exp(c s + shift) (0 at invalid positions: bits says which are
// valid; all 32 where full), summed into sum, rounded to bf16 side by side, then 32 positions x 16 lanes transposed
// in registers into the lanes' rows of ts.pt. The weights stay in registers (a buffer of 32 vectors between the
// exp and the transpose had cost stores and loads). mx: the scores' running max where track (tile_softmax's one
// pass).
template <bool full, bool track>
static inline void tile_weights(const float* sv, uint32_t bits, float c, v16 shift, __m512i pair_order, int64_t sb,
                                int64_t c0, int64_t Bp, TileScratch& ts, v16& sum, v16& mx) {
  __m512i w[16];
  for (int i = 0; i < 16; ++i) {
    const v16 x0 = loadf(sv + (c0 + 2 * i) * 16), x1 = loadf(sv + (c0 + 2 * i + 1) * 16);
    v16 e0 = vexp(x0 * c + shift), e1 = vexp(x1 * c + shift);
    if (!full) {
      if (!((bits >> (2 * i)) & 1)) e0 = v16{};
      if (!((bits >> (2 * i + 1)) & 1)) e1 = v16{};
    }
    if (track) {
      const v16 y0 = full || ((bits >> (2 * i)) & 1) ? x0 : splat(-INFINITY);
      const v16 y1 = full || ((bits >> (2 * i + 1)) & 1) ? x1 : splat(-INFINITY);
      const v16 y = y0 > y1 ? y0 : y1;
      mx = y > mx ? y : mx;
    }
    sum += e0;
    sum += e1;
    w[i] = _mm512_permutexvar_epi16(pair_order, (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0));
  }
  transpose16(w);
  for (int64_t lane = 0; lane < 16; ++lane) {
    const int64_t r = ts.row_of(sb, lane);
    if (r >= 0) _mm512_storeu_si512(ts.pt.data() + r * Bp + c0, w[lane]);
  }
}

// The block's softmax, per score block as column_softmax (column_softmax.h) computes it: M = max(m, the block's
// scores), alpha = e^(c (m - M)), l = l alpha + the sum of the weights, m = M; the weights rounded to bf16 into
// ts.pt (tile_weights). Chunks whose 32 positions are all valid (most) go without a test per position.
// Once every lane has a running max, a block is first taken in one pass against it (M = m, alpha = 1: no pass for
// the max, and the running sums need no rescale); only where the block's scores pass m by more than kMaxMargin
// (weights up to e^kMaxMargin, well inside float32 and bf16) is it done again in two passes with its own max.
constexpr float kMaxMargin = 5.5f;  // in the exp's units: weights up to e^5.5, about 245
static inline bool any_lane(i32x16 m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0; }

static void tile_softmax(const Problem& pr, int64_t c_lo, int64_t c_hi, int64_t Bp, TileScratch& ts, RowStream& vs,
                         int64_t v_per) {
  __m512i pair_order;  // words 2n, 2n + 1 <- n, 16 + n: position 2i's and 2i + 1's weights of lane n side by side
  {
    uint16_t idx[32];
    for (int n = 0; n < 16; ++n) idx[2 * n] = (uint16_t)n, idx[2 * n + 1] = (uint16_t)(16 + n);
    pair_order = _mm512_loadu_si512(idx);
  }
  ColumnState& cs = ts.cs;
  const float c = pr.q_bf16_scale * pr.k_mul;
  auto valid_at = [&](int64_t p) { return (ts.valid_bits[p / 32] >> (p % 32)) & 1; };
  for (int64_t sb = 0; sb < cs.nsb; ++sb) {
    float* sv = cs.st.data() + sb * Bp * 16;
    if (pr.cap > 0.f) cap_scores(pr, sv, c_lo, c_hi, c, valid_at);
    const v16 m_old = loadf(cs.m.data() + sb * 16);
    v16 sum{}, seen = splat(-INFINITY);
    const bool running = !any_lane(m_old == splat(-FLT_MAX));
    if (running) {
      for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
        const uint32_t bits = ts.valid_bits[c0 / 32];
        if (!bits) continue;
        vs.fetch(v_per);
        if (bits == ~0u) tile_weights<true, true>(sv, bits, c, m_old * -c, pair_order, sb, c0, Bp, ts, sum, seen);
        else tile_weights<false, true>(sv, bits, c, m_old * -c, pair_order, sb, c0, Bp, ts, sum, seen);
      }
      if (!any_lane(seen * c > m_old * c + kMaxMargin)) {
        storef(cs.alpha.data() + sb * 16, splat(1.0f));
        storef(cs.l.data() + sb * 16, loadf(cs.l.data() + sb * 16) + sum);
        continue;
      }
      sum = v16{};
    }
    const v16 mx = scores_max(sv, c_lo, c_hi, valid_at);
    const v16 m_new = mx > m_old ? mx : m_old;
    storef(cs.alpha.data() + sb * 16, vexp((m_old - m_new) * c));
    const v16 shift = m_new * -c;
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
      const uint32_t bits = ts.valid_bits[c0 / 32];
      if (!bits) continue;
      if (!running) vs.fetch(v_per);
      if (bits == ~0u) tile_weights<true, false>(sv, bits, c, shift, pair_order, sb, c0, Bp, ts, sum, seen);
      else tile_weights<false, false>(sv, bits, c, shift, pair_order, sb, c0, Bp, ts, sum, seen);
    }
    storef(cs.l.data() + sb * 16, loadf(cs.l.data() + sb * 16) * loadf(cs.alpha.data() + sb * 16) + sum);
    storef(cs.m.data() + sb * 16, m_new);
  }
}

#endif
