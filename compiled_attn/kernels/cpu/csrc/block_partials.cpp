// Decode attention's per-block partial softmax over a paged KV cache, read in place, and each row's merge: the CPU
// kernel behind compiled_attn/kernels/cpu/kernel.py, which builds this file with the machine's compiler on first
// use, linked with the torch op that checks a call's tensors and calls ca_run (torch_op.cpp; kernel.py says why a
// hand-written kernel).
//
// One block is B key positions of one request. On the vector path (vector_blocks.h) all its query rows (Hkv heads x
// G rows) are scored against each key row as the row is read (a slot's heads lie together in the cache, so a page
// of consecutive slots is read front to back), then softmaxed, then V is summed with the weights; K/V are converted
// to float32 in registers (bf16, fp16, float8 e4m3fn / e5m2), so the cache is read once at its stored width. With
// a bf16 query and enough query rows the tile path (tile_blocks.h) computes the same block with AMX products.
// Invalid positions (past a request's end, a page's unwritten tail) are never read. A block's partials are those
// of decode.matmul_partials: per query row the max score m, the sum of exp(score - m) and the unnormalised weighted
// V sum; a block with no valid key gives the lowest float32, 0 and zeros. The kernel folds runs of a row's blocks
// together as it computes them and then merges each row's partials into its output.
//
// Portable C++ with GCC/Clang vector extensions (kernel_math.h), built with -march=native; half precision
// converts with F16C/AVX-512 instructions when the target has them.
#include "kernel_call.h"
#include "kernel_math.h"
#include "row_merge.h"
#include "tile_blocks.h"
#include "vector_blocks.h"
#include "wide_blocks.h"

#include <omp.h>


// The queries as the kernel reads them, [rows, hkv, G, D] float32, from q token-major [rows * tokens, hkv * G /
// tokens, D] (query row h * G + t * (G / tokens) + g of row r is token r * tokens + t's head h * G / tokens + g) in
// its stored format (L: F32, BF16, F16).
template <class L>
static void gather_queries(const typename L::T* q, int64_t tokens, int64_t rows, int64_t hkv, int64_t G, int64_t D,
                           float* qs, int threads) {
  const int64_t R = hkv * G;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < rows * R; ++i)
    row_to_float<L>(q + token_major_offset(i / R, i % R, tokens, hkv, G, D), D, 1.0f, qs + i * D);
}

// Whether this build runs pr.path for pr's shapes (the conditions compiled_attn/forms.py's kernel_path checks
// before it names a path; the kernel refuses any other, never falling back to another path silently).
template <class L, int DV>
static bool path_fits(const Problem& pr) {
  switch (pr.path) {
    case kVector: return true;
    case kVectorBf16:
#if defined(__AVX512BF16__)  // DV: a compiled-in head size (D 64, 128 or 256)
      return Bf16Exact<L>::ok && pr.q_bf16_scale > 0.0f && DV && DV % 2 == 0 && pr.G % 4 == 0;
#else
      return false;
#endif
    case kWide: return wide_fit(pr);
    case kTile: return tiles_fit<L>(pr);
    default: return false;
  }
}

constexpr int64_t kUnitsPerThread = 2;  // work units a thread at least, where heads can be split (run_blocks)

