// The tile path's setup (tile_blocks.h has the path itself): whether it may run, its tile configurations and
// per-thread buffers, the queries packed as tiles, and the stream of prefetches that brings a block's rows in.
#pragma once
#include "column_softmax.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

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

constexpr int64_t kVSpan = 128;  // positions of V staged at a time (its pairs stay in L1 for the products)

// One thread's buffers and tile configurations (gt: query rows per tile, T = G / gt groups per head). The scores
// are kept as the tiles give them (column_softmax.h: a score block holds one group's rows, or two groups' when gt
// = 8), and only the bf16 weights are transposed into rows for the V products.
struct TileScratch {
  int64_t gt = 0, groups = 0, lanes = 0, per = 0;  // lanes per group in a score block, groups per block
  ColumnState cs;             // scores (raw products: the scale goes into the exp), running softmax, sums (the
                              // columns in tile order)
  Scratch<uint16_t> kt;       // [Bp / 32, hkv, 32, D] the block's key rows, where staged
  std::vector<uint8_t> direct;  // [Bp / 32, 2] per 16-position half of a chunk: 16 rows the tile loads read in place
  Scratch<uint16_t> vt;       // [kVSpan / 2, Dv, 2] one head's value rows for a span, each pair interleaved
  Scratch<uint16_t> pt;       // [R, Bp] the block's softmax weights, bf16
  TileConfig scores{}, sums{};
  std::vector<int64_t> lane_rows;  // [score blocks * 16] the query row of each lane, -1 where none (row_of)
  std::vector<uint32_t> valid_bits;  // [Bp / 32] per chunk of the block's scores, a bit per valid position

  void start(const Problem& pr, int64_t Bp) {
    gt = std::min<int64_t>(pr.G, 16);
    groups = pr.G / gt;
    lanes = gt <= 8 ? 8 : 16;
    per = 16 / lanes;
    const int64_t R = pr.hkv * pr.G;
    cs.start((pr.hkv * groups + per - 1) / per, Bp, R, pr.Dv);
    lane_rows.resize(cs.nsb * 16);
    for (int64_t sb = 0; sb < cs.nsb; ++sb)
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t gi = sb * per + lane / lanes, n = lane % lanes;
        lane_rows[sb * 16 + lane] = gi < pr.hkv * groups && n < gt ? gi * gt + n : -1;
      }
    valid_bits.resize(Bp / 32);
    kt.resize(pr.hkv * Bp * pr.D);
    direct.resize(Bp / 32 * 2);
    vt.resize(std::min<int64_t>(Bp, kVSpan) * pr.Dv);
    pt.resize(R * Bp);
    scores.palette = sums.palette = 1;
    // scores: four S^T accumulators (16 positions x gt rows, float32), two K tiles (16 positions x 32 bf16), two
    // Q^T tiles (16 column pairs x gt rows): four independent products in flight, not one chain
    for (int i : {0, 3, 4, 5, 2, 7}) scores.rows[i] = 16, scores.colsb[i] = (uint16_t)(4 * gt);
    for (int i : {1, 6}) scores.rows[i] = 16, scores.colsb[i] = 64;
    // one row group per head: tiles 4 and 5 (no accumulators then) take every other chunk's K, and 7 its Q^T, so
    // that loading one chunk's tiles need not wait for the products still reading the other's
    if (groups == 1) scores.colsb[4] = scores.colsb[5] = 64;
    // V sums: V (16 position pairs x 16 columns) in tiles 0-2 in turn, O in tiles 3-6 (gt rows x 16 float32
    // columns), P in 7 (gt rows x 32 positions, bf16); two row groups at a time (gt = 16) take V in 0 and 1 and
    // the second group's P in 2
    for (int i : {0, 1, 2}) sums.rows[i] = 16, sums.colsb[i] = 64;
    for (int i = 3; i < 8; ++i) sums.rows[i] = (uint8_t)gt, sums.colsb[i] = 64;
  }
  static void load(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
  void finish() { _tile_release(); }
  // the query row of a score block's lane (-1: no row), looked up: the softmax asks for every lane of every chunk,
  // and computing it takes two integer divisions
  int64_t row_of(int64_t sb, int64_t lane) const { return lane_rows[sb * 16 + lane]; }
};

