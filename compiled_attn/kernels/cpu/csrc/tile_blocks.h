// The decode kernel's tile path: one block's scores and weighted V sum as bfloat16 matrix products on AMX tiles
// (Intel Xeon since Sapphire Rapids), float32 sums. Taken when the query is bf16 (the caller passes its scale),
// the cache holds values bf16 represents exactly (bf16, float8 e4m3fn / e5m2), head sizes are multiples of 32, and
// a KV head has 8 to 16 query rows or a multiple of 16 (tiles_fit). The scores' products are exact, as on the
// vector path; the softmax weights are rounded to bf16 for the V sum (as GPU flash attention does: relative error
// 2^-9 per weight, unbiased).
//
// Why: on the vector path every query row costs its own dot products per key row, so verify's 8-32 query rows per
// KV head cost several times a decode's 4. A tile product takes 16 key rows against up to 16 query rows at once:
// the time grows little with the rows. (At 4 rows the tiles sit mostly empty and the vector path, whose arithmetic
// hides the reads better, is as fast: docs/measuring.md has the side-by-side numbers.)
//
// Per block (B positions, Bp = B rounded up to 32; only the 32-position chunks from the first valid position's to
// the last's, and of those only chunks holding one: a request's last block is mostly padding):
// - scores (tile_scores) in 32-position chunks: each chunk's key rows, all heads, in slot order (16 valid
//   consecutive bf16 rows read by the tile loads in place, any other 16 staged as bf16); then head by head over the
//   chunks and per pair of row groups, S^T [16 positions, gt rows] = K Q^T (the queries packed once per call as B
//   tiles) for both halves of a chunk, four products in flight, stored as the tiles give them: position-major, 16
//   lanes of query rows;
// - the softmax (tile_softmax.h) down the positions with whole-vector arithmetic, continuing the running one of
//   the block's work item (a run of a row's blocks, which writes one partial, at its last block); the weights
//   rounded to bf16, 32 positions x 16 lanes transposed in registers into the rows the V products take;
// - V head by head, kVSpan positions at a time: staged with each pair of positions interleaved (the tile unit's
//   layout for the B operand), then per group of query rows and 64 columns, O [rows, 16 columns] += P [rows, 32
//   positions] V_pairs in four accumulator tiles (a head with two or more groups: per pair of groups and 32
//   columns, so that each V tile loaded serves both); the interleave permutes columns within each 32, undone when
//   the item's sums are written out.
// Prefetches, so that the reads overlap the compute: the next block's K (the next item's first block's too: the
// caller says which block follows) comes into L2 during the V phase; where the slots run in order, the block's V
// (all heads) during its scores and softmax, a few lines per loop step (RowStream); where they are scattered,
// head 0's V a chunk ahead in the scores, each next head's V and K while a head is staged. The staged head's rows
// a few positions ahead into L1. A thread's first block fetches its K a chunk ahead in its scores. (Bursts of
// prefetches fill the line-fill buffers and hold the core; prefetches into L1 far ahead stalled on them or were
// evicted before use.)
#pragma once
#include "tile_softmax.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <type_traits>

