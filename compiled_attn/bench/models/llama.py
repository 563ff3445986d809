"""Llama-style decoder (MHA/GQA): RMSNorm, fused q/k/v projection, rotary, attention through the backend, o_proj.

Cache layout: one K and one V cache per layer, ``[num_slots, num_kv_heads, head_dim]`` (``MHAKVPool``), named
``k{layer}`` / ``v{layer}`` in the caches dict (the same dict a compiled decode step receives as ``persistent``).
"""
from __future__ import annotations

import torch
from torch import nn

from ...kv import write_kv
from ..pools import MHAKVPool
from .config import ModelConfig
from .dense import linear
from .layers import AttnFn, DecoderBase, Rotary, WeightInit


class Llama(DecoderBase):
    def __init__(self, cfg: ModelConfig, init: WeightInit):
        super().__init__(cfg, init)
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v fused into one [q_dim + 2 kv_dim, hidden] weight: one GEMM per layer instead of three
        self.qkv = nn.ParameterList([init.linear(q_dim + 2 * kv_dim, cfg.hidden) for _ in range(cfg.num_layers)])
        self.o_proj = nn.ParameterList([init.linear(cfg.hidden, q_dim) for _ in range(cfg.num_layers)])
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.scale = cfg.head_dim ** -0.5

    # ---- caches ----

    def make_pool(self, num_slots: int, dtype: torch.dtype, device) -> MHAKVPool:
        c = self.cfg
        return MHAKVPool(num_slots, c.num_layers, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)

    @staticmethod
    def caches_of(pool: MHAKVPool) -> dict[str, torch.Tensor]:
        caches = {}
        for layer in range(pool.num_layers):
            caches[f"k{layer}"], caches[f"v{layer}"] = pool.get_kv(layer)
        return caches

    def decode_attn_spec(self, caches: dict[str, torch.Tensor]) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(Hq, Dqk, k_cache, v_cache) of the attention calls in decode (layer 0's caches, for ``plan``)."""
        return self.cfg.num_heads, self.cfg.head_dim, caches["k0"], caches["v0"]

    extend_attn_spec = decode_attn_spec

    # ---- forward ----

    def attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
                  caches: dict[str, torch.Tensor], attn: AttnFn, mode: str, kv_slots) -> torch.Tensor:
        """h: [n, hidden] -> [n, hidden]; writes this layer's K/V of the n tokens at ``out_loc``."""
        c = self.cfg
        n = h.shape[0]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = linear(h, self.qkv[layer]).split([q_dim, kv_dim, kv_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(positions)
        q = Rotary.apply(q.reshape(n, c.num_heads, c.head_dim), cos, sin)
        k = Rotary.apply(k.reshape(n, c.num_kv_heads, c.head_dim), cos, sin)
        k_cache, v_cache = caches[f"k{layer}"], caches[f"v{layer}"]
        write_kv(k_cache, out_loc, k)
        write_kv(v_cache, out_loc, v.reshape(n, c.num_kv_heads, c.head_dim))
        o = attn(layer, q, k_cache, v_cache, self.scale)  # [n, Hq, D]
        return linear(o.reshape(n, q_dim), self.o_proj[layer])
