// Scores kept position-major, as matrix products give them: per score block (16 query rows) and key position, 16
// float32 lanes, one per query row. The softmax then runs down the positions with whole-vector arithmetic (no
// per-row reductions), continuing the running one of a work item (a run of one row's blocks: the running sums are
// rescaled to each new max, so the item writes one partial, at its last block). Shared by the tile path
// (tile_blocks.h) and the wide path (wide_blocks.h).
#pragma once
#include "kernel_math.h"

// One thread's running softmax over the blocks of a work item.
struct ColumnState {
  int64_t nsb = 0;                 // score blocks
  Scratch<float> st;               // [nsb, Bp, 16] the block's scores (the wide path: then its weights)
  std::vector<float> m, l, alpha;  // [nsb, 16] per lane the running max (scores' units), sum, the block's rescale
  Scratch<float> acc;              // [R, Dv] the running weighted V sums
  std::vector<uint8_t> live;       // [Bp / 32] whether a 32-position chunk holds a valid position

  void start(int64_t n, int64_t Bp, int64_t R, int64_t Dv) {
    nsb = n;
    st.resize(nsb * Bp * 16);
    if (nsb * 16 != R) std::fill(st.data(), st.data() + nsb * Bp * 16, 0.0f);  // lanes no query row writes stay finite
    m.resize(nsb * 16), l.resize(nsb * 16), alpha.resize(nsb * 16), acc.resize(R * Dv), live.resize(Bp / 32);
  }
  void begin_item(bool zero_acc = true) {
    std::fill(m.begin(), m.end(), -FLT_MAX), std::fill(l.begin(), l.end(), 0.0f);
    if (zero_acc) std::fill(acc.data(), acc.data() + acc.n, 0.0f);
  }
};

// The 32-position chunks [c_lo, c_hi) from the first valid position's to the last's (empty when none is valid): a
// request's last block is mostly padding.
static void live_range(const uint8_t* val, int64_t B, int64_t Bp, int64_t& c_lo, int64_t& c_hi) {
  c_lo = Bp, c_hi = 0;
  for (int64_t p = 0; p < B; ++p)
    if (val[p]) c_lo = std::min(c_lo, p / 32 * 32), c_hi = p / 32 * 32 + 32;
}

// The soft-cap on a score block's valid scores (sv: position-major, 16 lanes; valid(p): whether position p is;
// c: the scale the scores still need).
template <class Valid>
static void cap_scores(const Problem& pr, float* sv, int64_t c_lo, int64_t c_hi, float c, Valid&& valid) {
  for (int64_t p = c_lo; p < c_hi; ++p)
    if (valid(p))
      for (int i = 0; i < 16; ++i) sv[p * 16 + i] = pr.cap * std::tanh(sv[p * 16 + i] * c / pr.cap) / c;
}

// Per lane the max of a score block's valid scores (-inf where none), in four running maxima (c_lo and c_hi are
// multiples of 32): one was a chain of dependent max instructions.
template <class Valid>
static v16 scores_max(const float* sv, int64_t c_lo, int64_t c_hi, Valid&& valid) {
  v16 m4[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};
  for (int64_t p = c_lo; p < c_hi; p += 4)
    for (int i = 0; i < 4; ++i)
      if (valid(p + i)) {
        const v16 x = loadf(sv + (p + i) * 16);
        m4[i] = x > m4[i] ? x : m4[i];
      }
  const v16 m01 = m4[0] > m4[1] ? m4[0] : m4[1], m23 = m4[2] > m4[3] ? m4[2] : m4[3];
  return m01 > m23 ? m01 : m23;
}

