// The decode kernel as a torch op: <namespace>::decode_blocks (each row's blocks and their merge in one call),
// registered by ca_register_ops under a namespace of the build's own (compiled_attn/kernels/cpu/build.py), so that
// builds for several instruction-set levels live in one process. The op checks every tensor's dtype, device and
// shape against the others before the kernel reads them, and the kernel checks the indices the tables hold as it
// reads them (ca_run); a violation is a ValueError naming the argument and its limit.
//
// Why an op and not ctypes: this op's call, its checks included, takes about 6 us, and the Python op in front of it
// about 9 more, where ctypes' 39 arguments with the checks in Python took 35 (compiled_attn/kernels/cpu/kernel.py).
// Built without -march, once for every level: the kernel's translation unit (block_partials.cpp) is the one built
// per level, and linked with this one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "kernel_call.h"

namespace {

const char* const kPaths[] = {"vector", "vector_bf16", "wide", "tile"};

// the dtypes as Python names them, in the kernel's kind order (cache kinds; the query kinds are the first three)
const at::ScalarType kKinds[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kFloat8_e5m2};
const char* const kKindNames[] = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"};

int kind_of(const at::Tensor& t, int kinds) {
  for (int i = 0; i < kinds; ++i)
    if (t.scalar_type() == kKinds[i]) return i;
  return -1;
}

std::string name_of(at::ScalarType t) {
  for (int i = 0; i < 5; ++i)
    if (t == kKinds[i]) return kKindNames[i];
  if (t == at::kLong) return "int64";
  if (t == at::kInt) return "int32";
  if (t == at::kBool) return "bool";
  if (t == at::kDouble) return "float64";
  return c10::toString(t);
}

// "float32 (2, 8, 64)": a tensor as the messages name it (Python's shape tuple)
std::string described(const at::Tensor& t) {
  std::ostringstream s;
  s << name_of(t.scalar_type()) << " (";
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i) << (t.dim() == 1 ? "," : "");
  s << ")";
  return s.str();
}

void check_cpu(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

// Hkv, from k_cache [num_slots, Hkv, D] (checked whole by check_caches, once the queries name D).
int64_t cache_heads(const at::Tensor& k) {
  TORCH_CHECK_VALUE(k.dim() == 3 && k.size(1) > 0, "k_cache must be [num_slots, Hkv, D], got ", described(k));
  return k.size(1);
}

// The caches: k_cache [num_slots, Hkv, D], v_cache [num_slots', Hkv, Dv] of one kind, each row's last dim contiguous,
// head sizes multiples of 16 (D: the queries'). Fills the call's cache fields.
void check_caches(const at::Tensor& k, const at::Tensor& v, int64_t d, KernelCall& c) {
  check_cpu("k_cache", k);
  check_cpu("v_cache", v);
  c.kind = kind_of(k, 5);
  TORCH_CHECK_VALUE(k.dim() == 3 && c.kind >= 0 && k.size(2) == d && d % 16 == 0 && k.stride(2) == 1,
                    "k_cache must be [num_slots, Hkv, D=", d, "] in one of float32, bfloat16, float16, "
                    "float8_e4m3fn, float8_e5m2, D a multiple of 16, its last dim contiguous; got ", described(k));
  TORCH_CHECK_VALUE(v.dim() == 3 && v.scalar_type() == k.scalar_type() && v.size(1) == k.size(1) &&
                        v.size(2) % 16 == 0 && v.stride(2) == 1,
                    "v_cache must be [num_slots, Hkv=", k.size(1), ", Dv] in k_cache's ", name_of(k.scalar_type()),
                    ", Dv a multiple of 16, its last dim contiguous; got ", described(v));
  c.k = k.data_ptr(), c.v = v.data_ptr();
  c.k_row = k.stride(0), c.k_head = k.stride(1), c.v_row = v.stride(0), c.v_head = v.stride(1);
  c.num_slots = std::min(k.size(0), v.size(0));
  c.hkv = k.size(1), c.D = d, c.Dv = v.size(2);
}

// The block table (DecodeIndex's): block_req [n] int64, slots [n, B] int64, valid [n, B] bool, made contiguous in
// `keep`. Fills the call's table fields.
void check_blocks(const at::Tensor& block_req, const at::Tensor& slots, const at::Tensor& valid, KernelCall& c,
                  at::Tensor keep[3]) {
  check_cpu("block_req", block_req);
  check_cpu("slots", slots);
  check_cpu("valid", valid);
  const int64_t n = block_req.dim() == 1 ? block_req.size(0) : -1;
  TORCH_CHECK_VALUE(block_req.scalar_type() == at::kLong && n >= 0, "block_req must be int64 [n], got ",
                    described(block_req));
  TORCH_CHECK_VALUE(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == n,
                    "valid must be bool [n=", n, ", B], got ", described(valid));
  const int64_t b = valid.size(1);
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == n && slots.size(1) == b,
                    "slots must be int64 [n=", n, ", B=", b, "], got ", described(slots));
  keep[0] = block_req.contiguous(), keep[1] = slots.contiguous(), keep[2] = valid.contiguous();
  c.block_req = keep[0].data_ptr<int64_t>(), c.slots = keep[1].data_ptr<int64_t>();
  c.valid = static_cast<const uint8_t*>(keep[2].data_ptr());
  c.n = n, c.B = b;
}

