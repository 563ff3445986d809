"""Building blocks of the reference models: seeded weights, RMSNorm, rotary, SwiGLU MLP, the decoder base.

Everything a forward calls is pure tensor code (no ``.item()``, no host sync, no Python branch on values), so a
whole decode step can run under ``torch.compile(fullgraph=True)`` and inside a CUDA graph.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .dense import linear


class AttnFn(Protocol):
    """The attention a model calls per layer (chosen by the backend for this step).

    q: [n, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv] -> [n, Hq, Dv].
    v_shares_k: V is the first Dv columns of K (MLA's latent cache), so K can be gathered once.
    """

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float, v_shares_k: bool = False) -> torch.Tensor: ...


# ---- seeded weights ----

class WeightInit:
    """Draws every weight from one seeded CPU generator (same weights on every device and dtype)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float) -> nn.Parameter:
        w = torch.empty(shape).normal_(0.0, std, generator=self.gen)
        return nn.Parameter(w, requires_grad=False)

    def linear(self, out_features: int, in_features: int) -> nn.Parameter:
        """``[out, in]``, std 1/sqrt(in): unit-scale inputs give unit-scale outputs."""
        return self.normal(out_features, in_features, std=in_features ** -0.5)

    def norm(self, dim: int) -> nn.Parameter:
        """RMSNorm gain around 1 (not exactly 1, so a wrong normalisation axis shows)."""
        w = 1.0 + 0.1 * torch.empty(dim).normal_(generator=self.gen)
        return nn.Parameter(w, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, returned in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) of ``dim`` channels, from a positions tensor."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] int64 -> cos, sin: [n, 1, dim] float32 (broadcast over heads).

        The frequencies are recomputed per call (dim/2 values) rather than kept as a buffer, so ``model.to(bf16)``
        never rounds them."""
        exponent = torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.float32) / self.dim
        inv_freq = torch.pow(self.theta, -exponent)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, H, dim] -> rotated, in x.dtype (computed in float32)."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, init: WeightInit):
        super().__init__()
        self.gate_up = init.linear(2 * intermediate, hidden)  # gate and up fused: one GEMM
        self.down = init.linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down)


class DecoderBase(nn.Module):
    """Embedding, per-layer norms, optional MLPs, final norm and lm_head; subclasses add the attention.

    Subclasses implement ``attention(layer, h, positions, out_loc, caches, attn, mode, kv_slots)`` and the cache
    layout (``make_caches``, ``decode_attn_spec``, ``extend_attn_spec``).
    """

    def __init__(self, cfg: ModelConfig, init: WeightInit):
        super().__init__()
        self.cfg = cfg
        self.embed = init.normal(cfg.vocab, cfg.hidden, std=1.0)
        self.attn_norm = nn.ParameterList([init.norm(cfg.hidden) for _ in range(cfg.num_layers)])
        self.mlp_norm = nn.ParameterList([init.norm(cfg.hidden) for _ in range(cfg.num_layers)])
        self.mlps = nn.ModuleList([SwiGLU(cfg.hidden, cfg.intermediate, init) for _ in range(cfg.num_layers)]
                                  if cfg.mlp else [])
        self.final_norm = init.norm(cfg.hidden)
        self.lm_head = init.linear(cfg.vocab, cfg.hidden)

    def attention(self, layer, h, positions, out_loc, caches, attn, mode, kv_slots):  # pragma: no cover
        raise NotImplementedError

    def hidden(self, tokens, positions, out_loc, caches, attn: AttnFn, mode: str, kv_slots=None) -> torch.Tensor:
        """The decoder layers: tokens, positions, out_loc: [n] int64 -> hidden states [n, hidden] (before the
        final norm). ``mode`` "decode" or "extend"; writes each layer's K/V of the n tokens at ``out_loc``."""
        x = F.embedding(tokens, self.embed)
        for layer in range(self.cfg.num_layers):
            h = rms_norm(x, self.attn_norm[layer], self.cfg.rms_eps)
            x = x + self.attention(layer, h, positions, out_loc, caches, attn, mode, kv_slots)
            if self.cfg.mlp:
                x = x + self.mlps[layer](rms_norm(x, self.mlp_norm[layer], self.cfg.rms_eps))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states [n, hidden] -> logits [n, vocab] float32."""
        return linear(rms_norm(x, self.final_norm, self.cfg.rms_eps), self.lm_head).float()

    def _forward(self, tokens, positions, out_loc, caches, attn: AttnFn, mode: str, kv_slots=None,
                 logits_idx=None) -> torch.Tensor:
        x = self.hidden(tokens, positions, out_loc, caches, attn, mode, kv_slots)
        if logits_idx is not None:
            x = x.index_select(0, logits_idx)
        return self.logits(x)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
               caches: dict[str, torch.Tensor], attn: AttnFn) -> torch.Tensor:
        """One new token per request. tokens, positions, out_loc: [bs] int64 -> logits [bs, vocab] float32.

        Writes each layer's new K/V at ``out_loc`` before attending (the plan's ranges include the new token).
        """
        return self._forward(tokens, positions, out_loc, caches, attn, "decode")

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
               caches: dict[str, torch.Tensor], attn: AttnFn, logits_idx: torch.Tensor,
               kv_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill of packed new tokens. tokens, positions, out_loc: [num_tokens] int64; logits_idx: [bs] rows
        whose logits are returned (each request's last token) -> [bs, vocab] float32. ``kv_slots``: [n] every
        slot the batch reads (prefix and new tokens; MLA decompresses these)."""
        return self._forward(tokens, positions, out_loc, caches, attn, "extend", kv_slots, logits_idx)

