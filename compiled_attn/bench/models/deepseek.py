"""DeepSeek-V2-style decoder with multi-head latent attention (MLA), as V2-Lite: no q-LoRA.

Per layer: ``q_proj`` -> per head ``[q_nope (nope) | q_rope (rope)]``; ``kv_a_proj_with_mqa`` -> latent
``c (kv_lora_rank)`` + one shared rope key ``k_pe (rope)``; ``kv_a_layernorm`` on ``c``; ``kv_b_proj``:
``c -> per head [k_nope (nope) | v (v_head_dim)]``; ``o_proj``. Rotary on the rope parts only. The latent cache
(``MLAKVPool`` layout, ``kv{layer}: [num_slots, 1, kv_lora_rank + rope]``) stores ``[c | roped k_pe]``.

Two forms of the same attention (softmax scale ``1/sqrt(nope + rope)`` in both):

* decode, **absorbed**: ``W_UK`` folded into the query, ``q_latent[h] = q_nope[h] @ W_UK[h]`` (``[H, rank]``),
  concatenated with the roped ``q_rope`` -> ``rank + rope`` (576); attention over the latent cache with
  ``k = the cache``, ``v = its first rank columns`` (a view); the ``[H, rank]`` output goes through ``W_UV[h]``
  to ``v_head_dim`` per head, then ``o_proj``. The cache is read once, with one shared "KV head".
* extend (prefill), **normal**: K/V decompressed, ``k = [k_nope | k_pe] (nope + rope = 192)``, ``v (128)``, for
  every token the batch reads (cached prefix included), then ordinary MHA attention with Dqk 192 / Dv 128.

Where the decompressed K/V live: one scratch MHA-layout cache (``scratch_k: [num_slots, H, nope + rope]``,
``scratch_v: [num_slots, H, v_head_dim]``), indexed by the same slots as the latent cache and shared by all
layers: each layer decompresses the batch's slots (``kv_slots``, prefix and new tokens) from its latent cache
into it, then attends. So every attention function and the loop baseline take it unchanged (caches plus
``req_to_token``), a cached prefix needs no special path, and the scratch costs one layer's worth of memory,
not ``num_layers`` (the latent cache stays the only per-layer store, as in SGLang).
"""
from __future__ import annotations

import torch
from torch import nn

from ...kv import write_kv
from ..pools import MHAKVPool, MLAKVPool
from .config import ModelConfig
from .dense import linear
from .layers import AttnFn, DecoderBase, Rotary, WeightInit, rms_norm


