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
// hides the reads better, is as fast: docs/performance.md has the side-by-side numbers.)
//
// Per block (B positions, Bp = B rounded up to 32):
// - scores, 16 positions at a time: the chunk's key rows, all heads, in slot order; 16 valid consecutive bf16 rows
//   are read by the tile loads in place, any other chunk is staged as bf16 (zeros at invalid positions: never
//   read); per head and group of <= 16 query rows, S^T [16 positions, rows] = K_chunk Q^T (the queries packed once
//   per call as B tiles), its columns gathered into the rows of s;
// - the block's softmax in float32, continuing the running one of its work item (a run of a row's blocks: the
//   running sums are rescaled to the new max, so the item writes one partial, at its last block), its weights
//   rounded to bf16;
// - V head by head: the head's rows for the whole block staged with each pair of positions interleaved (the tile
//   unit's layout for the B operand), then per group of query rows and 64 columns, O [rows, 16 columns] += P [rows,
//   32 positions] V_pairs in four accumulator tiles kept across the block's chunks; the interleave permutes columns
//   within each 32, undone when the item's sums are written out.
// Prefetches: K a few positions ahead in the scores of an item's first block (the next blocks' K comes into L2
// during the previous block's V phase), head 0's V beside it, and each next head's V while a head is staged (the
// transfers spread over both phases rather than bursting in one: bursts left the tile products waiting on memory).
#pragma once
#include "kernel_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <type_traits>

// Linux gives a process the tile registers' state only when it asks (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// a kernel that refuses leaves the vector path.
static bool tiles_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Whether the tile path serves a call (below 8 query rows per KV head the vector path is as fast).
template <class L>
static bool tiles_fit(const Problem& pr) {
  return Bf16Exact<L>::ok && pr.q_bf16_scale > 0.0f && pr.D % 32 == 0 && pr.Dv % 32 == 0 && pr.G >= 8 &&
         (pr.G <= 16 || pr.G % 16 == 0) && tiles_permitted();
}


// GCC 12's intrinsics tell the compiler that ldtilecfg reads 8 bytes of its 64 and that tileloadd reads no memory
// at all, so stores to the configuration or to a staged buffer could be dropped or moved past them: the two as
// asm statements that name the whole configuration and clobber memory.
#define TILE_LOAD(tile, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"((const void*)(base)), "r"((long)(stride)) : "memory")

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// One thread's buffers and tile configuration (gt: query rows per tile, T = G / gt groups per head).
struct TileScratch {
  int64_t gt = 0, groups = 0;
  std::vector<uint16_t> kt;  // [hkv, 16, D] one chunk's key rows
  std::vector<uint16_t> vt;  // [Bp / 2, Dv, 2] one head's value rows for the block, each pair interleaved
  std::vector<uint16_t> pt;  // [R, Bp] the block's softmax weights
  std::vector<float> ct;     // [16, gt] one score tile
  // the running softmax of a work item's blocks so far: max, sum, weighted V sums (columns in tile order)
  std::vector<float> m, l, alpha, acc;

  void start(const Problem& pr, int64_t Bp) {
    gt = std::min<int64_t>(pr.G, 16);
    groups = pr.G / gt;
    const int64_t R = pr.hkv * pr.G;
    kt.resize(pr.hkv * 16 * pr.D);
    vt.resize(Bp * pr.Dv);
    pt.resize(R * Bp);
    ct.resize(16 * gt);
    m.resize(R), l.resize(R), alpha.resize(R), acc.resize(R * pr.Dv);
    TileConfig c{};
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = (uint16_t)(4 * gt);  // S^T tile: 16 positions x gt rows, float32
    c.rows[1] = 16, c.colsb[1] = 64;                  // K: 16 positions x 32 bf16
    c.rows[2] = 16, c.colsb[2] = (uint16_t)(4 * gt);  // Q^T: 16 column pairs x gt rows
    for (int i = 3; i < 7; ++i) c.rows[i] = (uint8_t)gt, c.colsb[i] = 64;  // O: gt rows x 16 float32 columns
    c.rows[7] = (uint8_t)gt, c.colsb[7] = 64;                             // P: gt rows x 32 positions, bf16
    // V, 16 position pairs x 16 columns, is loaded into tile 1 (K's shape) once the scores are done
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
  }
  void finish() { _tile_release(); }
};

// The queries of one row as bf16 B tiles, into qt [rows, hkv, groups, D / 32, 16, gt, 2]: the scaled float32
// queries divided by the scale (q exactly again: the scale goes to the scores in float32), tile row k2 of column
// chunk c holding, per query row n of the group, the pair of elements 32 c + 2 k2, + 1.
static void pack_queries(const Problem& pr, int64_t row, uint16_t* qt) {
  const int64_t D = pr.D, G = pr.G, gt = std::min<int64_t>(G, 16), groups = G / gt, chunks = D / 32;
  const __m512 unscale = _mm512_set1_ps(1.0f / pr.q_bf16_scale);
  for (int64_t h = 0; h < pr.hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = pr.qs + ((row * pr.hkv + h) * G + g) * D;
      const int64_t t = g / gt, n = g % gt;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + 32 * c + 16), unscale),
                                               _mm512_mul_ps(_mm512_loadu_ps(qr + 32 * c), unscale));
        uint32_t pairs[16];
        std::memcpy(pairs, &x, 64);
        uint32_t* dst = reinterpret_cast<uint32_t*>(qt) + ((((row * pr.hkv + h) * groups + t) * chunks + c) * 16) * gt + n;
        for (int k2 = 0; k2 < 16; ++k2) dst[k2 * gt] = pairs[k2];
      }
    }
}

