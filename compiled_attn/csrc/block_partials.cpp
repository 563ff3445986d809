// Decode attention's per-block partial softmax over a paged KV cache, read in place: the CPU kernel behind
// compiled_attn/native_decode.py, which builds this file with the machine's compiler on first use and calls it
// through ctypes (that module says why a hand-written kernel).
//
// One block is B key positions of one request. On the vector path (this file) all its query rows (Hkv heads x G
// rows) are scored against each key row as the row is read (a slot's heads lie together in the cache, so a page of
// consecutive slots is read front to back), then softmaxed, then V is summed with the weights; K/V are converted
// to float32 in registers (bf16, fp16, float8 e4m3fn / e5m2), so the cache is read once at its stored width. With
// a bf16 query and enough query rows the tile path (tile_blocks.h) computes the same block with AMX products.
// Invalid positions (past a request's end, a page's unwritten tail) are never read. The outputs are those of
// decode_fused.fused_block_partials: per block and query row the max score m, the sum of exp(score - m) and the
// unnormalised weighted V sum; a block with no valid key gives the lowest float32, 0 and zeros. The merged form
// folds runs of a row's blocks together as it computes them and then merges each row's partials into its output.
//
// Portable C++ with GCC/Clang vector extensions (kernel_math.h), built with -march=native; half precision
// converts with F16C/AVX-512 instructions when the target has them.
#include <type_traits>

#include "kernel_math.h"
#include "row_merge.h"
#include "tile_blocks.h"
#include "wide_blocks.h"


