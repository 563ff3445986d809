"""The public one-call functions: ``plan`` (host checks, metadata) followed by ``run`` (pure tensor code).

For repeated layers of one batch, call ``plan_*`` once, ``build_*_index`` once, then ``decode_blocks`` /
``extend_tiles`` per layer (after ``plan_extend_tiles``), as the SGLang backend and the captured decode step do.
"""
from __future__ import annotations

import torch

from . import validate
from .decode import build_decode_index, decode_blocks
from .extend import extend_tiled
from .plan import plan_decode, plan_extend


def v_is_prefix_of_k(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when ``v_cache`` is a view of ``k_cache``'s first columns (MLA's latent cache), so one gather serves
    both. Host-side check on the caches' storage; call it once, outside compiled code."""
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

    q: [bs, Hq, Dqk]; k_cache: [num_slots, Hkv, Dqk]; v_cache: [num_slots, Hkv, Dv] (may be a view of k_cache,
    as MLA's latent cache); req_to_token: [max_reqs, max_context_len] int32; req_pool_indices, seq_lens: [bs].
    Request i attends to positions ``[0, seq_lens[i])`` (see ``plan_decode`` for windows, encoders and
    ``page_size``). The caches may be float8 (``k_scale``/``v_scale``: the per-layer dequantisation scales,
    None meaning 1) or another dtype than q (``kv_dtype``). sinks: optional [Hq] attention-sink logits (gpt-oss),
    each joining its head's softmax denominator. form: one of ``forms.FORMS`` to run that form (None: chosen,
    ``forms.choose_form``). Returns ``[bs, Hq, Dv]`` in q.dtype.
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
    request order; caches, table, ``page_size``, scales and sinks as in ``decode_attention``; the new tokens' K/V must
    already be written. form: one of ``forms.EXTEND_FORMS`` (None: chosen, ``forms.choose_extend_form``). Returns
    ``[num_tokens, Hq, Dv]`` in q.dtype.
    """
    validate.check_window_and_cap(None, logit_cap)
    validate.check_scales(k_scale, v_scale)
    meta = plan_extend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                       extend_seq_lens, causal=causal, sliding_window=sliding_window, encoder_lens=encoder_lens,
                       is_cross_attn=is_cross_attn, page_size=page_size)
    return extend_tiled(q, k_cache, v_cache, req_to_token, meta, softmax_scale(scale, q.shape[2]), logit_cap,
                        k_scale=k_scale, v_scale=v_scale, sinks=sinks, form=form)