// One block by tiles, folded into its work item's running softmax (first / last: the item's first / last block;
// the last writes the item's m, l, o, as the vector path's partials). s: [R, Bp] scratch.
template <class L>
static void tile_block(const Problem& pr, const uint16_t* qt, const int64_t* slot, const uint8_t* val, float* s,
                       int64_t Bp, TileScratch& ts, float* mo, float* lo, float* oo, const int64_t* next_slot,
                       const uint8_t* next_val, bool first, bool last) {
  const bool k_fetched = !first;
  typedef typename L::T T;
  const T* kc = static_cast<const T*>(pr.k);
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t D = pr.D, Dv = pr.Dv, G = pr.G, hkv = pr.hkv, B = pr.B, R = hkv * G;
  const int64_t gt = ts.gt, chunks = D / 32;
  const float score_mul = pr.q_bf16_scale * pr.k_mul;
  auto valid_at = [&](int64_t p) { return p < B && val[p]; };
  auto any_valid = [&](int64_t p0, int64_t n) {
    for (int64_t p = p0; p < p0 + n; ++p)
      if (valid_at(p)) return true;
    return false;
  };
  // scores
  const __m512i tile_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)gt));
  for (int64_t c0 = 0; c0 < Bp; c0 += 16) {
    __mmask16 live = 0;
    for (int p = 0; p < 16; ++p) live |= (__mmask16)((valid_at(c0 + p) ? 1u : 0u) << p);
    if (!live) {
      for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(s + r * Bp + c0, _mm512_set1_ps(-INFINITY));
      continue;
    }
    // a bf16 chunk of 16 valid, consecutive slots (a page's run) is read by the tile loads in place, at the cache's
    // row stride; any other is staged
    bool direct = std::is_same<L, BF16>::value && live == 0xFFFF;
    for (int p = 1; p < 16 && direct; ++p) direct = slot[c0 + p] == slot[c0] + p;
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t pos = c0 + p, ahead = pos + kPrefetch;
      const bool ok = valid_at(pos), fetch = !k_fetched && valid_at(ahead);
      if (valid_at(ahead)) prefetch_lines(vc + slot[ahead] * pr.v_row, Dv * (int64_t)sizeof(T));  // head 0's V
      for (int64_t h = 0; h < hkv; ++h) {
        if (fetch) prefetch_lines(kc + slot[ahead] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
        if (direct) continue;
        uint16_t* dst = ts.kt.data() + (h * 16 + p) * D;
        const T* src = kc + slot[pos] * pr.k_row + h * pr.k_head;
        for (int64_t d = 0; d < D; d += 32)
          _mm512_storeu_si512(dst + d, ok ? load32_bf16<L>(src + d) : _mm512_setzero_si512());
      }
    }
    const int64_t k_stride = direct ? pr.k_row * 2 : D * 2;
    for (int64_t h = 0; h < hkv; ++h) {
      const uint16_t* kb = direct ? reinterpret_cast<const uint16_t*>(kc + slot[c0] * pr.k_row + h * pr.k_head)
                                  : ts.kt.data() + h * 16 * D;
      for (int64_t t = 0; t < ts.groups; ++t) {
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; ++c) {
          TILE_LOAD(1, kb + 32 * c, k_stride);
          TILE_LOAD(2, qt + ((h * ts.groups + t) * chunks + c) * 32 * gt, gt * 4);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, ts.ct.data(), gt * 4);
        // the tile's columns (query rows) into s, scaled; -inf at invalid positions
        float* sr = s + (h * G + t * gt) * Bp + c0;
        for (int64_t n = 0; n < gt; ++n) {
          const __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(tile_rows, ts.ct.data() + n, 4), _mm512_set1_ps(score_mul));
          _mm512_storeu_ps(sr + n * Bp, _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), x));
        }
      }
    }
  }
  if (first) std::fill(ts.m.begin(), ts.m.end(), -FLT_MAX), std::fill(ts.l.begin(), ts.l.end(), 0.0f);
  softmax_rows(s, val, B, Bp, R, pr.cap, ts.m.data(), ts.l.data(), ts.alpha.data());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t p = 0; p < Bp; p += 32) {
      __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * Bp + p + 16), _mm512_loadu_ps(s + r * Bp + p));
      std::memcpy(ts.pt.data() + r * Bp + p, &x, 64);
    }
  // the running sums rescaled to the new max
  for (int64_t r = 0; r < R; ++r) {
    float* ar = ts.acc.data() + r * Dv;
    if (first) std::fill(ar, ar + Dv, 0.0f);
    else if (ts.alpha[r] != 1.0f)
      for (int64_t d = 0; d < Dv; d += 16) storef(ar + d, loadf(ar + d) * ts.alpha[r]);
  }
  // weighted V, head by head: the head's V rows for the block staged as interleaved pairs (the next head's
  // prefetched meanwhile, and the next block's keys into L2), then per group of query rows and 64 columns four
  // accumulator tiles kept across the block's 32-position chunks
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t k2 = 0; k2 < Bp / 2; ++k2) {
      const int64_t p0 = 2 * k2, p1 = p0 + 1;
      for (int64_t p = p0; p <= p1; ++p) {
        if (h + 1 < hkv && valid_at(p))
          prefetch_lines(vc + slot[p] * pr.v_row + (h + 1) * pr.v_head, Dv * (int64_t)sizeof(T));
        if (next_slot && p < B && next_val[p])
          prefetch_lines<2>(kc + next_slot[p] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
      }
      uint16_t* dst = ts.vt.data() + k2 * Dv * 2;
      const T* v0 = valid_at(p0) ? vc + slot[p0] * pr.v_row + h * pr.v_head : nullptr;
      const T* v1 = valid_at(p1) ? vc + slot[p1] * pr.v_row + h * pr.v_head : nullptr;
      for (int64_t d = 0; d < Dv; d += 32) {
        const __m512i x0 = v0 ? load32_bf16<L>(v0 + d) : _mm512_setzero_si512();
        const __m512i x1 = v1 ? load32_bf16<L>(v1 + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * d, _mm512_unpacklo_epi16(x0, x1));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_unpackhi_epi16(x0, x1));
      }
    }
    for (int64_t t = 0; t < ts.groups; ++t) {
      const int64_t r0 = h * G + t * gt;
      for (int64_t j0 = 0; j0 < Dv / 16; j0 += 4) {
        const int64_t jn = std::min<int64_t>(4, Dv / 16 - j0);
        float* o = ts.acc.data() + r0 * Dv + 16 * j0;
        TILE_LOAD(3, o, Dv * 4);
        if (jn > 1) TILE_LOAD(4, o + 16, Dv * 4);
        if (jn > 2) TILE_LOAD(5, o + 32, Dv * 4);
        if (jn > 3) TILE_LOAD(6, o + 48, Dv * 4);
        for (int64_t c0 = 0; c0 < Bp; c0 += 32) {
          if (!any_valid(c0, 32)) continue;
          TILE_LOAD(7, ts.pt.data() + r0 * Bp + c0, Bp * 2);
          const uint16_t* vb = ts.vt.data() + c0 / 2 * Dv * 2 + 32 * j0;
          TILE_LOAD(1, vb, Dv * 4);
          _tile_dpbf16ps(3, 7, 1);
          if (jn > 1) {
            TILE_LOAD(1, vb + 32, Dv * 4);
            _tile_dpbf16ps(4, 7, 1);
          }
          if (jn > 2) {
            TILE_LOAD(1, vb + 64, Dv * 4);
            _tile_dpbf16ps(5, 7, 1);
          }
          if (jn > 3) {
            TILE_LOAD(1, vb + 96, Dv * 4);
            _tile_dpbf16ps(6, 7, 1);
          }
        }
        _tile_stored(3, o, Dv * 4);
        if (jn > 1) _tile_stored(4, o + 16, Dv * 4);
        if (jn > 2) _tile_stored(5, o + 32, Dv * 4);
        if (jn > 3) _tile_stored(6, o + 48, Dv * 4);
      }
    }
  }
  if (!last) return;
  // the item's partial; the sums' columns back in V's order: per 32 elements the interleave put words 0-3 of each
  // 128-bit lane in the first 16 columns (elements 0-3, 8-11, 16-19, 24-27) and words 4-7 in the next 16
  std::copy(ts.m.begin(), ts.m.end(), mo);
  std::copy(ts.l.begin(), ts.l.end(), lo);
  const v16 mul = splat(pr.v_mul);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < Dv; d += 32) {
      const v16 lo16 = loadf(ts.acc.data() + r * Dv + d), hi16 = loadf(ts.acc.data() + r * Dv + d + 16);
      storef(oo + r * Dv + d,
             __builtin_shufflevector(lo16, hi16, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23) * mul);
      storef(oo + r * Dv + d + 16,
             __builtin_shufflevector(lo16, hi16, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31) * mul);
    }
}

#else  // no tile unit in this build: the vector path serves every call

struct TileScratch {
  void start(const Problem&, int64_t) {}
  void finish() {}
};
template <class L>
static bool tiles_fit(const Problem&) { return false; }
static bool tiles_permitted() { return false; }
static void pack_queries(const Problem&, int64_t, uint16_t*) {}
template <class L>
static void tile_block(const Problem&, const uint16_t*, const int64_t*, const uint8_t*, float*, int64_t, TileScratch&, float*,
                       float*, float*, const int64_t*, const uint8_t*, bool, bool) {}

#endif
