"""Speculative decoding in the SGLang backend: ``TARGET_VERIFY`` through ``compiled_attn.verify``.

What SGLang 0.5.23 hands a backend in ``TARGET_VERIFY`` (read from its triton and intel_amx backends and
``speculative/eagle_info.py``, ``eagle_utils.py``):
  * ``forward_batch.seq_lens``: each request's cached length WITHOUT the draft tokens (triton reads the prefix's
    ``kv_indices`` over ``seq_lens`` and sizes the mask ``k * (seq_lens + k)``; intel_amx adds ``k`` itself);
  * ``spec_info.draft_token_num`` (k, the same for the batch), ``spec_info.custom_mask`` (flat bool) and the tree
    shape (``tree_topk`` / ``topk``: 1 is a chain, whose mask is the causal one);
  * q/k/v: ``bs * k`` tokens in request order; the draft K/V are written at ``out_cache_loc`` (``bs * k`` slots,
    request-major), which is where the draft block reads them (the table holds the same slots).
The custom mask's layout is the tree-mask mode SGLang's draft stage picks: a backend without its own
``verify_mask`` (this one) gets ``default_tree_mask_mode()``: ``QLEN_ONLY`` on CPU (``[k, k]`` per request, our
``"draft"`` layout), ``FULL_MASK`` elsewhere (``[k, prefix + k]`` per request, ``"full"``). As the triton kernel
(``skip_prefix_custom_mask``), the prefix columns of a full mask are not read: the prefix is always visible.

``DRAFT_EXTEND_V2`` needs nothing here: SGLang gives it ``extend_prefix_lens`` / ``extend_seq_lens`` (each
request's ``num_draft_tokens`` new tokens after its prefix, ``seq_lens`` including them) and the triton backend
runs it as a plain causal extend, so the backend's extend path serves it.

Graphs: with speculative decoding on, SGLang's CUDA graph runner captures ``TARGET_VERIFY`` (one graph per batch
size, ``bs * k`` tokens) and the backend's graph hooks serve it (``speculative_graphs``): host checks and the copy
of the step's tree mask into a static buffer out of the graph, the verify index built from static buffers in it;
each layer then runs the same ``verify_blocks`` as eagerly. Chains and trees in both mask layouts, padded batch
sizes, pages, sliding-window layers and absorbed MLA are tested that way. A sliding-window layer (gpt-oss alternates
them) builds its own index from the same inputs once per forward (``build_verify_index``'s ``sliding_window``: each
draft token's window from its own position). SGLang's CPU graph runner refuses speculative decoding, so on CPU
verify runs eagerly or under the model's ``torch.compile``. A live CPU engine runs it eagerly with
``--speculative-algorithm NGRAM`` (``tests/test_live_ngram.py``: tree drafts over the ``QLEN_ONLY`` mask, greedy
tokens equal to transformers').

Over a hybrid sliding-window pool (``SWAKVPool``, ``backend.py``'s docstring) the base index is the full pool's
(full layers read it, its inputs are what every windowed index is built from) and a window layer's index has its
slots translated to the window pool (``build_verify_index``'s ``slot_map``), its draft keys where this forward wrote
them there (the translated ``out_cache_loc``).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import mask_numel
from ..decode import translate_slots
from ..verify import VerifyIndex, build_verify_index, plan_verify, verify_blocks
from .backend_util import host_int64, layer_logit_cap, layer_window

VERIFY_KEY = ("verify",)  # the verify index's key in the forward state's extend dict (one per forward)


def draft_len_of(spec_info) -> int:
    """k: ``spec_info.draft_token_num`` (SGLang's ``num_tokens_per_req`` when that is set and positive)."""
    if spec_info is None:
        raise ValueError("compiled_attn: TARGET_VERIFY needs forward_batch.spec_info (draft_token_num, custom_mask)")
    k = getattr(spec_info, "num_tokens_per_req", -1)
    k = k if isinstance(k, int) and k > 0 else getattr(spec_info, "draft_token_num", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"compiled_attn: spec_info.draft_token_num must be an int >= 1, got {k!r}")
    return k


def is_chain(spec_info) -> bool:
    """A chain (topk 1) needs no mask: its visibility is the causal one. NGRAM's irregular trees say -1."""
    topk = getattr(spec_info, "tree_topk", getattr(spec_info, "topk", -1))
    mask = getattr(spec_info, "custom_mask", None)
    return topk == 1 or mask is None or mask.numel() == 0


def mask_layout(device: torch.device) -> str:
    """The layout of ``spec_info.custom_mask`` a backend without a ``verify_mask`` receives (module docstring)."""
    try:
        from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode
        mode = default_tree_mask_mode()
    except Exception:  # an SGLang without the function: its rule, CPU -> QLEN_ONLY
        return "draft" if device.type == "cpu" else "full"
    if mode == TreeMaskMode.QLEN_ONLY:
        return "draft"
    if mode == TreeMaskMode.FULL_MASK:
        return "full"
    raise NotImplementedError(f"compiled_attn: tree mask mode {mode!r} is not supported (QLEN_ONLY or FULL_MASK)")


def mask_of(spec_info, prefix: torch.Tensor, k: int, layout: str) -> torch.Tensor:
    """The batch's part of the custom mask: SGLang may hand a pre-allocated buffer longer than the batch needs."""
    mask = spec_info.custom_mask
    need = mask_numel(prefix, k, layout)
    return mask[:need] if mask.numel() > need else mask


def with_written_slots(index: VerifyIndex, out_cache_loc, bs: int, k: int) -> VerifyIndex:
    """The draft keys read where this forward wrote them (``out_cache_loc``, ``bs * k`` slots request-major; the
    table holds the same slots); the table's slots when ``out_cache_loc`` is absent or of another size."""
    if out_cache_loc is None or out_cache_loc.numel() != bs * k:
        return index
    return replace(index, draft_slots=out_cache_loc.view(bs, k).to(torch.int64))


def verify_index(backend, q3, k_cache, v_cache, forward_batch) -> VerifyIndex:
    """Plan the verify batch and build its index (host checks, once per forward; later layers reuse it)."""
    spec = getattr(forward_batch, "spec_info", None)
    k = draft_len_of(spec)
    prefix = host_int64(getattr(forward_batch, "seq_lens_cpu", None), forward_batch.seq_lens)
    bs = prefix.shape[0]
    mask, layout = None, "draft"
    if not is_chain(spec):
        layout = mask_layout(q3.device)
        mask = mask_of(spec, prefix, k, layout)
    meta = plan_verify(q3, k_cache, v_cache, backend.req_to_token, forward_batch.req_pool_indices,
                       prefix.to(q3.device), k, mask, mask_layout=layout, page_size=backend.page_size,
                       check_slots=backend.swa is None)
    if backend.swa is not None:  # the table indexes the full pool, whichever layer planned (backend.py)
        backend.check_full_slots(meta.inputs.req_rows[:bs], torch.zeros_like(prefix), prefix + k)
    index = build_verify_index(backend.req_to_token, meta.inputs, meta.page_size)
    return with_written_slots(index, forward_batch.out_cache_loc, bs, k)


def verify_state(backend, forward_batch):
    """A graph's static state (``init_forward_metadata_in_graph`` built its verify index from the static buffers),
    else this forward's eager state."""
    state = backend.forward_metadata
    if state is not None and state.static and VERIFY_KEY in state.extend:
        return state
    return backend._state_for(forward_batch, decode=False)


def forward_target_verify(backend, q3, k_cache, v_cache, layer, forward_batch, sinks=None) -> torch.Tensor:
    """One layer of ``TARGET_VERIFY``: q3 [bs * k, Hq, Dqk] over the pool -> [bs * k, Hq * Dv]."""
    if layer.is_cross_attention:
        raise NotImplementedError("compiled_attn: TARGET_VERIFY with cross-attention layers is not supported")
    state = verify_state(backend, forward_batch)
    index = state.extend.get(VERIFY_KEY)
    if index is None:
        index = state.extend[VERIFY_KEY] = verify_index(backend, q3, k_cache, v_cache, forward_batch)
    window = layer_window(layer)
    swa = backend.is_window_pool_layer(layer)
    if window is not None or swa:  # built from the same inputs, once per forward (recorded when in a graph)
        key = (*VERIFY_KEY, window) + ((True,) if swa else ())
        windowed = state.extend.get(key)
        if windowed is None:
            slot_map = backend.swa.slot_map if swa else None
            windowed = build_verify_index(backend.req_to_token, index.inputs, backend.page_size,
                                          host_form=not state.static, sliding_window=window, slot_map=slot_map)
            # its draft keys are the base index's (where this forward wrote them; in the window pool: translated);
            # the window's edge keys come first
            edge = windowed.draft_slots.shape[1] - index.draft_slots.shape[1]
            draft = translate_slots(index.draft_slots, slot_map)
            windowed = state.extend[key] = replace(
                windowed, draft_slots=torch.cat([windowed.draft_slots[:, :edge], draft], 1))
        index = windowed
    k_scale, v_scale = backend._layer_scales(layer)
    o = verify_blocks(q3, k_cache, v_cache, index, layer.scaling, layer_logit_cap(layer),
                      v_shares_k=backend.v_shares_k, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
