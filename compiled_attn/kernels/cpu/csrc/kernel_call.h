// One call of the decode kernel as a struct: what the op (torch_op.cpp) fills from tensors it has checked and the
// kernel (block_partials.cpp, ca_run) takes. Plain C++, no vector types: the op's translation unit is built once
// for any CPU and linked with the kernel's, which is built for an instruction-set level.
#pragma once
#include <cstdint>

struct KernelCall {
  int kind;    // the caches' dtype: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn, 4 float8_e5m2
  int q_kind;  // the queries' dtype: 0 float32, 1 bfloat16, 2 float16
  // the queries (a score is q . K times k_scale), token-major [rows * q_tokens, hkv * G / q_tokens, D]
  // (gather_queries)
  const void* q;
  int64_t q_tokens;
  const int64_t* block_req;  // [n] the query row of each block
  const int64_t* slots;      // [n, B] the KV slot of each block position
  const uint8_t* valid;      // [n, B]
  const void* k;             // K element (slot, head, d) at slot * k_row + head * k_head + d; V likewise
  const void* v;
  int64_t k_row, k_head, v_row, v_head;
  int64_t num_slots;  // rows of both caches: a slot outside them is refused, never read
  int64_t n, hkv, G, D, Dv, B;
  float k_scale, v_scale, cap;
  float q_bf16_scale;  // > 0: q is a bfloat16 query times this scale (the tile path may take it), else 0
  int threads;
  // rows of the batch (blocks of a row at or past it are skipped), sinks [hkv * G] or null, out token-major as q,
  // bfloat16 where out_bf16 else float32; verify's draft keys: draft_slots [>= rows, nd], draft_mask [>= rows,
  // tokens, nd]
  int64_t rows;
  const float* sinks;
  void* out;
  int out_bf16;
  const int64_t* draft_slots;
  const uint8_t* draft_mask;
  int64_t nd, tokens;
  int path;  // the KernelPath to run
};

// What ca_run returns: 0, or why nothing (or not all) was computed. The op checks shapes before it calls, so of
// these only the index checks made during the kernel's pass (3, 5, 6) and a path this build lacks (4) reach it.
enum KernelRc : int {
  kOk = 0,
  kBadHeadSize = 1,       // a head size not a multiple of 16
  kBadKind = 2,           // an unknown cache or query dtype, a query layout it does not take, or no out
  kSlotOutside = 3,       // a valid position's slot lies outside the caches (left out, never read)
  kPathRefused = 4,       // this build cannot run path for these shapes (nothing run)
  kBadBlockRow = 5,       // a block's row is negative (nothing run)
  kDraftSlotOutside = 6,  // a draft key some token sees has its slot outside the caches (left out, never read)
};

extern "C" int ca_run(const KernelCall* call);
extern "C" int ca_isa();