// Runs the used blocks, then merges each row's. Returns kOk; kSlotOutside (kDraftSlotOutside)
// when a valid position's (a seen draft key's) slot lay outside the cache (left out, nothing read there);
// kPathRefused when pr.path does not fit (nothing run).
template <class L, int DV>
static int run_blocks(const Problem& problem) {
  if (!path_fits<L, DV>(problem)) return kPathRefused;
  Problem pr = problem;
  const int64_t D = pr.D, G = pr.G, hkv = pr.hkv, B = pr.B, Dv = pr.Dv;
  const int64_t R = hkv * G, Bp = (B + 31) / 32 * 32;
  // each row's blocks in order (a counting sort of block_req), unused blocks dropped
  std::vector<int64_t> first(pr.rows + 2, 0), order(pr.n), token_rows(R);
  for (int64_t i = 0; i < R; ++i) token_rows[i] = token_major_offset(0, i, pr.out_tokens, hkv, G, 1);
  pr.token_rows = token_rows.data();
  for (int64_t b = 0; b < pr.n; ++b) first[std::min(pr.block_req[b], pr.rows) + 1]++;
  for (int64_t r = 0; r <= pr.rows; ++r) first[r + 1] += first[r];
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t b = 0; b < pr.n; ++b) order[fill[std::min(pr.block_req[b], pr.rows)]++] = b;
  }
  const int64_t used = first[pr.rows];  // order[0 .. used) is computed, the rest skipped
  // Work items: runs of up to `span` consecutive blocks of one row, folded together as they are computed, so that
  // one partial per item is written out and merged (storing every block's partials to memory took a fifth of an
  // instrumented single-thread run).
  // Item it covers order[item_start[it] ..][: item_count[it]]; a row's items are consecutive (row_items).
  std::vector<int64_t> item_start, item_count, row_items(pr.rows + 1, 0);
  const int64_t span = std::clamp<int64_t>(used / (4 * std::max(pr.threads, 1)), 1, 16);
  for (int64_t r = 0; r < pr.rows; ++r) {
    row_items[r] = (int64_t)item_start.size();
    for (int64_t j = first[r]; j < first[r + 1]; j += span) {
      item_start.push_back(j);
      item_count.push_back(std::min(span, first[r + 1] - j));
    }
  }
  row_items[pr.rows] = (int64_t)item_start.size();
  const int64_t items = (int64_t)item_start.size();
  // Work units: an item's blocks for a group of KV heads. Where a batch has few items (bs 1: a few blocks) whole
  // items left a thread idle for most of a block, and the rows' merges ran on one thread: each item is split into
  // hsplit groups of heads, the fewest that make kUnitsPerThread units a thread.
  int64_t hsplit = 1;
  while (hsplit < hkv && items * hsplit < kUnitsPerThread * pr.threads)
    for (++hsplit; hkv % hsplit; ++hsplit) {}
  const int64_t hn = hkv / hsplit, units = items * hsplit;
  Problem unit_pr = pr;  // a unit's problem: its heads, from its first (unit_heads)
  unit_pr.hkv = hn;
  typedef typename L::T T;
  auto unit_heads = [&](Problem& up, int64_t h0) {
    up.k = static_cast<const T*>(pr.k) + h0 * pr.k_head;
    up.v = static_cast<const T*>(pr.v) + h0 * pr.v_head;
  };
  // where an item leaves its partial: at its item number, in scratch of the call's own (one partial per item, not a
  // buffer for every block of the bucket)
  Scratch<float> part_m, part_l, part_o;
  part_m.resize(items * R), part_l.resize(items * R), part_o.resize(items * R * Dv);
  float* const pm = part_m.data();
  float* const pl = part_l.data();
  float* const po = part_o.data();
  // the items longest first (the threads take them in turn: a long one left for last kept the other thread waiting
  // at the merge)
  std::vector<int64_t> by_size(items);
  for (int64_t i = 0; i < (int64_t)by_size.size(); ++i) by_size[i] = i;
  std::stable_sort(by_size.begin(), by_size.end(), [&](int64_t a, int64_t b) { return item_count[a] > item_count[b]; });
  const bool tiles = pr.path == kTile, wide = pr.path == kWide;
  // bf16 queries not yet converted: the tile path packs them as they are, the other paths read float32
  Scratch<float> qs;
  if (!pr.qs && !tiles) {
    qs.resize(pr.rows * R * D);
    gather_queries<BF16>(pr.q_bf16, pr.out_tokens, pr.rows, hkv, G, D, qs.data(), pr.threads);
    pr.qs = qs.data();
  }
  // a bf16 query's scores by bf16 pair dot products where the vector path serves it
  const bool pairs = pr.path == kVectorBf16;
  // the tile path's queries, packed once per call for every row a block reads
  int64_t nrows = 0;
  for (int64_t j = 0; j < used && tiles; ++j) nrows = std::max(nrows, pr.block_req[order[j]] + 1);
  Scratch<uint16_t> qt;  // every row a block reads is packed before use
  qt.resize(tiles ? nrows * R * D : 0);
  std::atomic<int> outside{0};  // 1: a block's slot outside the caches, 2: a draft key's
  std::atomic<int64_t> next_unit{0};
  const bool draft = pr.draft_slots != nullptr;
  const int64_t Rn = hn * G;  // a unit's query rows
