"""The per-request SDPA loop of SGLang's ``torch_native`` backend, re-implemented as the benchmark baseline.

The ``loop`` backend of ``compiled-attn bench`` and the baseline of ``bench-ops`` (``bench-sglang`` runs SGLang's own
backend instead). Same algorithm: for each request, gather its K/V rows from the cache through ``req_to_token``,
move heads first, and call ``scaled_dot_product_attention`` once (GQA through ``enable_gqa``; a differing V width
falls to SDPA's math path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa(q, k, v, scale, causal):
    """q: [Hq, Lq, D]; k: [Hkv, Lk, D]; v: [Hkv, Lk, Dv] -> [Hq, Lq, Dv]."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=causal,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]


def loop_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *, scale=None, k_scale=None,
                v_scale=None) -> torch.Tensor:
    """q: [bs, Hq, D] -> [bs, Hq, Dv]; one SDPA call per request. A cache of another dtype (float8, a half cache
    under a float32 query) is cast to q's dtype as torch_native does, then multiplied by k_scale/v_scale."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=False)):
        tokens = req_to_token[row, :n].long()
        k, v = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if k_scale is not None:
            k, v = k * k_scale, v * v_scale
        out[i] = _sdpa(q[i][:, None], k, v, scale, causal=False)[:, 0]
    return out


def loop_extend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, *, scale=None, causal=True) -> torch.Tensor:
    """q: [num_tokens, Hq, D] packed -> [num_tokens, Hq, Dv]; one SDPA call per request (causal with prefix as
    SGLang does it: the queries are padded with the prefix so ``is_causal`` lines up)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for row, n, prefix in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(), strict=False):
        ext = n - prefix
        tokens = req_to_token[row, :n].long()
        k, v = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        qi = q.new_zeros(q.shape[1], n, q.shape[2])
        qi[:, prefix:] = q[start:start + ext].movedim(0, 1)
        out[start:start + ext] = _sdpa(qi, k, v, scale, causal)[:, prefix:].movedim(0, 1)
        start += ext
    return out