// The block's scores in 32-position chunks (ts.valid_bits, filled by the caller, says which positions are valid;
// chunks with none are skipped): first each chunk's key rows, all heads, in slot order (a 16-position half of 16
// valid consecutive bf16 rows read by the tile loads in place, ts.direct, any other half staged as bf16, zeros at
// invalid positions: never used); then head by head (its packed queries stay in L1 across the chunks) and per pair
// of row groups, S^T [16 positions, gt rows] = K_half Q^T for both halves of each chunk, stored position-major into
// ts.cs.st.
template <class L>
static void tile_scores(const Problem& pr, const uint16_t* qt, const int64_t* slot, const uint8_t* val, int64_t c_lo,
                        int64_t c_hi, int64_t Bp, TileScratch& ts, bool k_fetched, RowStream& vs, int64_t v_per,
                        bool v_streamed) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t D = pr.D, Dv = pr.Dv, hkv = pr.hkv, B = pr.B, gt = ts.gt, chunks = D / 32;
  auto valid_at = [&](int64_t p) { return p < B && val[p]; };
  TileScratch::load(ts.scores);
  for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
    const uint32_t live = ts.valid_bits[c0 / 32];
    if (!live) continue;
    uint8_t* direct = ts.direct.data() + c0 / 32 * 2;
    for (int half = 0; half < 2; ++half) {
      const int64_t a = c0 + 16 * half;
      direct[half] = std::is_same<L, BF16>::value && ((live >> (16 * half)) & 0xFFFF) == 0xFFFF;
      for (int p = 1; p < 16 && direct[half]; ++p) direct[half] = slot[a + p] == slot[a] + p;
    }
    for (int64_t p = 0; p < 32; ++p) {
      // an item's first block fetches its keys (and head 0's values) a chunk ahead into L2: lines into L1 a few
      // positions ahead stalled on the line-fill buffers
      const int64_t pos = c0 + p, ahead = pos + 32;
      const bool ok = valid_at(pos), fetch = !k_fetched && valid_at(ahead);
      if (!v_streamed && valid_at(ahead)) prefetch_lines<2>(vc + slot[ahead] * pr.v_row, Dv * (int64_t)sizeof(T));
      for (int64_t h = 0; h < hkv; ++h) {
        if (fetch) prefetch_lines<2>(kc + slot[ahead] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
        if (direct[p / 16]) continue;
        uint16_t* dst = ts.kt.data() + ((c0 / 32 * hkv + h) * 32 + p) * D;
        const T* src = ok ? kc + slot[pos] * pr.k_row + h * pr.k_head : nullptr;
        for (int64_t d = 0; d < D; d += 32)
          _mm512_storeu_si512(dst + d, ok ? load32_bf16<L>(src + d) : _mm512_setzero_si512());
      }
    }
  }
  // head by head (its packed queries stay in L1 across the chunks)
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {
      if (!ts.valid_bits[c0 / 32]) continue;
      const uint8_t* direct = ts.direct.data() + c0 / 32 * 2;
      const uint16_t* kt = ts.kt.data() + (c0 / 32 * hkv + h) * 32 * D;
      const uint16_t* k0 = direct[0] ? reinterpret_cast<const uint16_t*>(kc + slot[c0] * pr.k_row + h * pr.k_head) : kt;
      const uint16_t* k1 =
          direct[1] ? reinterpret_cast<const uint16_t*>(kc + slot[c0 + 16] * pr.k_row + h * pr.k_head) : kt + 16 * D;
      const int64_t s0 = direct[0] ? pr.k_row * 2 : D * 2, s1 = direct[1] ? pr.k_row * 2 : D * 2;
      for (int64_t t = 0; t < ts.groups; t += 2) {
        const bool two = t + 1 < ts.groups;
        const uint16_t* q0 = qt + (h * ts.groups + t) * chunks * 32 * gt;
        _tile_zero(0);
        _tile_zero(3);
        if (two) {
          _tile_zero(4);
          _tile_zero(5);
        }
        for (int64_t c = 0; c < chunks; ++c) {
          vs.fetch(v_per);
          if (!two && (c & 1)) {  // one row group: this chunk's tiles in 4, 5 and 7 (TileScratch::start)
            TILE_LOAD(4, k0 + 32 * c, s0);
            TILE_LOAD(5, k1 + 32 * c, s1);
            TILE_LOAD(7, q0 + c * 32 * gt, gt * 4);
            _tile_dpbf16ps(0, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
            continue;
          }
          TILE_LOAD(1, k0 + 32 * c, s0);
          TILE_LOAD(6, k1 + 32 * c, s1);
          TILE_LOAD(2, q0 + c * 32 * gt, gt * 4);
          _tile_dpbf16ps(0, 1, 2);
          _tile_dpbf16ps(3, 6, 2);
          if (two) {
            TILE_LOAD(7, q0 + (chunks + c) * 32 * gt, gt * 4);
            _tile_dpbf16ps(4, 1, 7);
            _tile_dpbf16ps(5, 6, 7);
          }
        }
        const int64_t gi = h * ts.groups + t;
        float* d0 = ts.cs.st.data() + ((gi / ts.per) * Bp + c0) * 16 + (gi % ts.per) * ts.lanes;
        _tile_stored(0, d0, 64);
        _tile_stored(3, d0 + 16 * 16, 64);
        if (two) {
          float* d1 = ts.cs.st.data() + (((gi + 1) / ts.per) * Bp + c0) * 16 + ((gi + 1) % ts.per) * ts.lanes;
          _tile_stored(4, d1, 64);
          _tile_stored(5, d1 + 16 * 16, 64);
        }
      }
    }
}