#pragma omp parallel num_threads(pr.threads)
  {
    const bool vector = !tiles && !wide;
    std::vector<float> s(vector ? Rn * Bp : 0), qv(vector && !pairs ? Rn * D : 0), bm(Rn), bl(Rn),
        bo(vector ? Rn * Dv : 0);
    std::vector<uint16_t> qb(pairs ? Rn * D : 0);
    // the current block's slots and validity, and the next one's (the tile path prefetches its keys)
    std::vector<int64_t> slots(2 * B);
    std::vector<uint8_t> keeps(2 * B);
    auto fill = [&](int64_t b, int64_t* slot, uint8_t* keep) {
      for (int64_t p = 0; p < B; ++p) {
        const int64_t s = pr.slots[b * B + p];
        slot[p] = s >= 0 && s < pr.num_slots ? s : -1;
        keep[p] = pr.valid[b * B + p];
        if (keep[p] && slot[p] < 0) {
          keep[p] = 0;
          slot[p] = 0;
          outside.fetch_or(1, std::memory_order_relaxed);
        }
      }
    };
    // a row's draft partial and merge, for the heads [h0, h0 + hn): a row whose blocks are one item is merged as
    // the item ends, from the partial the item left in this thread's own buffer (one_m, one_l, one_o: reused item
    // after item, so in cache; in the call's partials, memory not touched before, each line had been read in
    // before its write and written back after), the others after every item is done
    std::vector<float> acc(Dv), weights;
    Scratch<float> one_m, one_l, one_o, dm, dl, dout;  // (draft_partial writes what the merge reads)
    one_m.resize(R), one_l.resize(R), one_o.resize(R * Dv);
    if (draft) dm.resize(R), dl.resize(R), dout.resize(R * Dv);
    DraftScratch ds;
    if (draft) ds.start(pr);
    auto one_item = [&](int64_t r) { return row_items[r + 1] - row_items[r] == 1; };
    auto finish_row = [&](int64_t r, int64_t h0) {
      if (draft && !draft_partial<L>(pr, r, h0, h0 + hn, ds, dm.data(), dl.data(), dout.data()))
        outside.fetch_or(2, std::memory_order_relaxed);
      const bool own = one_item(r);
      merge_row(pr, r, h0 * G, (h0 + hn) * G, own ? 0 : row_items[r], own ? 1 : row_items[r + 1],
                own ? one_m.data() : pm, own ? one_l.data() : pl, own ? one_o.data() : po,
                draft ? dm.data() : nullptr, dl.data(), dout.data(), weights, acc.data());
    };
    TileScratch ts;
    if (tiles) {
      ts.start(unit_pr, Bp);
#pragma omp for schedule(static)
      for (int64_t rh = 0; rh < nrows * hkv; ++rh) pack_queries(pr, rh / hkv, rh % hkv, qt.data());
    }
    WideScratch ws;
    if (wide) ws.start(unit_pr, Bp, hkv);
    // Units taken in turn from a shared counter, each thread's first by its number (with that one claimed from the
    // counter too, a thread starting a moment late found the first units gone), each next one claimed as a thread
    // starts its current one's last block: that block's slots then name the next unit's first keys, which the tile
    // path streams in while it computes (as it does for the next block within an item).
    // Where the heads are split in a multiple of the threads' count, thread t instead takes the head groups t, t +
    // threads, .. of every item in turn, and merges those groups' rows: the partials it merges are in its own
    // core's cache (not half of them in the other's), and the threads' work is equal.
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
    const bool by_heads = hsplit > 1 && hsplit % team == 0;
#pragma omp single
    next_unit.store(team, std::memory_order_relaxed);
    auto unit_blocks = [&](int64_t u, int64_t& it, int64_t& h0, int64_t& j0, int64_t& j1) {
      it = by_size[u / hsplit];
      h0 = u % hsplit * hn;
      j0 = item_start[it], j1 = j0 + item_count[it];
    };
    Problem up = unit_pr;
    int cur = 0;
    bool streamed = false;  // whether the current block's keys were streamed in by the block before it (and its
                            // slots filled then)
    int64_t u = tid;
    auto claim_next = [&](int64_t cu) {  // the unit after cu for this thread
      if (!by_heads) return next_unit.fetch_add(1, std::memory_order_relaxed);
      return cu % hsplit + team < hsplit ? cu + team : (cu / hsplit + 1) * hsplit + tid;
    };
    while (u < units) {
      int64_t it, h0, j0, j1, next_u = units;
      unit_blocks(u, it, h0, j0, j1);
      unit_heads(up, h0);
      const int64_t b0 = order[j0];
      if (!streamed) fill(b0, slots.data() + cur * B, keeps.data() + cur * B);
      const bool own = one_item(pr.block_req[b0]);  // the item's partial: in this thread's buffer, else at it
      float *m_at = (own ? one_m.data() : pm + it * R) + h0 * G, *l_at = (own ? one_l.data() : pl + it * R) + h0 * G;
      float* o_at = (own ? one_o.data() : po + it * R * Dv) + h0 * G * Dv;
      for (int64_t j = j0; j < j1; ++j, cur ^= 1) {
        const int64_t b = order[j];
        int64_t* slot = slots.data() + cur * B;
        uint8_t* keep = keeps.data() + cur * B;
        int64_t next_b = -1;
        const void* next_k = up.k;
        if (j + 1 < j1) {
          next_b = order[j + 1];
        } else {
          next_u = claim_next(u);
          if (next_u < units) {
            int64_t nit, nh0, nj0, nj1;
            unit_blocks(next_u, nit, nh0, nj0, nj1);
            next_b = order[nj0];
            next_k = static_cast<const T*>(pr.k) + nh0 * pr.k_head;
          }
        }
        int64_t* next_slot = next_b >= 0 ? slots.data() + (cur ^ 1) * B : nullptr;
        uint8_t* next_keep = keeps.data() + (cur ^ 1) * B;
        if (next_slot) fill(next_b, next_slot, next_keep);
        const bool k_streamed = streamed;
        streamed = next_slot != nullptr;
        if (tiles) {  // folds the item's blocks itself, and writes the item's partial at its last block
          tile_block<L>(up, qt.data() + pr.block_req[b] * R * D + h0 * G * D, slot, keep, Bp, ts, m_at, l_at, o_at,
                        next_slot, next_keep, next_k, j == j0, j + 1 == j1, k_streamed);
          continue;
        }
        if (wide) {  // likewise
          if (ws.q_row != pr.block_req[b]) pack_wide_queries(pr, pr.block_req[b], ws);
          wide_block<L>(up, ws.qt.data() + h0 * G * D, slot, keep, Bp, ws, m_at, l_at, o_at, j == j0, j + 1 == j1);
          continue;
        }
        // the item's first block writes its partial in place, the others beside it and are folded in
        float* mo = j == j0 ? m_at : bm.data();
        float* lo = j == j0 ? l_at : bl.data();
        float* oo = j == j0 ? o_at : bo.data();
        const float* q = pr.qs + pr.block_req[b] * R * D + h0 * G * D;
#if defined(__AVX512BF16__)
        if (pairs) {
          to_bf16_rows(q, 1.0f / pr.q_bf16_scale, Rn * D, qb.data());
          vector_scores<L, DV ? DV : 2, true>(up, slot, keep, qb.data(), s.data(), Bp);
        }
#endif
        if (!pairs) {
          // K's scale applied to the queries (AVX2: in the order its scores read a key row in, key16_order)
#if defined(__AVX512F__)
          for (int64_t i = 0; i < Rn * D; ++i) qv[i] = q[i] * pr.k_mul;
#else
          for (int64_t i = 0; i < Rn * D; i += 16)
            for (int64_t j = 0; j < 16; ++j) qv[i + key16_order<L>(j)] = q[i + j] * pr.k_mul;
#endif
          vector_scores<L, DV, false>(up, slot, keep, qv.data(), s.data(), Bp);
        }
        softmax_rows(s.data(), keep, B, Bp, Rn, pr.cap, mo, lo);
        vector_weighted_v<L>(up, slot, keep, s.data(), Bp, oo, next_slot, next_keep, next_k);
        if (j != j0) fold_partials(Rn, Dv, m_at, l_at, o_at, mo, lo, oo);
      }
      if (own) finish_row(pr.block_req[b0], h0);
      u = next_u;
    }
    if (tiles) ts.finish();
#pragma omp barrier
    if (by_heads) {
      for (int64_t r = 0; r < pr.rows; ++r)
        for (int64_t hg = tid; hg < hsplit && !one_item(r); hg += team) finish_row(r, hg * hn);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t rh = 0; rh < pr.rows * hsplit; ++rh)
        if (!one_item(rh / hsplit)) finish_row(rh / hsplit, rh % hsplit * hn);
    }
  }
  const int bad = outside.load();
  return bad & 1 ? kSlotOutside : bad & 2 ? kDraftSlotOutside : kOk;
}

