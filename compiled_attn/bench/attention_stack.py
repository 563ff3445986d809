"""A decode step over N attention layers (no projections), for the graph tests and the step measurements.

Each layer writes the new token's K/V (derived from the hidden state) at ``out_cache_loc`` and attends over the
cache, so the step's cost is the attention's. MHA/GQA layers own a K and a V cache; MLA layers own one latent
cache whose first ``dv`` columns are V (a view, taken inside the step). Shapes come from ``models.AttnShape``
(``get_attention_shape("mha" | "mla" | "tiny-mha" | "tiny-mla")``).
"""
from __future__ import annotations

import torch

from ..decode import build_decode_index, decode_blocks
from ..kv import write_kv
from ..plan import DecodeInputs
from .models import AttnShape


def make_caches(shape: AttnShape, num_layers: int, num_slots: int, dtype=torch.float32,
                device="cpu") -> dict[str, torch.Tensor]:
    """``k{layer}`` (and, for MHA, ``v{layer}``) caches of ``num_slots`` slots, zero-filled."""
    caches = {}
    for layer in range(num_layers):
        caches[f"k{layer}"] = torch.zeros(num_slots, shape.hkv, shape.dqk, dtype=dtype, device=device)
        if not shape.mla:
            caches[f"v{layer}"] = torch.zeros(num_slots, shape.hkv, shape.dv, dtype=dtype, device=device)
    return caches


def make_stack_step(shape: AttnShape, num_layers: int):
    """Return ``step(inputs, persistent) -> x`` with inputs ``x: [bs, Hq, Dqk]``, ``out_cache_loc: [bs]`` and
    the fields of ``DecodeInputs``; persistent holds ``req_to_token`` and the caches of ``make_caches``."""
    scale = shape.dqk ** -0.5
    group = shape.hq // shape.hkv

    def step(inputs, persistent):
        index = build_decode_index(persistent["req_to_token"], DecodeInputs.of(inputs))
        x, loc = inputs["x"], inputs["out_cache_loc"]
        bs = x.shape[0]
        for layer in range(num_layers):
            k_cache = persistent[f"k{layer}"]
            v_cache = k_cache[..., : shape.dv] if shape.mla else persistent[f"v{layer}"]
            new_k = x.view(bs, shape.hkv, group, shape.dqk).mean(2)
            write_kv(k_cache, loc, new_k)
            if not shape.mla:
                write_kv(v_cache, loc, new_k[..., : shape.dv].flip(-1))
            attn = decode_blocks(x, k_cache, v_cache, index, scale, v_shares_k=shape.mla)
            x = torch.cat([x[..., : shape.dv] + attn, x[..., shape.dv:]], dim=-1) * 0.5
        return x

    return step