// The V sums' accumulator tiles 3-6 (a null pointer: that tile unused): zeroed (an item's first span) or loaded
// from the running sums at o3..o6 (rows stride bytes apart), and stored back there.
static inline void load_sums(bool zero, const float* o3, const float* o4, const float* o5, const float* o6,
                             int64_t stride) {
  if (zero) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    return;
  }
  TILE_LOAD(3, o3, stride);
  if (o4) TILE_LOAD(4, o4, stride);
  if (o5) TILE_LOAD(5, o5, stride);
  if (o6) TILE_LOAD(6, o6, stride);
}

static inline void store_sums(float* o3, float* o4, float* o5, float* o6, int64_t stride) {
  _tile_stored(3, o3, stride);
  if (o4) _tile_stored(4, o4, stride);
  if (o5) _tile_stored(5, o5, stride);
  if (o6) _tile_stored(6, o6, stride);
}

// One block by tiles, folded into its work item's running softmax (first / last: the item's first / last block;
// the last writes the item's m, l, o, as the vector path's partials). next_slot / next_val: the block after it, of
// whose keys next_k is the first head's (pr.k, or another work unit's heads).
template <class L>
static void tile_block(const Problem& pr, const uint16_t* qt, const int64_t* slot, const uint8_t* val, int64_t Bp,
                       TileScratch& ts, float* mo, float* lo, float* oo, const int64_t* next_slot,
                       const uint8_t* next_val, const void* next_k, bool first, bool last, bool k_streamed) {
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const T* nkc = static_cast<const T*>(next_k);
  const int64_t D = pr.D, Dv = pr.Dv, G = pr.G, hkv = pr.hkv, B = pr.B;
  const int64_t gt = ts.gt;
  auto valid_at = [&](int64_t p) { return p < B && val[p]; };
  const auto row_of = [&](int64_t sb, int64_t lane) { return ts.row_of(sb, lane); };
  int64_t c_lo, c_hi;
  live_range(val, B, Bp, c_lo, c_hi);
  // an item's first block with a valid position starts the sums in zeroed tiles (below) rather than in memory
  if (first) ts.cs.begin_item(c_lo >= c_hi);
  if (c_lo < c_hi) {
    // Where the slots run in order (the engine's allocations, pages), the block's V (all heads) streams into L2
    // during its scores and softmax and the next block's K during its V phase, each spread over the phase's loop
    // steps. Where they are scattered, each head's V and the next block's K for it come in while the head before
    // it is staged (rows from all over memory: streaming them all early held the line-fill buffers the K staging
    // needed).
    int64_t live_chunks = 0, in_order = 0, valid_rows = 0;
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 32) {  // each chunk's valid positions, a bit each (ts.valid_bits)
      uint32_t bits = 0;
      for (int64_t p = c0; p < c0 + 32; ++p)
        if (valid_at(p)) {
          bits |= 1u << (p - c0), ++valid_rows;
          in_order += p > 0 && valid_at(p - 1) && slot[p] == slot[p - 1] + 1;
        }
      ts.valid_bits[c0 / 32] = bits;
      live_chunks += bits != 0;
    }
    const bool v_streamed = 4 * in_order >= 3 * valid_rows;
    RowStream vs, ks;
    vs.start(vc, pr.v_row * (int64_t)sizeof(T), ((hkv - 1) * pr.v_head + Dv) * (int64_t)sizeof(T), slot,
             v_streamed ? val : nullptr, B);
    ks.start(nkc, pr.k_row * (int64_t)sizeof(T), ((hkv - 1) * pr.k_head + D) * (int64_t)sizeof(T), next_slot,
             v_streamed ? next_val : nullptr, next_slot ? B : 0);
    const int64_t v_steps = live_chunks * (hkv * ((ts.groups + 1) / 2) * (D / 32) + ts.cs.nsb);
    const int64_t k_steps = live_chunks * hkv * (16 + ts.groups * ((Dv / 16 + 3) / 4));
    const int64_t v_per = (vs.lines_left() + v_steps - 1) / std::max<int64_t>(v_steps, 1);
    const int64_t k_per = (ks.lines_left() + k_steps - 1) / std::max<int64_t>(k_steps, 1);
    tile_scores<L>(pr, qt, slot, val, c_lo, c_hi, Bp, ts, k_streamed, vs, v_per, v_streamed);
    tile_softmax(pr, c_lo, c_hi, Bp, ts, vs, v_per);
    vs.finish();
    if (!first) rescale_sums(ts.cs, Dv, row_of);
    // weighted V, head by head and kVSpan positions at a time: the head's V rows staged as interleaved pairs (its
    // rows a few positions ahead into L1; the next head's and the next block's keys into L2 meanwhile), then per
    // group of query rows and 64 columns four accumulator tiles kept across the span's 32-position chunks
    TileScratch::load(ts.sums);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t s0 = c_lo; s0 < c_hi; s0 += kVSpan) {
        const int64_t s1 = std::min(c_hi, s0 + kVSpan);
        for (int64_t k2 = s0 / 2; k2 < s1 / 2; ++k2) {
          const int64_t p0 = 2 * k2, p1 = p0 + 1;
          if (!ts.valid_bits[p0 / 32]) continue;
          for (int64_t p = p0; p <= p1; ++p) {
            if (valid_at(p + 8))
              prefetch_lines(vc + slot[p + 8] * pr.v_row + h * pr.v_head, Dv * (int64_t)sizeof(T));
            if (!v_streamed && h + 1 < hkv && valid_at(p))
              prefetch_lines<2>(vc + slot[p] * pr.v_row + (h + 1) * pr.v_head, Dv * (int64_t)sizeof(T));
            if (!v_streamed && next_slot && p < B && next_val[p])
              prefetch_lines<2>(nkc + next_slot[p] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
          }
          ks.fetch(k_per);
          uint16_t* dst = ts.vt.data() + (k2 - s0 / 2) * Dv * 2;
          const T* v0 = valid_at(p0) ? vc + slot[p0] * pr.v_row + h * pr.v_head : nullptr;
          const T* v1 = valid_at(p1) ? vc + slot[p1] * pr.v_row + h * pr.v_head : nullptr;
          for (int64_t d = 0; d < Dv; d += 32) {
            const __m512i x0 = v0 ? load32_bf16<L>(v0 + d) : _mm512_setzero_si512();
            const __m512i x1 = v1 ? load32_bf16<L>(v1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * d, _mm512_unpacklo_epi16(x0, x1));
            _mm512_storeu_si512(dst + 2 * d + 32, _mm512_unpackhi_epi16(x0, x1));
          }
        }
        int64_t t = 0;
        // two row groups at a time (where a head has them, gt = 16): each V tile loaded once for both, products
        // of a group and 32 columns in four accumulator tiles
        for (; t + 1 < ts.groups; t += 2) {
          const int64_t r0 = h * G + t * gt, r1 = r0 + gt;
          for (int64_t j0 = 0; j0 < Dv / 16; j0 += 2) {
            float* o0 = ts.cs.acc.data() + r0 * Dv + 16 * j0;
            float* o1 = ts.cs.acc.data() + r1 * Dv + 16 * j0;
            load_sums(first && s0 == c_lo, o0, o0 + 16, o1, o1 + 16, Dv * 4);
            for (int64_t c0 = s0; c0 < s1; c0 += 32) {
              if (!ts.valid_bits[c0 / 32]) continue;
              ks.fetch(k_per);
              const uint16_t* vb = ts.vt.data() + (c0 - s0) / 2 * Dv * 2 + 32 * j0;
              TILE_LOAD(7, ts.pt.data() + r0 * Bp + c0, Bp * 2);
              TILE_LOAD(0, vb, Dv * 4);
              TILE_LOAD(1, vb + 32, Dv * 4);
              _tile_dpbf16ps(3, 7, 0);
              TILE_LOAD(2, ts.pt.data() + r1 * Bp + c0, Bp * 2);
              _tile_dpbf16ps(4, 7, 1);
              _tile_dpbf16ps(5, 2, 0);
              _tile_dpbf16ps(6, 2, 1);
            }
            store_sums(o0, o0 + 16, o1, o1 + 16, Dv * 4);
          }
        }
        for (; t < ts.groups; ++t) {
          const int64_t r0 = h * G + t * gt;
          for (int64_t j0 = 0; j0 < Dv / 16; j0 += 4) {
            const int64_t jn = std::min<int64_t>(4, Dv / 16 - j0);
            float* o = ts.cs.acc.data() + r0 * Dv + 16 * j0;
            float* o4 = jn > 1 ? o + 16 : nullptr;
            float* o5 = jn > 2 ? o + 32 : nullptr;
            float* o6 = jn > 3 ? o + 48 : nullptr;
            load_sums(first && s0 == c_lo, o, o4, o5, o6, Dv * 4);
            for (int64_t c0 = s0; c0 < s1; c0 += 32) {
              if (!ts.valid_bits[c0 / 32]) continue;
              ks.fetch(k_per);
              TILE_LOAD(7, ts.pt.data() + r0 * Bp + c0, Bp * 2);
              const uint16_t* vb = ts.vt.data() + (c0 - s0) / 2 * Dv * 2 + 32 * j0;
              TILE_LOAD(0, vb, Dv * 4);
              if (jn > 1) TILE_LOAD(1, vb + 32, Dv * 4);
              _tile_dpbf16ps(3, 7, 0);
              if (jn > 2) TILE_LOAD(2, vb + 64, Dv * 4);
              if (jn > 1) _tile_dpbf16ps(4, 7, 1);
              if (jn > 3) TILE_LOAD(0, vb + 96, Dv * 4);
              if (jn > 2) _tile_dpbf16ps(5, 7, 2);
              if (jn > 3) _tile_dpbf16ps(6, 7, 0);
            }
            store_sums(o, o4, o5, o6, Dv * 4);
          }
        }
      }
    ks.finish();
  }
  if (!last) return;
  // the item's partial; the sums' columns back in V's order: per 32 elements the interleave put words 0-3 of each
  // 128-bit lane in the first 16 columns (elements 0-3, 8-11, 16-19, 24-27) and words 4-7 in the next 16
  write_max_and_sum(ts.cs, pr.q_bf16_scale * pr.k_mul, mo, lo, row_of);
  const v16 mul = splat(pr.v_mul);
  for (int64_t r = 0; r < hkv * G; ++r)
    for (int64_t d = 0; d < Dv; d += 32) {
      const v16 lo16 = loadf(ts.cs.acc.data() + r * Dv + d), hi16 = loadf(ts.cs.acc.data() + r * Dv + d + 16);
      storef(oo + r * Dv + d,
             __builtin_shufflevector(lo16, hi16, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23) * mul);
      storef(oo + r * Dv + d + 16,
             __builtin_shufflevector(lo16, hi16, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31) * mul);
    }
}

#else  // no tile unit in this build: the vector path serves every call

template <class L>
static void tile_block(const Problem&, const uint16_t*, const int64_t*, const uint8_t*, int64_t, TileScratch&, float*,
                       float*, float*, const int64_t*, const uint8_t*, const void*, bool, bool, bool) {}

#endif