// out[g, :] = v_mul * sum_p w[g, p] * V[slot p, :] for GN query rows and DN x 16 columns, in registers. A bf16 V
// row is read 32 elements a vector and split into its even and odd elements (a shift and a mask, no widening
// shuffles), the sums kept in that order and interleaved back once at the end.
template <class L, int GN, int DN>
static inline void weighted_v(const typename L::T* vb, const int64_t* slot, const uint8_t* val, int64_t B,
                              int64_t v_row, const float* w, int64_t Bp, float* out, int64_t Dv, float v_mul) {
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
      for (int j = 0; j + 1 < DN; j += 2) load32<L>(vr + 16 * j, vv[j], vv[j + 1]);
      if constexpr (DN % 2) vv[DN - 1] = L::load(vr + 16 * (DN - 1));
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
  for (int64_t p = 0; p < B; ++p) {
    if (!val[p]) {
      for (int64_t r = 0; r < R; ++r) s[r * Bp + p] = -INFINITY;
      continue;
    }
    // with PAIRS two valid positions at once (each query row loaded once for both key rows, their sums reduced
    // together); their K and V lines then one position ahead of each (the next pair's first comes a pair ahead:
    // two ahead of each, as one position at a time takes them, was 7-14% slower side by side)
    const int64_t np = PAIRS && p + 1 < B && val[p + 1] ? 2 : 1, lookahead = np == 2 ? 1 : kPrefetch;
    bool ahead[2], far[2];
    int64_t ps[2], pf[2];
    for (int64_t i = 0; i < np; ++i) {
      const int64_t x = p + i;
      ahead[i] = x + lookahead < B && val[x + lookahead];
      ps[i] = ahead[i] ? slot[x + lookahead] : 0;
      // and K of position x + 8 into L2 where the slots are not in order (page size 1 after the pool has
      // churned): rows in order the hardware streams by itself
      far[i] = x + 8 < B && val[x + 8] && slot[x + 8] != slot[x] + 8;
      pf[i] = far[i] ? slot[x + 8] : 0;
    }
    for (int64_t h = 0; h < hkv; ++h) {
      // the K and V lines of the positions ahead, head by head: spread over the heads' work, not issued as one
      // burst of a whole row (a burst fills the line-fill buffers and stalls the arithmetic behind it)
      for (int64_t i = 0; i < np; ++i) {
        if (ahead[i]) {  // K for the next read, V kept a little longer (read after the block's softmax)
          prefetch_lines(kc + ps[i] * pr.k_row + h * pr.k_head, D * (int64_t)sizeof(T));
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
      } else if (DV && G % 4 == 0) {
        const float* q0 = static_cast<const float*>(q) + h * G * D;
        v16 kv[DV ? DV : 1];
        for (int j = 0; j + 1 < DV; j += 2) load32<L>(kr + 16 * j, kv[j], kv[j + 1]);
        if constexpr (DV % 2) kv[DV - 1] = L::load(kr + 16 * (DV - 1));
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
                              float* oo) {
  typedef typename L::T T;
  const T* vc = static_cast<const T*>(pr.v);
  const int64_t G = pr.G, B = pr.B, Dv = pr.Dv;
  for (int64_t h = 0; h < pr.hkv; ++h)
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        const int gn = (int)std::min<int64_t>(4, G - g0), dn = (int)(std::min<int64_t>(64, Dv - d0) / 16);
        const float* w = s + (h * G + g0) * Bp;
        float* out = oo + (h * G + g0) * Dv + d0;
        const T* vb = vc + h * pr.v_head + d0;
        if (gn == 4 && dn == 4) weighted_v<L, 4, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
        else if (gn == 1 && dn == 4) weighted_v<L, 1, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
        else if (gn == 2 && dn == 4) weighted_v<L, 2, 4>(vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
        else weighted_v_any<L>(gn, dn, vb, slot, val, B, pr.v_row, w, Bp, out, Dv, pr.v_mul);
      }
}

// Runs every block (the merged form: the used ones, then merges them). Returns 1 when a valid position's slot lay
// outside the cache (that position left out, nothing read there).
template <class L, int DV>
static int run_blocks(const Problem& pr) {
  const int64_t D = pr.D, G = pr.G, hkv = pr.hkv, B = pr.B, Dv = pr.Dv;
  const int64_t nruns = B / pr.unit, R = hkv * G, Bp = (B + 31) / 32 * 32;
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
  auto block_at = [&](int64_t j) { return pr.out ? order[j] : j; };
  // Work items: in the partials form one block each; in the merged form runs of up to `span` consecutive blocks of
  // one row, folded together as they are computed, so that one partial per item is written out and merged (storing
  // every block's partials to memory took a fifth of an instrumented single-thread run).
  // Item it covers order[item_start[it] ..][: item_count[it]] and leaves its partial at its first block's index.
  std::vector<int64_t> item_start, item_count, row_items, item_block;
  if (pr.out) {
    const int64_t span = std::clamp<int64_t>(used / (4 * std::max(pr.threads, 1)), 1, 8);
    row_items.assign(pr.rows + 1, 0);
    for (int64_t r = 0; r < pr.rows; ++r) {
      row_items[r] = (int64_t)item_start.size();
      for (int64_t j = first[r]; j < first[r + 1]; j += span) {
        item_start.push_back(j);
        item_count.push_back(std::min(span, first[r + 1] - j));
        item_block.push_back(order[j]);
      }
    }
    row_items[pr.rows] = (int64_t)item_start.size();
  }
  const int64_t items = pr.out ? (int64_t)item_start.size() : pr.n;
  // the merged form's items longest first (the threads take them in turn: a long one left for last kept the other
  // thread waiting at the merge)
  std::vector<int64_t> by_size(pr.out ? items : 0);
  for (int64_t i = 0; i < (int64_t)by_size.size(); ++i) by_size[i] = i;
  std::stable_sort(by_size.begin(), by_size.end(), [&](int64_t a, int64_t b) { return item_count[a] > item_count[b]; });
  const bool tiles = tiles_fit<L>(pr), wide = !tiles && wide_fit(pr);
  // a bf16 query's scores by bf16 pair dot products where the vector path serves it
#if defined(__AVX512BF16__)
  const bool pairs = !tiles && !wide && Bf16Exact<L>::ok && pr.q_bf16_scale > 0.0f && DV && DV % 2 == 0 && G % 4 == 0;
#else
  const bool pairs = false;
#endif
  // the tile path's queries, packed once per call for every row a block reads
  int64_t nrows = 0;
  for (int64_t j = 0; j < used && tiles; ++j) nrows = std::max(nrows, pr.block_req[block_at(j)] + 1);
  Scratch<uint16_t> qt;  // every row a block reads is packed before use
  qt.resize(tiles ? nrows * R * D : 0);
  std::atomic<int> outside{0};
#pragma omp parallel num_threads(pr.threads)
  {
    const bool vector = !tiles && !wide;
    std::vector<float> s(vector ? R * Bp : 0), qv(vector && !pairs ? R * D : 0), bm(R), bl(R), bo(pr.out && vector ? R * Dv : 0);
    std::vector<uint16_t> qb(pairs ? R * D : 0);
    // the current block's slots and validity, and the next one's (the tile path prefetches its keys)
    std::vector<int64_t> slots(2 * B);
    std::vector<uint8_t> keeps(2 * B);
    auto fill = [&](int64_t b, int64_t* slot, uint8_t* keep) {
      for (int64_t p = 0; p < B; ++p) {
        slot[p] = pr.runs[b * nruns + p / pr.unit] * pr.unit + p % pr.unit;
        keep[p] = pr.valid[b * B + p];
        if (keep[p] && (slot[p] < 0 || slot[p] >= pr.num_slots)) {
          keep[p] = 0;
          outside.store(1, std::memory_order_relaxed);
        }
      }
    };
    TileScratch ts;
    if (tiles) {
      ts.start(pr, Bp);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < nrows; ++r) pack_queries(pr, r, qt.data());
    }
    WideScratch ws;
    if (wide) ws.start(pr, Bp);
#pragma omp for schedule(dynamic, pr.out ? 1 : 2)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t it = pr.out ? by_size[i] : i;
      const int64_t j0 = pr.out ? item_start[it] : it, j1 = j0 + (pr.out ? item_count[it] : 1);
      const int64_t b0 = block_at(j0);
      int cur = 0;
      fill(b0, slots.data(), keeps.data());
      for (int64_t j = j0; j < j1; ++j, cur ^= 1) {
        const int64_t b = block_at(j);
        int64_t* slot = slots.data() + cur * B;
        uint8_t* keep = keeps.data() + cur * B;
        int64_t* next_slot = j + 1 < j1 ? slots.data() + (cur ^ 1) * B : nullptr;
        uint8_t* next_keep = keeps.data() + (cur ^ 1) * B;
        if (next_slot) fill(block_at(j + 1), next_slot, next_keep);
        if (tiles) {  // folds the item's blocks itself, and writes the item's partial at its last block
          tile_block<L>(pr, qt.data() + pr.block_req[b] * R * D, slot, keep, Bp, ts, pr.m + b0 * R,
                        pr.l + b0 * R, pr.o + b0 * R * Dv, next_slot, next_keep, j == j0, j + 1 == j1);
          continue;
        }
        if (wide) {  // likewise
          if (ws.q_row != pr.block_req[b]) pack_wide_queries(pr, pr.block_req[b], ws);
          wide_block<L>(pr, slot, keep, Bp, ws, pr.m + b0 * R, pr.l + b0 * R, pr.o + b0 * R * Dv, j == j0,
                        j + 1 == j1);
          continue;
        }
        // the item's first block writes its partial in place, the others beside it and are folded in
        float* mo = j == j0 ? pr.m + b0 * R : bm.data();
        float* lo = j == j0 ? pr.l + b0 * R : bl.data();
        float* oo = j == j0 ? pr.o + b0 * R * Dv : bo.data();
        const float* q = pr.qs + pr.block_req[b] * R * D;
#if defined(__AVX512BF16__)
        if (pairs) {
          to_bf16_rows(q, 1.0f / pr.q_bf16_scale, R * D, qb.data());
          vector_scores<L, DV ? DV : 2, true>(pr, slot, keep, qb.data(), s.data(), Bp);
        }
#endif
        if (!pairs) {
          for (int64_t i = 0; i < R * D; ++i) qv[i] = q[i] * pr.k_mul;  // K's scale applied to the queries
          vector_scores<L, DV, false>(pr, slot, keep, qv.data(), s.data(), Bp);
        }
        softmax_rows(s.data(), keep, B, Bp, R, pr.cap, mo, lo);
        vector_weighted_v<L>(pr, slot, keep, s.data(), Bp, oo);
        if (j != j0) fold_partials(R, Dv, pr.m + b0 * R, pr.l + b0 * R, pr.o + b0 * R * Dv, mo, lo, oo);
      }
    }
    if (tiles) ts.finish();
    if (pr.out) {
      const bool draft = pr.draft_slots != nullptr;
      std::vector<float> dm(draft ? R : 0), dl(dm.size()), dout(draft ? R * Dv : 0), acc(Dv);
      DraftScratch ds;
      if (draft) ds.start(pr);
#pragma omp for schedule(dynamic, 4)
      for (int64_t r = 0; r < pr.rows; ++r) {
        if (draft && !draft_partial<L>(pr, r, ds, dm.data(), dl.data(), dout.data()))
          outside.store(1, std::memory_order_relaxed);
        merge_row(pr, r, row_items.data(), item_block.data(), draft ? dm.data() : nullptr, dl.data(), dout.data(),
                  acc.data());
      }
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

// The queries as the kernel reads them, [rows, hkv, G, D] float32, from q token-major [rows * tokens, hkv * G /
// tokens, D] (query row h * G + t * (G / tokens) + g of row r is token r * tokens + t's head h * G / tokens + g) in
// its stored format (L: F32, BF16, F16).
template <class L>
static void gather_queries(const typename L::T* q, int64_t tokens, int64_t rows, int64_t hkv, int64_t G, int64_t D,
                           float* qs, int threads) {
  const int64_t per_token = G / tokens, R = hkv * G;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows * R; ++i) {
    const int64_t r = i / R, h = i % R / G, t = i % G / per_token, g = i % per_token;
    const typename L::T* src = q + ((r * tokens + t) * hkv * per_token + h * per_token + g) * D;
    for (int64_t d = 0; d < D; d += 16) storef(qs + i * D + d, L::load(src + d));
  }
}

// kind: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn, 4 float8_e5m2. q: the queries (a score is q . K times
// k_scale), of kind q_kind (0-2), [rows, hkv, G, D] (q_tokens 1) or, in the merged form, token-major with q_tokens
// query tokens per row (gather_queries); m, l, o: the blocks' partials (the output, or the merged form's scratch);
// out: nullptr, or the merged form's output, token-major as q (Problem::out), bfloat16 where out_bf16 else float32
// (sinks may be nullptr); num_slots: the caches' rows; q_bf16_scale: > 0 when q is a bfloat16 query times this
// scale (the tile path may take it, where the machine has one: tile_blocks.h), else 0; draft_slots: with out,
// nullptr or [rows, nd] more keys per row, which query row i of a KV head sees where draft_mask [rows, tokens, nd]
// shows them to its token i / (G / tokens) (verify's draft block: row_merge.h). Returns 0; 1 when a head size is
// not a multiple of 16, 2 for an unknown kind or query layout (the caller checks these before calling); 3 when a
// valid position's (or a seen draft key's) slot lay outside the caches (left out of the result, never read).
extern "C" int ca_block_partials(int kind, const void* q, const int64_t* block_req, const int64_t* runs,
                                 const uint8_t* valid, const void* k, const void* v, int64_t k_row, int64_t k_head,
                                 int64_t v_row, int64_t v_head, int64_t n, int64_t hkv, int64_t G, int64_t D,
                                 int64_t Dv, int64_t B, int64_t unit, float k_scale, float v_scale, float cap,
                                 float* m, float* l, float* o, int threads, int64_t rows, const float* sinks,
                                 void* out, int64_t num_slots, float q_bf16_scale,
                                 const int64_t* draft_slots, const uint8_t* draft_mask, int64_t nd,
                                 int64_t tokens, int q_kind, int64_t q_tokens, int out_bf16) {
  if (D % 16 || Dv % 16) return 1;
  if (q_kind < 0 || q_kind > 2 || q_tokens < 1 || G % q_tokens || ((q_kind || q_tokens > 1) && !out)) return 2;
  Scratch<float> qs;  // the queries converted and grouped, unless q is that already
  if (q_kind || q_tokens > 1) {
    qs.resize(rows * hkv * G * D);
    if (q_kind == 0) gather_queries<F32>(static_cast<const float*>(q), q_tokens, rows, hkv, G, D, qs.data(), threads);
    if (q_kind == 1) gather_queries<BF16>(static_cast<const uint16_t*>(q), q_tokens, rows, hkv, G, D, qs.data(), threads);
    if (q_kind == 2) gather_queries<F16>(static_cast<const uint16_t*>(q), q_tokens, rows, hkv, G, D, qs.data(), threads);
  }
  const float f = kind == 3 ? 256.0f : 1.0f;
  Problem pr{qs.data() ? qs.data() : static_cast<const float*>(q), block_req, runs, valid, k, v, k_row, k_head, v_row,
             v_head, n, hkv, G, D, Dv, B, unit, num_slots, k_scale * f, v_scale * f, cap, m, l, o, threads, rows,
             sinks, out, q_tokens, out_bf16 != 0, q_bf16_scale, draft_slots, draft_mask, nd, tokens};
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

// 1 when this build has the tile path and the OS lets this process use the tile registers (tile_blocks.h).
extern "C" int ca_tiles_available() { return tiles_permitted() ? 1 : 0; }