int64_t path_number(int64_t path) {
  TORCH_CHECK_VALUE(path >= 0 && path < 4, "path must be a KernelPath number in [0, 4), got ", path);
  return path;
}

// Runs the call; a return code other than kOk is a ValueError naming the argument at fault.
void run(const KernelCall& c, const at::Tensor& k_cache) {
  const int rc = ca_run(&c);
  if (rc == kOk) return;
  TORCH_CHECK_VALUE(rc != kSlotOutside, "native decode kernel: slots names a KV slot outside the cache at a valid "
                    "position (num_slots ", c.num_slots, "): check req_to_token and the planned block table");
  TORCH_CHECK_VALUE(rc != kDraftSlotOutside, "native decode kernel: draft_slots names a KV slot outside the cache "
                    "that a draft token sees (num_slots ", c.num_slots, "): check the draft keys' slots");
  TORCH_CHECK_VALUE(rc != kBadBlockRow, "native decode kernel: block_req holds a row outside [0, ", c.rows,
                    ") (q's rows, or past them for an unused block): check the block table");
  TORCH_CHECK_VALUE(rc != kPathRefused, "native decode kernel: path '", kPaths[c.path], "' does not serve this call ",
                    "(cache ", name_of(k_cache.scalar_type()), ", ", c.G, " query rows per KV head, head sizes ", c.D,
                    "/", c.Dv, ", q_bf16_scale ", c.q_bf16_scale, ") in this build (ISA bits ", ca_isa(),
                    "): see kernel_path");
  TORCH_CHECK_VALUE(false, "native decode kernel: head sizes ", c.D, "/", c.Dv, " must be multiples of 16, the cache ",
                    "a dtype of ", "float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 and the query one of ",
                    "float32, bfloat16, float16 (return code ", rc, ")");
}