// The block's softmax per score block: M = max(m, the block's scores), alpha = e^(c (m - M)) (to rescale what was
// summed), P = e^(c (s - M)) (0 at invalid positions), l = l alpha + the sum of P, m = M; each live chunk's 32
// weight vectors handed to emit(sb, c0, e). c: the scale the scores still need (the tile path's raw products);
// a soft-cap rewrites the scores first.
template <class Emit>
static void column_softmax(const Problem& pr, const uint8_t* val, int64_t c_lo, int64_t c_hi, int64_t Bp, float c,
                           ColumnState& cs, Emit&& emit) {
  const int64_t B = pr.B;
  auto valid_at = [&](int64_t p) { return p < B && val[p]; };
  for (int64_t sb = 0; sb < cs.nsb; ++sb) {
    float* sv = cs.st.data() + sb * Bp * 16;
    if (pr.cap > 0.f) cap_scores(pr, sv, c_lo, c_hi, c, valid_at);
#if !defined(__AVX512F__)
    // AVX2: the same arithmetic on each vector's two halves (lanes 0-7, 8-15), held in registers
    v8f mx[2] = {splat8(-INFINITY), splat8(-INFINITY)};
    for (int64_t p = c_lo; p < c_hi; ++p)
      if (valid_at(p))
        for (int k = 0; k < 2; ++k) {
          const v8f x = loadf8(sv + p * 16 + 8 * k);
          mx[k] = x > mx[k] ? x : mx[k];
        }
    v8f m_new[2], shift[2], alpha[2], sum[2] = {};
    for (int k = 0; k < 2; ++k) {
      const v8f m_old = loadf8(cs.m.data() + sb * 16 + 8 * k);
      m_new[k] = mx[k] > m_old ? mx[k] : m_old;
      alpha[k] = vexp8((m_old - m_new[k]) * c);
      storef8(cs.alpha.data() + sb * 16 + 8 * k, alpha[k]);
      shift[k] = m_new[k] * -c;
    }
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
      if (!cs.live[c0 / 32]) continue;
      v16 e[32];
      for (int i = 0; i < 32; ++i) {
        float* ei = reinterpret_cast<float*>(&e[i]);
        for (int k = 0; k < 2; ++k) {
          const v8f x = valid_at(c0 + i) ? vexp8(loadf8(sv + (c0 + i) * 16 + 8 * k) * c + shift[k]) : v8f{};
          storef8(ei + 8 * k, x);
          sum[k] += x;
        }
      }
      emit(sb, c0, e);
    }
    for (int k = 0; k < 2; ++k) {
      storef8(cs.l.data() + sb * 16 + 8 * k, loadf8(cs.l.data() + sb * 16 + 8 * k) * alpha[k] + sum[k]);
      storef8(cs.m.data() + sb * 16 + 8 * k, m_new[k]);
    }
#else
    const v16 mx = scores_max(sv, c_lo, c_hi, valid_at);
    const v16 m_old = loadf(cs.m.data() + sb * 16);
    const v16 m_new = mx > m_old ? mx : m_old;
    storef(cs.alpha.data() + sb * 16, vexp((m_old - m_new) * c));
    const v16 shift = m_new * -c;
    v16 sum{};
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
      if (!cs.live[c0 / 32]) continue;
      v16 e[32];
      for (int i = 0; i < 32; ++i) {
        e[i] = valid_at(c0 + i) ? vexp(loadf(sv + (c0 + i) * 16) * c + shift) : v16{};
        sum += e[i];
      }
      emit(sb, c0, e);
    }
    storef(cs.l.data() + sb * 16, loadf(cs.l.data() + sb * 16) * loadf(cs.alpha.data() + sb * 16) + sum);
    storef(cs.m.data() + sb * 16, m_new);
#endif
  }
}

// The running sums of every query row rescaled to its new max (row_of(sb, lane): the lane's query row, or -1).
template <class RowOf>
static void rescale_sums(ColumnState& cs, int64_t Dv, RowOf&& row_of) {
  for (int64_t sb = 0; sb < cs.nsb; ++sb)
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t r = row_of(sb, lane);
      const float a = cs.alpha[sb * 16 + lane];
      if (r < 0 || a == 1.0f) continue;
      float* ar = cs.acc.data() + r * Dv;
      for (int64_t d = 0; d < Dv; d += kNat) storen(ar + d, loadn(ar + d) * a);
    }
}

// The item's m (times c, in the softmax's units; the lowest float32 for a row with no valid position) and l.
template <class RowOf>
static void write_max_and_sum(const ColumnState& cs, float c, float* mo, float* lo, RowOf&& row_of) {
  for (int64_t sb = 0; sb < cs.nsb; ++sb)
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t r = row_of(sb, lane);
      if (r < 0) continue;
      const float mr = cs.m[sb * 16 + lane];
      mo[r] = mr == -FLT_MAX ? -FLT_MAX : mr * c;
      lo[r] = cs.l[sb * 16 + lane];
    }
}