template <class L>
static int run_head_size(const Problem& pr) {
  if (pr.D == 128) return run_blocks<L, 8>(pr);
  if (pr.D == 64) return run_blocks<L, 4>(pr);
  if (pr.D == 256) return run_blocks<L, 16>(pr);
  return run_blocks<L, 0>(pr);
}

// One call (KernelCall: kernel_call.h, whose KernelRc names what this returns). The op (torch_op.cpp) checks every
// shape and dtype before it calls; the indices the tables hold are checked here, in the pass that reads them.
extern "C" int ca_run(const KernelCall* call) {
  const KernelCall& c = *call;
  if (c.D % 16 || c.Dv % 16) return kBadHeadSize;
  // every block's row is a row of q, or rows and past it (a bucket's unused blocks, skipped): checked here, where a
  // negative one would index q or the counting sort's counts outside their memory
  for (int64_t b = 0; b < c.n; ++b)
    if (c.block_req[b] < 0) return kBadBlockRow;
  if (c.q_kind < 0 || c.q_kind > 2 || c.q_tokens < 1 || c.G % c.q_tokens || c.out == nullptr) return kBadKind;
  // bf16 queries taken as they are (run_blocks converts them where the path needs float32)
  const bool bf16_as_is = c.q_kind == 1 && c.q_bf16_scale == 1.0f;
  const int64_t rows = c.rows, hkv = c.hkv, G = c.G, D = c.D;
  Scratch<float> qs;  // the queries converted and grouped, unless q is that already
  if ((c.q_kind || c.q_tokens > 1) && !bf16_as_is) {
    qs.resize(rows * hkv * G * D);
    if (c.q_kind == 0)
      gather_queries<F32>(static_cast<const float*>(c.q), c.q_tokens, rows, hkv, G, D, qs.data(), c.threads);
    if (c.q_kind == 1)
      gather_queries<BF16>(static_cast<const uint16_t*>(c.q), c.q_tokens, rows, hkv, G, D, qs.data(), c.threads);
    if (c.q_kind == 2)
      gather_queries<F16>(static_cast<const uint16_t*>(c.q), c.q_tokens, rows, hkv, G, D, qs.data(), c.threads);
  }
  const float f = c.kind == 3 ? 256.0f : 1.0f;
  const float* q32 = bf16_as_is ? nullptr : qs.data() ? qs.data() : static_cast<const float*>(c.q);
  Problem pr{q32, c.block_req, c.slots, c.valid, c.k, c.v, c.k_row, c.k_head, c.v_row, c.v_head, c.n, hkv, G, D, c.Dv,
             c.B, c.num_slots, c.k_scale * f, c.v_scale * f, c.cap, c.threads, rows, c.sinks,
             c.out, c.q_tokens, c.out_bf16 != 0, c.q_bf16_scale, c.draft_slots, c.draft_mask, c.nd, c.tokens,
             bf16_as_is ? static_cast<const uint16_t*>(c.q) : nullptr};
  pr.path = c.path;
  switch (c.kind) {
    case 0: return run_head_size<F32>(pr);
    case 1: return run_head_size<BF16>(pr);
    case 2: return run_head_size<F16>(pr);
    case 3: return run_head_size<E4M3>(pr);
    case 4: return run_head_size<E5M2>(pr);
    default: return kBadKind;
  }
}

// What this build runs, as bits: 1 AVX2 (with FMA and F16C), 2 AVX-512 (F, BW, VL), 4 AVX512-BF16 (the vector
// path's bf16 pair products), 8 AMX bf16 tiles compiled in, 16 the tile path usable here (compiled in and the OS
// lets this process use the tile registers: tile_blocks.h).
extern "C" int ca_isa() {
  int bits = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  bits |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  bits |= 2;
#endif
#if defined(__AVX512BF16__)
  bits |= 4;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  bits |= 8;
#endif
  if (tiles_permitted()) bits |= 16;
  return bits;
}