// The op (kernel.py's native_decode_blocks' arguments, the path by its number): q [num_rows * tokens, Hq, D]
// -> [num_rows * tokens, Hq, Dv] in q's dtype.
at::Tensor decode_blocks(const at::Tensor& q, const at::Tensor& block_req, const at::Tensor& slots,
                         const at::Tensor& valid, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         double k_scale, double v_scale, double logit_cap, int64_t num_rows,
                         const std::optional<at::Tensor>& sinks, double q_bf16_scale,
                         const std::optional<at::Tensor>& draft_slots, const std::optional<at::Tensor>& draft_mask,
                         int64_t tokens, int64_t path) {
  KernelCall c{};
  check_cpu("q", q);
  TORCH_CHECK_VALUE(num_rows >= 0 && tokens >= 1, "num_rows must be >= 0 and tokens >= 1, got ", num_rows, " and ",
                    tokens);
  const int64_t hkv = cache_heads(k_cache);
  c.q_kind = kind_of(q, 3);
  TORCH_CHECK_VALUE(c.q_kind >= 0 && q.dim() == 3 && q.size(0) == num_rows * tokens && q.size(1) > 0 &&
                        q.size(1) % hkv == 0,
                    "q must be [num_rows * tokens = ", num_rows * tokens, ", Hq (a multiple of Hkv=", hkv,
                    "), D] in one of float32, bfloat16, float16, got ", described(q));
  check_caches(k_cache, v_cache, q.size(2), c);
  at::Tensor keep[6];
  check_blocks(block_req, slots, valid, c, keep);
  c.G = tokens * (q.size(1) / hkv);
  if (sinks) {
    check_cpu("sinks", *sinks);
    TORCH_CHECK_VALUE(sinks->numel() == hkv * c.G, "sinks must hold Hkv x G = ", hkv * c.G, " logits, got ",
                      described(*sinks));
    keep[3] = sinks->to(at::kFloat).contiguous();
    c.sinks = keep[3].data_ptr<float>();
  }
  TORCH_CHECK_VALUE(draft_slots.has_value() == draft_mask.has_value(), "draft_slots and draft_mask go together");
  if (draft_slots) {
    const at::Tensor &ds = *draft_slots, &dm = *draft_mask;
    check_cpu("draft_slots", ds);
    check_cpu("draft_mask", dm);
    TORCH_CHECK_VALUE(ds.scalar_type() == at::kLong && ds.dim() == 2 && ds.size(0) >= num_rows,
                      "draft_slots must be int64 [>= num_rows=", num_rows, ", nd], got ", described(ds));
    c.nd = ds.size(1);
    TORCH_CHECK_VALUE(dm.dim() == 3 && dm.size(0) >= num_rows && dm.size(2) == c.nd && dm.size(1) >= 1 &&
                          c.G % dm.size(1) == 0,
                      "draft_mask must be [>= num_rows=", num_rows, ", tokens dividing G=", c.G, ", nd=", c.nd,
                      "], got ", described(dm));
    keep[4] = ds.contiguous(), keep[5] = dm.to(at::kBool).contiguous();
    c.draft_slots = keep[4].data_ptr<int64_t>(), c.draft_mask = static_cast<const uint8_t*>(keep[5].data_ptr());
    c.tokens = dm.size(1);
  }
  c.path = path_number(path);
  // the kernel writes float32 or bfloat16 (rounded as torch rounds); a float16 result is cast from float32
  const auto out_dtype = c.q_kind == 1 ? at::kBFloat16 : at::kFloat;
  at::Tensor out = at::empty({q.size(0), q.size(1), c.Dv}, q.options().dtype(out_dtype));
  if (c.n == 0 && !draft_slots) return out.zero_().to(q.scalar_type());  // nothing to merge: the kernel is not called
  const at::Tensor qc = q.contiguous();
  c.q = qc.data_ptr(), c.q_tokens = tokens, c.rows = num_rows;
  c.k_scale = (float)k_scale, c.v_scale = (float)v_scale, c.cap = (float)logit_cap;
  c.q_bf16_scale = (float)q_bf16_scale, c.threads = at::get_num_threads();
  c.out = out.data_ptr(), c.out_bf16 = c.q_kind == 1;
  run(c, k_cache);
  return out.to(q.scalar_type());
}

std::string last_error;

}  // namespace

// Defines the op under namespace ns (once per loaded library: a second call finds it there). Returns 0, or 1 with
// the reason in ca_register_error (a namespace another library took, say).
extern "C" int ca_register_ops(const char* ns) {
  // the registrations live as long as the process: never freed (a library is never unloaded, and at exit there is
  // nothing to take back from a dispatcher on its way out)
  static torch::Library* defs = nullptr;
  if (defs) return 0;
  try {
    auto d = std::make_unique<torch::Library>(torch::Library::DEF, ns, std::nullopt, __FILE__, __LINE__);
    d->def("decode_blocks(Tensor q, Tensor block_req, Tensor slots, Tensor valid, Tensor k_cache, "
           "Tensor v_cache, float k_scale, float v_scale, float logit_cap, int num_rows, Tensor? sinks, "
           "float q_bf16_scale, Tensor? draft_slots, Tensor? draft_mask, int tokens, int path) -> Tensor");
    auto i = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__);
    i->impl("decode_blocks", &decode_blocks);
    i.release();
    defs = d.release();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

extern "C" const char* ca_register_error() { return last_error.c_str(); }