class DeepSeekMLA(DecoderBase):
    def __init__(self, cfg: ModelConfig, init: WeightInit):
        super().__init__(cfg, init)
        h, nope, rope, rank, vd = cfg.num_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.v_head_dim
        layers = range(cfg.num_layers)
        self.q_proj = nn.ParameterList([init.linear(h * (nope + rope), cfg.hidden) for _ in layers])
        self.kv_a_proj = nn.ParameterList([init.linear(rank + rope, cfg.hidden) for _ in layers])
        self.kv_a_norm = nn.ParameterList([init.norm(rank) for _ in layers])
        self.kv_b_proj = nn.ParameterList([init.linear(h * (nope + vd), rank) for _ in layers])
        self.o_proj = nn.ParameterList([init.linear(cfg.hidden, h * vd) for _ in layers])
        # absorbed-form weights, split once from kv_b_proj (as SGLang's w_kc / w_vc):
        # W_UK: [H, nope, rank]; W_UV^T: [H, rank, v]
        w = [p.data.view(h, nope + vd, rank) for p in self.kv_b_proj]
        self.w_uk = nn.ParameterList([nn.Parameter(x[:, :nope].contiguous(), requires_grad=False) for x in w])
        self.w_uv_t = nn.ParameterList([nn.Parameter(x[:, nope:].transpose(1, 2).contiguous(), requires_grad=False)
                                        for x in w])
        self.rotary = Rotary(rope, cfg.rope_theta)
        self.scale = (nope + rope) ** -0.5

    # ---- caches ----

    def make_pool(self, num_slots: int, dtype: torch.dtype, device) -> tuple[MLAKVPool, MHAKVPool]:
        """The per-layer latent pool and the one-layer scratch pool of decompressed K/V (module doc)."""
        c = self.cfg
        latent = MLAKVPool(num_slots, c.num_layers, c.kv_lora_rank, c.qk_rope_dim, dtype=dtype, device=device)
        scratch = MHAKVPool(num_slots, 1, c.num_heads, c.qk_nope_dim + c.qk_rope_dim, c.v_head_dim,
                            dtype=dtype, device=device)
        return latent, scratch

    @staticmethod
    def caches_of(pools: tuple[MLAKVPool, MHAKVPool]) -> dict[str, torch.Tensor]:
        latent, scratch = pools
        caches = {f"kv{layer}": latent.kv_buffers[layer] for layer in range(latent.num_layers)}
        caches["scratch_k"], caches["scratch_v"] = scratch.get_kv(0)
        return caches

    def decode_attn_spec(self, caches):
        """(Hq, Dqk, k_cache, v_cache) of absorbed decode: q 576 over the latent cache, v its 512-col view."""
        kv = caches["kv0"]
        return self.cfg.num_heads, kv.shape[-1], kv, kv[..., : self.cfg.kv_lora_rank]

    def extend_attn_spec(self, caches):
        """(Hq, Dqk, k_cache, v_cache) of normal extend: q 192 over the decompressed scratch cache."""
        return self.cfg.num_heads, caches["scratch_k"].shape[-1], caches["scratch_k"], caches["scratch_v"]

    # ---- forward ----

    def attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
                  caches: dict[str, torch.Tensor], attn: AttnFn, mode: str, kv_slots) -> torch.Tensor:
        """h: [n, hidden] -> [n, hidden]; writes the n tokens' ``[c | k_pe]`` into the latent cache at out_loc."""
        c = self.cfg
        n, heads, nope, rope, rank = h.shape[0], c.num_heads, c.qk_nope_dim, c.qk_rope_dim, c.kv_lora_rank
        q = linear(h, self.q_proj[layer]).view(n, heads, nope + rope)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = linear(h, self.kv_a_proj[layer]).split([rank, rope], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm[layer], c.rms_eps)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = Rotary.apply(q_pe, cos, sin)
        k_pe = Rotary.apply(k_pe.reshape(n, 1, rope), cos, sin)
        kv_cache = caches[f"kv{layer}"]
        write_kv(kv_cache, out_loc, torch.cat([latent[:, None, :], k_pe], dim=-1))
        if mode == "decode":
            o = self._absorbed(layer, q_nope, q_pe, kv_cache, attn)
        else:
            o = self._normal(layer, q_nope, q_pe, kv_cache, caches, attn, kv_slots)
        return linear(o.reshape(n, heads * c.v_head_dim), self.o_proj[layer])

    def _absorbed(self, layer, q_nope, q_pe, kv_cache, attn: AttnFn) -> torch.Tensor:
        """q_nope: [n, H, nope], q_pe: [n, H, rope] -> [n, H, v_head_dim]."""
        rank = self.cfg.kv_lora_rank
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk[layer]).transpose(0, 1)  # [n, H, rank]
        q = torch.cat([q_latent, q_pe], dim=-1)  # [n, H, rank + rope]
        o_latent = attn(layer, q, kv_cache, kv_cache[..., :rank], self.scale, v_shares_k=True)  # [n, H, rank]
        return torch.bmm(o_latent.transpose(0, 1), self.w_uv_t[layer]).transpose(0, 1)  # [n, H, v]

    def _normal(self, layer, q_nope, q_pe, kv_cache, caches, attn: AttnFn, kv_slots) -> torch.Tensor:
        """Decompress K/V of ``kv_slots`` into the scratch cache, then MHA with Dqk nope+rope, Dv v_head_dim."""
        c = self.cfg
        heads, nope, rank = c.num_heads, c.qk_nope_dim, c.kv_lora_rank
        if kv_slots is None:
            raise ValueError("MLA normal extend needs kv_slots (every slot the batch reads)")
        lat = kv_cache.index_select(0, kv_slots)  # [m, 1, rank + rope]
        m = lat.shape[0]
        kv = linear(lat[:, 0, :rank], self.kv_b_proj[layer]).view(m, heads, nope + c.v_head_dim)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, lat[:, :, rank:].expand(m, heads, c.qk_rope_dim)], dim=-1)
        scratch_k, scratch_v = caches["scratch_k"], caches["scratch_v"]
        write_kv(scratch_k, kv_slots, k)
        write_kv(scratch_v, kv_slots, v)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return attn(layer, q, scratch_k, scratch_v, self.scale)
