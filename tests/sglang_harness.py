"""Drive SGLang 0.5.23's own ``TorchNativeAttnBackend`` on CPU, without a model.

A helper module for tests (not a test file). It builds what SGLang's attention path needs
(a model-runner stand-in, ``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool``,
``RadixAttention`` layers, hand-made ``ForwardBatch``es) and runs one layer the way
``ModelRunner`` does, so the same data can be fed to SGLang and to our own functions.

Import order matters on a CPU-only machine: import this module (it applies the fix-up
below) or call :func:`ensure_sglang_importable` before anything imports ``sglang``,
``torchvision`` or ``transformers``' image utilities. SGLang imports ``torchvision`` at module level
(``sglang.srt.configs`` -> ``multimodal/internvl_utils``), and PyPI's torchvision wheel
carries CUDA-linked C++ ops that cannot load beside the CPU build of torch; its Python
then dies on ``register_fake("torchvision::nms")``. We declare the two op schemas it
registers fakes for, which is all its pure-Python part needs. On a machine where the ops
do load (CUDA torch + matching torchvision) nothing is declared.

Layout conventions, as in SGLang:
  * ``req_to_token``: ``[max_num_reqs + 1, max_context_len]`` int32; row 0 is the padding row.
  * KV pool rows: ``size + page_size`` (page_size 1 here); slot 0 is the padding slot.
  * q: ``[num_tokens, num_heads * head_dim]``; k: ``[num_tokens, num_kv_heads * head_dim]``;
    v: ``[num_tokens, num_kv_heads * v_head_dim]`` (flattened, as models pass them;
    ``RadixAttention.forward`` views k/v as 3-D, the backend views q).
  * output: ``[num_tokens, num_heads * v_head_dim]``.
  * MLA absorbed (``MLATokenToKVPool``): one KV "head" of ``kv_lora_rank + qk_rope_head_dim``
    (576); the pool stores only k, and the value buffer is ``k[..., :kv_lora_rank]``, so v
    must equal ``k[..., :kv_lora_rank]`` (the builders make it so).
  * sliding window ``W`` (``RadixAttention.sliding_window_size``): a query at position i sees
    keys at positions ``i - W .. i`` (W + 1 keys; SGLang passes HF's ``sliding_window - 1``).
    ``-1``, None and also ``0`` mean no window (``RadixAttention`` stores
    ``sliding_window_size or -1``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

SGLANG_VERSION = "0.5.23"

# Keeps the op declarations alive: a torch.library.Library drops its definitions when
# it is garbage-collected.
_TORCHVISION_OPS_LIB = None


def ensure_torchvision_importable() -> bool:
    """Make ``import torchvision`` work beside a CPU torch when its C++ ops can't load.

    Returns True if it had to declare the op schemas. Does nothing (returns False) when
    torchvision is absent, already imported, or its ``_C`` extension loads.
    """
    global _TORCHVISION_OPS_LIB
    if _TORCHVISION_OPS_LIB is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = []
    for loc in spec.submodule_search_locations:
        libs += glob.glob(os.path.join(loc, "_C.so")) + glob.glob(os.path.join(loc, "_C.*.so"))
    if libs:
        try:
            # What torchvision.extension does itself; loading twice is harmless.
            torch.ops.load_library(libs[0])
            return False
        except (OSError, ImportError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        try:
            lib.define(schema)
        except RuntimeError:  # already declared by someone else
            pass
    _TORCHVISION_OPS_LIB = lib
    return True


# Importing this module is enough: the fix-up runs here, before a test imports sglang.
ensure_torchvision_importable()


def ensure_sglang_importable() -> None:
    """Everything that must happen before the first ``import sglang`` on a CPU machine.

    Besides the torchvision fix-up: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's switch for its
    CPU server) makes SGLang import ``sgl_kernel`` (its CPU kernel build, not on PyPI) at
    module level; without that package the harness runs SGLang's generic path instead, so
    the variable is dropped here, before SGLang reads it at import.
    """
    ensure_torchvision_importable()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "sglang" not in sys.modules:
        if importlib.util.find_spec("sgl_kernel") is None:
            import warnings

            warnings.warn("sglang_harness: SGLANG_USE_CPU_ENGINE=1 needs sgl_kernel, which is "
                          "not installed; unsetting it for this process")
            del os.environ["SGLANG_USE_CPU_ENGINE"]


def sglang_available() -> bool:
    """True if ``sglang`` imports here (after the torchvision fix-up)."""
    ensure_sglang_importable()
    try:
        import_sglang()
    except ImportError:
        return False
    return True


def import_sglang() -> SimpleNamespace:
    """Import the SGLang classes the harness uses; raises ImportError if SGLang is absent."""
    ensure_sglang_importable()
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    return SimpleNamespace(
        AttentionBackend=AttentionBackend,
        TorchNativeAttnBackend=TorchNativeAttnBackend,
        AttentionType=AttentionType,
        RadixAttention=RadixAttention,
        ReqToTokenPool=ReqToTokenPool,
        MHATokenToKVPool=MHATokenToKVPool,
        MLATokenToKVPool=MLATokenToKVPool,
        ForwardBatch=ForwardBatch,
        ForwardMode=ForwardMode,
        ForwardContext=ForwardContext,
        forward_context=forward_context,
    )


# Parallel-topology names SGLang reads on the attention path (MLATokenToKVPool.set_kv_buffer
# asserts on ``dcp_enabled``; ``set_mla_kv_buffer`` reads ``attn_dcp_size``). Outside a
# server nothing publishes them and reading raises, so the harness states single-rank values
# for the names that are unset, scoped to each call.
PARALLEL_DEFAULTS = dict(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0,
                         attn_tp_size=1, attn_tp_rank=0)


def parallel_scope():
    """Context manager: single-rank values for the unset parallel names, else a no-op."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    missing = {}
    for name, value in PARALLEL_DEFAULTS.items():
        try:
            getattr(parallel, name)
        except (RuntimeError, ValueError):
            missing[name] = value
    return parallel.override(**missing) if missing else nullcontext()


