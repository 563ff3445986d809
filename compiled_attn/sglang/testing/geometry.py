"""Attention geometries, the model-runner stand-in and layers of the SGLang test harness (``testing``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ...bench.pools import SlotAllocator
from .runtime import import_sglang

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
    scaling: float | None = None  # None: head_dim ** -0.5
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


GEOMETRIES: dict[str, AttnGeometry] = {
    "mha": mha(),
    "gqa": gqa(),
    "mla_normal": mla_normal(),
    "mla_absorbed": mla_absorbed(),
}


# --------------------------------------------------------------------------------------
# Model-runner stand-in
# --------------------------------------------------------------------------------------


def _seed_from(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def make_model_runner(
    geom: AttnGeometry,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    max_num_reqs: int = 16,
    max_context_len: int = 256,
    pool_size: int = 2048,
    device: str = "cpu",
    sliding_window_size: int | None = None,
    seed: int = 0,
    page_size: int = 1,
    kv_dtype: torch.dtype | None = None,
) -> SimpleNamespace:
    """A ``ModelRunner`` stand-in with the pools and the attributes attention backends read.

    ``page_size`` > 1: SGLang's paged pool; the batch builders then hand out whole pages (``page_allocator``).
    ``kv_dtype``: the pools' dtype (``--kv-cache-dtype``; e.g. float8, stored as uint8 by SGLang); default ``dtype``.

    ``TorchNativeAttnBackend.__init__`` reads only ``device``, ``req_to_token_pool`` and
    ``token_to_kv_pool``; the rest mirrors what other 0.5.23 backends read (triton,
    flex, intel_amx, flashinfer_mla) so a backend of ours can use the same object.
    Also carries ``req_allocator`` / ``slot_allocator`` (harness bookkeeping, not SGLang's).
    """
    sg = import_sglang()
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    req_to_token_pool = sg.ReqToTokenPool(
        size=max_num_reqs, max_context_len=max_context_len, device=device, enable_memory_saver=False
    )
    if geom.mla:
        token_to_kv_pool = sg.MLATokenToKVPool(
            size=pool_size, page_size=page_size, dtype=kv_dtype, kv_lora_rank=geom.kv_lora_rank,
            qk_rope_head_dim=geom.qk_rope_head_dim, layer_num=num_layers, device=device,
            enable_memory_saver=False,
        )
    else:
        token_to_kv_pool = sg.MHATokenToKVPool(
            size=pool_size, page_size=page_size, dtype=kv_dtype, head_num=geom.num_kv_heads,
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
        page_size=page_size,
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
        kv_cache_dtype=kv_dtype,
        page_size=page_size,
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
        # scattered, shuffled rows and slots (0 never handed out): the project's own allocator, seeded from gen
        req_allocator=SlotAllocator(max_num_reqs + 1, seed=_seed_from(gen)),
        slot_allocator=SlotAllocator(pool_size + 1, seed=_seed_from(gen)),
        page_allocator=SlotAllocator(pool_size // page_size + 1, seed=_seed_from(gen)) if page_size > 1 else None,
        generator=gen,
    )


def make_torch_native_backend(model_runner):
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
