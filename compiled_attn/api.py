"""The public one-call functions: ``plan`` (host checks, metadata) followed by ``run`` (pure tensor code).

For many layers of one batch, plan and index once and run per layer (docs/design.md).
"""
from __future__ import annotations

import torch

from . import validate
from .decode import build_decode_index, decode_blocks
from .extend import extend_tiled
from .plan import plan_decode, plan_extend


def v_is_prefix_of_k(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when ``v_cache`` is a view of ``k_cache``'s first columns (MLA's latent cache), so one gather serves
    both. A host-side check; call it outside compiled code."""
    return (v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
            and v_cache.storage_offset() == k_cache.storage_offset() and v_cache.stride() == k_cache.stride()
            and v_cache.shape[:2] == k_cache.shape[:2] and v_cache.shape[2] <= k_cache.shape[2])


def softmax_scale(scale: float | None, dqk: int) -> float:
    """``scale``, checked, or ``dqk ** -0.5`` where None."""
    return float(dqk) ** -0.5 if scale is None else validate.check_positive_number("scale", scale)


def decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *, scale=None,
                     sliding_window=None, logit_cap=None, encoder_lens=None, is_cross_attn=False, page_size=1,
                     k_scale=None, v_scale=None, sinks=None, form=None) -> torch.Tensor:
    """Attention of one new token per request over its cached keys.

    q: [bs, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv] (may be a view of k_cache:
    MLA); req_to_token: [max_reqs, max_context_len] int32; req_pool_indices, seq_lens: [bs]. Request i attends to
    positions ``[0, seq_lens[i])`` (``plan_decode``: windows, encoders, ``page_size``). k_scale/v_scale: per-layer
    dequantisation scales (None meaning 1); sinks: optional [Hq] attention-sink logits; form: one of
    ``forms.FORMS`` (None: chosen). Returns ``[bs, Hq, Dv]`` in q.dtype.
    """
    validate.check_window_and_cap(None, logit_cap)
    validate.check_scales(k_scale, v_scale)
    meta = plan_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                       sliding_window=sliding_window, encoder_lens=encoder_lens, is_cross_attn=is_cross_attn,
                       page_size=page_size)
    scale = softmax_scale(scale, q.shape[2])
    if meta.num_real == 0:  # as extend: an empty batch is an empty output, not an error from index_select
        return q.new_zeros(0, q.shape[1], v_cache.shape[2])
    return decode_blocks(q, k_cache, v_cache, build_decode_index(req_to_token, meta.inputs, meta.page_size),
                         scale, logit_cap, v_shares_k=v_is_prefix_of_k(k_cache, v_cache), k_scale=k_scale,
                         v_scale=v_scale, sinks=sinks, form=form)


def extend_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                     extend_seq_lens, *, scale=None, causal=True, sliding_window=None, logit_cap=None,
                     encoder_lens=None, is_cross_attn=False, page_size=1, k_scale=None,
                     v_scale=None, sinks=None, form=None) -> torch.Tensor:
    """Attention of each request's new tokens over its cached prefix and themselves.

    q: [num_tokens, Hq, Dqk], request i's queries (positions ``[extend_prefix_lens[i], seq_lens[i])``) packed in
    request order; the rest as in ``decode_attention``, the new tokens' K/V already written. form: one of
    ``forms.EXTEND_FORMS`` (None: chosen). Returns ``[num_tokens, Hq, Dv]`` in q.dtype.
    """
    validate.check_window_and_cap(None, logit_cap)
    validate.check_scales(k_scale, v_scale)
    meta = plan_extend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                       extend_seq_lens, causal=causal, sliding_window=sliding_window, encoder_lens=encoder_lens,
                       is_cross_attn=is_cross_attn, page_size=page_size)
    return extend_tiled(q, k_cache, v_cache, req_to_token, meta, softmax_scale(scale, q.shape[2]), logit_cap,
                        k_scale=k_scale, v_scale=v_scale, sinks=sinks, form=form)