# --------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnGeometry:
    """Per-layer attention shape, as one tensor-parallel rank sees it."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim (576 for absorbed MLA)
    v_head_dim: int
    scaling: Optional[float] = None  # None: head_dim ** -0.5
    mla: bool = False  # absorbed MLA on MLATokenToKVPool
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0
        if self.mla:
            assert self.num_kv_heads == 1
            assert self.head_dim == self.kv_lora_rank + self.qk_rope_head_dim
            assert self.v_head_dim == self.kv_lora_rank

    @property
    def sm_scale(self) -> float:
        return self.scaling if self.scaling is not None else self.head_dim**-0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def mha(num_heads=4, head_dim=64, name="mha") -> AttnGeometry:
    return AttnGeometry(name, num_heads, num_heads, head_dim, head_dim)


def gqa(num_heads=8, num_kv_heads=2, head_dim=64, name="gqa") -> AttnGeometry:
    return AttnGeometry(name, num_heads, num_kv_heads, head_dim, head_dim)


def mla_normal(num_heads=4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128) -> AttnGeometry:
    """DeepSeek MLA run as plain MHA (prefill "normal" path): q/k 192, v 128, on MHATokenToKVPool."""
    d = qk_nope_head_dim + qk_rope_head_dim
    return AttnGeometry(
        "mla_normal", num_heads, num_heads, d, v_head_dim, scaling=d**-0.5,
        qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
    )


def mla_absorbed(num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128) -> AttnGeometry:
    """DeepSeek MLA, weight-absorbed: one latent KV head 576 / 512 on MLATokenToKVPool.

    The softmax scale is the model's, ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``
    (DeepSeek-V2/V3: 192 ** -0.5, before any YaRN mscale), not 576 ** -0.5.
    """
    return AttnGeometry(
        "mla_absorbed", num_heads, 1, kv_lora_rank + qk_rope_head_dim, kv_lora_rank,
        scaling=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, mla=True,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
    )


GEOMETRIES: Dict[str, AttnGeometry] = {
    "mha": mha(),
    "gqa": gqa(),
    "mla_normal": mla_normal(),
    "mla_absorbed": mla_absorbed(),
}


# --------------------------------------------------------------------------------------
# Model-runner stand-in
# --------------------------------------------------------------------------------------


class SlotAllocator:
    """Hands out KV slots (and request rows) in a scattered, shuffled order; 0 is never given."""

    def __init__(self, n: int, generator: torch.Generator):
        self.free: List[int] = (torch.randperm(n - 1, generator=generator) + 1).tolist()

    def alloc(self, count: int) -> List[int]:
        if count > len(self.free):
            raise RuntimeError(f"out of slots: want {count}, have {len(self.free)}")
        out, self.free = self.free[:count], self.free[count:]
        return out


def make_model_runner(
    geom: AttnGeometry,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    max_num_reqs: int = 16,
    max_context_len: int = 256,
    pool_size: int = 2048,
    device: str = "cpu",
    sliding_window_size: Optional[int] = None,
    seed: int = 0,
) -> SimpleNamespace:
    """A ``ModelRunner`` stand-in with the pools and the attributes attention backends read.

    ``TorchNativeAttnBackend.__init__`` reads only ``device``, ``req_to_token_pool`` and
    ``token_to_kv_pool``; the rest mirrors what other 0.5.23 backends read (triton,
    flex, intel_amx, flashinfer_mla) so a backend of ours can use the same object.
    Also carries ``req_allocator`` / ``slot_allocator`` (harness bookkeeping, not SGLang's).
    """
    sg = import_sglang()
    gen = torch.Generator().manual_seed(seed)
    req_to_token_pool = sg.ReqToTokenPool(
        size=max_num_reqs, max_context_len=max_context_len, device=device, enable_memory_saver=False
    )
    if geom.mla:
        token_to_kv_pool = sg.MLATokenToKVPool(
            size=pool_size, page_size=1, dtype=dtype, kv_lora_rank=geom.kv_lora_rank,
            qk_rope_head_dim=geom.qk_rope_head_dim, layer_num=num_layers, device=device,
            enable_memory_saver=False,
        )
    else:
        token_to_kv_pool = sg.MHATokenToKVPool(
            size=pool_size, page_size=1, dtype=dtype, head_num=geom.num_kv_heads,
            head_dim=geom.head_dim, layer_num=num_layers, device=device,
            enable_memory_saver=False, v_head_dim=geom.v_head_dim,
        )
    model_config = SimpleNamespace(
        num_attention_heads=geom.num_heads,
        num_key_value_heads=geom.num_kv_heads,
        head_dim=geom.head_dim,
        v_head_dim=geom.v_head_dim,
        kv_lora_rank=geom.kv_lora_rank,
        qk_rope_head_dim=geom.qk_rope_head_dim,
        qk_nope_head_dim=geom.qk_nope_head_dim,
        scaling=geom.sm_scale,
        context_len=max_context_len,
        num_hidden_layers=num_layers,
        is_encoder_decoder=False,
        attention_arch="MLA" if geom.mla else "MHA",
        swa_v_head_dim=None,
        dtype=dtype,
        get_num_kv_heads=lambda tp_size=1: max(1, geom.num_kv_heads // tp_size),
        get_max_num_attention_heads=lambda tp_size=1: geom.num_heads // tp_size,
    )
    server_args = SimpleNamespace(
        attention_backend="torch_native",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        page_size=1,
        kv_cache_dtype="auto",
        device=device,
        enable_torch_compile=False,
        disable_cuda_graph=True,
        speculative_algorithm=None,
        tp_size=1,
    )
    return SimpleNamespace(
        device=device,
        gpu_id=0,
        tp_size=1,
        dtype=dtype,
        kv_cache_dtype=dtype,
        page_size=1,
        use_mla_backend=geom.mla,
        is_draft_worker=False,
        sliding_window_size=sliding_window_size,
        model_config=model_config,
        server_args=server_args,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        max_total_num_tokens=pool_size,
        max_running_requests=max_num_reqs,
        decode_num_tokens_per_req=lambda: 1,
        geometry=geom,
        req_allocator=SlotAllocator(max_num_reqs + 1, gen),
        slot_allocator=SlotAllocator(pool_size + 1, gen),
        generator=gen,
    )


def make_backend(model_runner):
    """SGLang's own TorchNativeAttnBackend on the stand-in."""
    return import_sglang().TorchNativeAttnBackend(model_runner)


def make_layer(geom: AttnGeometry, layer_id: int = 0, sliding_window_size: int = -1):
    """A RadixAttention layer, constructed as the models construct it."""
    return import_sglang().RadixAttention(
        num_heads=geom.num_heads,
        head_dim=geom.head_dim,
        scaling=geom.sm_scale,
        num_kv_heads=geom.num_kv_heads,
        layer_id=layer_id,
        v_head_dim=geom.v_head_dim,
        sliding_window_size=sliding_window_size if sliding_window_size is not None else -1,
    )


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------


@dataclass
class LayerData:
    """One layer's inputs for a batch, plus what is already cached for each request."""

    q: torch.Tensor  # [num_tokens, H * D]
    k: torch.Tensor  # [num_tokens, Hkv * D]   (new tokens, written by the forward)
    v: torch.Tensor  # [num_tokens, Hkv * Dv]
    prefix_k: List[torch.Tensor]  # per request [prefix_len, Hkv, D], already in the pool
    prefix_v: List[torch.Tensor]  # per request [prefix_len, Hkv, Dv]


@dataclass
class BatchData:
    forward_batch: object  # sglang ForwardBatch
    mode: str  # "extend" | "decode"
    geometry: AttnGeometry
    req_to_token: torch.Tensor  # the pool's table itself [max_num_reqs + 1, max_context_len] int32
    req_pool_indices: torch.Tensor  # [bs] int64 (padded rows, if any, are 0)
    seq_lens: torch.Tensor  # [bs] int64 (prefix + new tokens)
    extend_prefix_lens: torch.Tensor  # [bs] int32 (decode: seq_lens - 1)
    extend_seq_lens: torch.Tensor  # [bs] int32 (decode: ones)
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    layers: Dict[int, LayerData] = field(default_factory=dict)
    num_real_reqs: int = 0  # rows before any padding
    num_real_tokens: int = 0

    # The first layer's tensors, for single-layer use.
    @property
    def _first(self) -> LayerData:
        return self.layers[min(self.layers)]

    @property
    def q(self):
        return self._first.q

    @property
    def k(self):
        return self._first.k

    @property
    def v(self):
        return self._first.v

    @property
    def prefix_k(self):
        return self._first.prefix_k

    @property
    def prefix_v(self):
        return self._first.prefix_v

    def plain(self) -> dict:
        """The plain tensors, by name, to feed our own functions (first layer)."""
        return dict(
            q=self.q, k=self.k, v=self.v, req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            extend_prefix_lens=self.extend_prefix_lens, extend_seq_lens=self.extend_seq_lens,
            out_cache_loc=self.out_cache_loc, positions=self.positions,
        )


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


def _new_kv(geom: AttnGeometry, n: int, dtype, gen):
    """k [n, Hkv, D], v [n, Hkv, Dv]; for absorbed MLA v is k's latent part."""
    k = _rand((n, geom.num_kv_heads, geom.head_dim), dtype, gen)
    if geom.mla:
        v = k[..., : geom.kv_lora_rank].clone()
    else:
        v = _rand((n, geom.num_kv_heads, geom.v_head_dim), dtype, gen)
    return k, v


def write_kv(model_runner, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Put K/V for tokens at slots ``loc`` into the pool, through the pool's own writer."""
    layer = make_layer(model_runner.geometry, layer_id)
    device = torch.device(model_runner.device)
    with parallel_scope():
        model_runner.token_to_kv_pool.set_kv_buffer(layer, loc.to(device), k.to(device), v.to(device))


def read_kv(model_runner, layer_id: int, loc: torch.Tensor):
    """(k, v) stored at slots ``loc``: [n, Hkv, D], [n, Hkv, Dv]."""
    pool = model_runner.token_to_kv_pool
    return pool.get_key_buffer(layer_id)[loc], pool.get_value_buffer(layer_id)[loc]


def _build(
    model_runner,
    mode: str,
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    layer_ids: Sequence[int],
    dtype: Optional[torch.dtype],
    pad_to_bs: Optional[int],
    seq_len_fill_value: int,
):
    sg = import_sglang()
    geom: AttnGeometry = model_runner.geometry
    gen = model_runner.generator
    dtype = dtype or model_runner.dtype
    bs = len(new_lens)
    assert len(prefix_lens) == bs
    seq_lens_l = [p + n for p, n in zip(prefix_lens, new_lens)]
    assert max(seq_lens_l) <= model_runner.req_to_token_pool.max_context_len

    rows = model_runner.req_allocator.alloc(bs)
    req_to_token = model_runner.req_to_token_pool.req_to_token
    out_cache_loc_l: List[int] = []
    prefix_locs = []
    for i in range(bs):
        slots = model_runner.slot_allocator.alloc(seq_lens_l[i])
        req_to_token[rows[i], : seq_lens_l[i]] = torch.tensor(slots, dtype=torch.int32)
        prefix_locs.append(torch.tensor(slots[: prefix_lens[i]], dtype=torch.int64))
        out_cache_loc_l += slots[prefix_lens[i] :]

    num_tokens = sum(new_lens)
    layers = {}
    for lid in layer_ids:
        q = _rand((num_tokens, geom.num_heads * geom.head_dim), dtype, gen)
        k, v = _new_kv(geom, num_tokens, dtype, gen)
        pks, pvs = [], []
        for i in range(bs):
            pk, pv = _new_kv(geom, prefix_lens[i], dtype, gen)
            if prefix_lens[i]:
                write_kv(model_runner, lid, prefix_locs[i], pk, pv)
            pks.append(pk)
            pvs.append(pv)
        layers[lid] = LayerData(q=q, k=k.reshape(num_tokens, -1), v=v.reshape(num_tokens, -1),
                                prefix_k=pks, prefix_v=pvs)

    positions = torch.cat(
        [torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, new_lens)]
    )
    req_pool_indices = torch.tensor(rows, dtype=torch.int64)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int64)
    out_cache_loc = torch.tensor(out_cache_loc_l, dtype=torch.int64)
    extend_prefix_lens = torch.tensor(list(prefix_lens), dtype=torch.int32)
    extend_seq_lens = torch.tensor(list(new_lens), dtype=torch.int32)

    num_real_tokens = num_tokens
    if pad_to_bs is not None and pad_to_bs > bs:
        # CUDA/CPU-graph style padding: padded rows use request row 0 and slot 0.
        assert mode == "decode", "padding is modelled for decode batches only"
        pad = pad_to_bs - bs
        req_pool_indices = torch.cat([req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
        seq_lens = torch.cat([seq_lens, torch.full((pad,), seq_len_fill_value, dtype=torch.int64)])
        out_cache_loc = torch.cat([out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
        positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int64)])
        extend_prefix_lens = torch.cat([extend_prefix_lens, torch.full((pad,), seq_len_fill_value - 1, dtype=torch.int32)])
        extend_seq_lens = torch.cat([extend_seq_lens, torch.ones(pad, dtype=torch.int32)])
        for ld in layers.values():
            ld.q = torch.cat([ld.q, ld.q.new_zeros(pad, ld.q.shape[1])])
            ld.k = torch.cat([ld.k, ld.k.new_zeros(pad, ld.k.shape[1])])
            ld.v = torch.cat([ld.v, ld.v.new_zeros(pad, ld.v.shape[1])])
        bs, num_tokens = pad_to_bs, num_tokens + pad

    device = torch.device(model_runner.device)
    if device.type != "cpu":
        seq_lens_cpu = seq_lens
        req_pool_indices, seq_lens, out_cache_loc, positions, extend_prefix_lens, extend_seq_lens = (
            t.to(device) for t in (req_pool_indices, seq_lens, out_cache_loc, positions,
                                   extend_prefix_lens, extend_seq_lens))
        for ld in layers.values():
            ld.q, ld.k, ld.v = ld.q.to(device), ld.k.to(device), ld.v.to(device)
    else:
        seq_lens_cpu = seq_lens.clone()

    fb_kwargs = dict(
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens_cpu,
        positions=positions,
    )
    if mode == "extend":
        fb = sg.ForwardBatch(
            forward_mode=sg.ForwardMode.EXTEND,
            extend_prefix_lens=extend_prefix_lens,
            extend_seq_lens=extend_seq_lens,
            extend_prefix_lens_cpu=extend_prefix_lens.tolist(),
            extend_seq_lens_cpu=extend_seq_lens.tolist(),
            extend_num_tokens=num_tokens,
            extend_start_loc=torch.cumsum(extend_seq_lens, 0, dtype=torch.int32) - extend_seq_lens,
            max_seq_len_host=int(seq_lens_cpu.max()),
            **fb_kwargs,
        )
    else:
        fb = sg.ForwardBatch(forward_mode=sg.ForwardMode.DECODE,
                             max_seq_len_host=int(seq_lens_cpu.max()), **fb_kwargs)

    return BatchData(
        forward_batch=fb, mode=mode, geometry=geom, req_to_token=req_to_token,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        extend_prefix_lens=extend_prefix_lens, extend_seq_lens=extend_seq_lens,
        out_cache_loc=out_cache_loc, positions=positions, layers=layers,
        num_real_reqs=len(new_lens), num_real_tokens=num_real_tokens,
    )


def make_extend_batch(
    model_runner,
    extend_lens: Sequence[int],
    prefix_lens: Optional[Sequence[int]] = None,
    *,
    layer_ids: Sequence[int] = (0,),
    dtype: Optional[torch.dtype] = None,
) -> BatchData:
    """An EXTEND batch. With ``prefix_lens`` (chunked prefill / radix-cache hit) the
    prefix tokens' K/V are already in the pool, in every layer of ``layer_ids``.

    Request rows and KV slots are scattered and out of order (never row 0 / slot 0).
    """
    prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * len(extend_lens)
    return _build(model_runner, "extend", prefix_lens, list(extend_lens), layer_ids, dtype, None, 1)


def make_decode_batch(
    model_runner,
    seq_lens: Sequence[int],
    *,
    layer_ids: Sequence[int] = (0,),
    dtype: Optional[torch.dtype] = None,
    pad_to_bs: Optional[int] = None,
    seq_len_fill_value: int = 1,
) -> BatchData:
    """A DECODE batch: request i has ``seq_lens[i] - 1`` tokens cached, 1 new token.

    ``pad_to_bs`` appends graph-style padding rows (req row 0, slot 0, seq_len
    ``seq_len_fill_value``, zero q/k/v), as SGLang's graph runners do.
    """
    assert all(s >= 1 for s in seq_lens)
    return _build(model_runner, "decode", [s - 1 for s in seq_lens], [1] * len(seq_lens),
                  layer_ids, dtype, pad_to_bs, seq_len_fill_value)


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def run_sglang_layer(backend, layer, forward_batch, q, k, v, *, save_kv_cache: bool = True,
                     init_metadata: bool = True):
    """One ``RadixAttention.forward`` through ``backend``, as ``ModelRunner`` drives it.

    ``ModelRunner`` calls ``attn_backend.init_forward_metadata(forward_batch)`` once per
    forward (before the first layer) and publishes a ``ForwardContext`` whose backend
    ``RadixAttention.forward`` looks up (``get_attn_backend()``); the layer then calls
    ``backend.forward`` -> ``forward_extend`` / ``forward_decode`` by ``forward_mode``.
    Pass ``init_metadata=False`` for the second and later layers of one forward.

    Returns ``(output [num_tokens, H * Dv], backend.token_to_kv_pool)``.
    """
    sg = import_sglang()
    with parallel_scope():
        if init_metadata:
            backend.init_forward_metadata(forward_batch)
        with sg.forward_context(sg.ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            out = layer(q, k, v, forward_batch, save_kv_cache=save_kv_cache)
    return out, backend.token_to_kv_pool


def run_sglang(model_runner, batch: BatchData, *, layer_id: int = 0, sliding_window_size: int = -1,
               backend=None):
    """Convenience: build the backend and layer, run ``batch``'s layer ``layer_id``."""
    backend = backend if backend is not None else make_backend(model_runner)
    layer = make_layer(model_runner.geometry, layer_id, sliding_window_size)
    ld = batch.layers[layer_id]
    return run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v)


def request_kv(batch: BatchData, i: int, layer_id: int = 0):
    """Full K/V of request i (prefix then new tokens): [seq_len, Hkv, D], [seq_len, Hkv, Dv]."""
    g = batch.geometry
    ld = batch.layers[layer_id]
    start = int(batch.extend_seq_lens[:i].sum())
    n = int(batch.extend_seq_lens[i])
    k_new = ld.k[start : start + n].view(n, g.num_kv_heads, g.head_dim)
    v_new = ld.v[start : start + n].view(n, g.num_kv_heads, g.v_head_dim)
    return (torch.cat([ld.prefix_k[i].to(k_new.device), k_new]),
            torch.cat([ld.prefix_v[i].to(v_new.device), v_new]))


def request_q(batch: BatchData, i: int, layer_id: int = 0):
    """Queries of request i: [n_new, H, D]."""
    g = batch.geometry
    start = int(batch.extend_seq_lens[:i].sum())
    n = int(batch.extend_seq_lens[i])
    return batch.layers[layer_id].q[start : start + n].view(n, g.num_heads, g.head_dim)


def default_tolerance(dtype: torch.dtype):
    """(atol, rtol) for comparing an attention output against a float64 reference."""
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (2e-2, 2e-2)}.get(dtype, (1e-6, 1e-6))


__all__ = [
    "SGLANG_VERSION", "ensure_torchvision_importable", "ensure_sglang_importable",
    "sglang_available", "import_sglang", "AttnGeometry", "GEOMETRIES", "mha", "gqa",
    "mla_normal", "mla_absorbed", "make_model_runner", "make_backend", "make_layer",
    "make_extend_batch", "make_decode_batch", "run_sglang_layer", "run_sglang",
    "write_kv", "read_kv", "request_kv", "request_q", "BatchData", "LayerData",
    "default_tolerance", "SlotAllocator", "parallel_scope", "PARALLEL_DEFAULTS",
]