// 16 x 16 32-bit elements transposed in registers (r[i][j] -> r[j][i]).
static inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // u[4g + j] holds rows 4g..4g+3, elements j, j + 4, j + 8, j + 12 in its lanes
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// The queries of one row's KV head h as bf16 B tiles, into qt [rows, hkv, groups, D / 32, 16, gt, 2]: the float32
// queries divided by q_bf16_scale (q exactly again: the scale goes to the scores in float32), tile row k2 of column
// chunk c holding, per query row n of the group, the pair of elements 32 c + 2 k2, + 1. Per group and chunk the
// rows' pairs (16 lanes of 32 bits each) are transposed in registers.
static void pack_queries(const Problem& pr, int64_t row, int64_t h, uint16_t* qt) {
  const int64_t D = pr.D, G = pr.G, gt = std::min<int64_t>(G, 16), groups = G / gt, chunks = D / 32;
  const __m512 unscale = _mm512_set1_ps(1.0f / pr.q_bf16_scale);
  for (int64_t t = 0; t < groups; ++t)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i x[16];
      for (int64_t n = 0; n < 16; ++n) {
        if (n >= gt) {
          x[n] = _mm512_setzero_si512();
          continue;
        }
        if (!pr.qs) {  // bf16 as the caller holds it (q_bf16_scale 1)
          x[n] = _mm512_loadu_si512(query_bf16(pr, row, h * G + t * gt + n) + 32 * c);
          continue;
        }
        const float* qr = pr.qs + ((row * pr.hkv + h) * G + t * gt + n) * D + 32 * c;
        x[n] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + 16), unscale),
                                            _mm512_mul_ps(_mm512_loadu_ps(qr), unscale));
      }
      transpose16(x);  // x[k2] lane n: row n's pair k2
      uint32_t* dst = reinterpret_cast<uint32_t*>(qt) + ((((row * pr.hkv + h) * groups + t) * chunks + c) * 16) * gt;
      for (int64_t k2 = 0; k2 < 16; ++k2) {
        if (gt == 16) _mm512_storeu_si512(dst + k2 * 16, x[k2]);
        else _mm512_mask_storeu_epi32(dst + k2 * gt, (__mmask16)((1u << gt) - 1), x[k2]);
      }
    }
}

// Lines of a block's rows (all heads of each valid position's slot) prefetched into L2 a few at a time: the tile
// path calls fetch() from inside its compute loops, so that the reads overlap the products instead of bursting
// before them (a burst of prefetches fills the line-fill buffers and holds the core until they drain).
struct RowStream {
  const char* base = nullptr;
  const int64_t* slot = nullptr;
  const uint8_t* val = nullptr;
  int64_t row_bytes = 0, span_bytes = 0, p = 0, end = 0, off = 0;

  // rows of `row_bytes` at base, the first span_bytes of each, positions [0, end) where val holds
  void start(const void* b, int64_t row_bytes_, int64_t span_bytes_, const int64_t* s, const uint8_t* v, int64_t n) {
    base = static_cast<const char*>(b), row_bytes = row_bytes_, span_bytes = span_bytes_, slot = s, val = v;
    p = 0, end = v ? n : 0, off = 0;
    while (p < end && !val[p]) ++p;
  }
  int64_t lines_left() const {
    int64_t rows = 0;
    for (int64_t i = p; i < end; ++i) rows += val[i];
    return rows * ((span_bytes + 63) / 64) - off / 64;
  }
  void fetch(int64_t lines) {
    for (; lines > 0 && p < end; --lines) {
      __builtin_prefetch(base + slot[p] * row_bytes + off, 0, 2);
      if ((off += 64) >= span_bytes) {
        off = 0;
        do ++p; while (p < end && !val[p]);
      }
    }
  }
  void finish() { fetch(INT64_MAX); }
};

#else  // no tile unit in this build: the vector path serves every call

struct TileScratch {
  void start(const Problem&, int64_t) {}
  void finish() {}
};
template <class L>
static bool tiles_fit(const Problem&) { return false; }
static bool tiles_permitted() { return false; }
static void pack_queries(const Problem&, int64_t, int64_t, uint16_t*) {}

#endif
