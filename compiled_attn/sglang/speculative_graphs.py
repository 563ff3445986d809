"""``TARGET_VERIFY`` under SGLang's CUDA graph runner: the backend's graph hooks for ``k`` draft tokens per request.

With a speculative algorithm on, SGLang 0.5.23's decode graph runner (``model_executor/runner/
decode_cuda_graph_runner.py``) captures ``TARGET_VERIFY`` instead of ``DECODE``: one graph per batch size ``bs`` of
``bs * k`` tokens (``k`` = ``--speculative-num-draft-tokens``, ``captured_req_width``). It calls
  * ``init_cuda_graph_state(max_bs, max_bs * k)`` once;
  * at capture: ``init_forward_metadata_out_graph(fb, in_capture=True)``, then inside the capture
    ``init_forward_metadata_in_graph(fb)`` and the model. ``fb`` holds the runner's static buffers
    (``req_pool_indices``, ``seq_lens`` = each request's cached length without the draft tokens, filled with
    ``get_cuda_graph_seq_len_fill_value()`` at capture, ``out_cache_loc`` of ``bs * k`` slots) and the ``spec_info``
    of ``get_spec_info``: ``draft_token_num`` = k, ``topk``, ``custom_mask`` = the runner's all-True buffer;
  * at replay: the real rows copied into those buffers (padding rows: request row 0, the fill value, slot 0), then
    ``init_forward_metadata_out_graph(view)`` on a view of them (``build_replay_fb_view``: ``num_padding`` padding
    rows, ``seq_lens_cpu``, the step's live ``spec_info``, whose ``custom_mask`` covers the real rows only), then
    the graph's replay (``init_forward_metadata_in_graph`` is not called again: the graph replays what it recorded).

So the metadata splits as the runner expects. ``verify_out_graph`` (host side, before every replay) checks the batch
against the capacities the graph was captured with and copies the live mask's draft columns into a static
``[max_bs, k, k]`` buffer: the live mask is a new tensor every step, so no graph can read it. ``verify_in_graph``
(recorded) copies the rows and prefix lengths into static buffers and builds the verify index from them: pure
tensor code with fixed shapes per ``bs``. The prefix blocks are ``verify.verify_block_size(k, device)`` tokens; a
graph of ``bs`` rows computes over the decode graphs' block capacity at that block size (``backend_util
.graph_block_capacity``, bounded by ``GRAPH_KV_TOKENS_ENV``).

With ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1`` the EAGLE worker (``speculative/eagle_worker_common.py``
``run_eagle_verify``) runs the runner's ``load_batch``, and so ``verify_out_graph``, on a plan stream, then joins the
streams and calls ``update_verify_buffers_to_fill_after_draft(spec_info, runner.bs)`` before the replay. Of what a
graph reads, only the draft mask comes from the draft's output by way of the host: rows, prefix lengths and slots
are the runner's buffers, read inside the graph at replay. ``verify_refill_after_draft`` copies the tree masks
again, so the graph reads the mask as the draft left it, whenever the plan stream read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import check_custom_mask, draft_mask_from_custom
from ..plan import total_blocks_needed
from ..validate import check_kv_end
from ..verify import VerifyIndex, VerifyInputs, build_verify_index, chain_mask, verify_block_size
from .backend_util import check_graph_blocks, graph_batch_size, graph_block_capacity, host_int64
from .speculative import draft_len_of, is_chain, mask_layout, mask_of, with_written_slots


@dataclass
class VerifyGraphState:
    """Static buffers of the ``TARGET_VERIFY`` graphs of ``k`` draft tokens, shared by every captured batch size
    (a graph of ``bs`` rows reads their first ``bs`` rows)."""

    k: int
    block_size: int  # prefix block length, verify_block_size(k, device)
    req_rows: torch.Tensor  # [max_bs] int64
    prefix_lens: torch.Tensor  # [max_bs] int64
    draft_mask: torch.Tensor  # [max_bs, k, k] bool, written by verify_out_graph
    block_ids: torch.Tensor  # [capacity(max_bs)] int64 arange; a graph of bs rows reads [:capacity(bs)]
    block_offsets: torch.Tensor  # [block_size] int64 arange
    # the last verify_out_graph's graph size and its real rows' prefix lengths ([real] int64, host), which the
    # refill after the draft reads the step's tree masks with
    last_bs: int = 0
    last_prefix: torch.Tensor | None = None


def _capacity(backend, bs: int, block_size: int) -> int:
    return graph_block_capacity(bs, max_context_len=backend.max_context_len, kv_tokens=backend.graph.kv_tokens,
                                block_size=block_size, page_size=backend.page_size)


def _graph_state(backend, k: int, *, create: bool) -> VerifyGraphState:
    """The buffers of ``k``, allocated once, at the first capture (a replay without a capture of ``k`` is an
    error: its graph does not exist)."""
    g = backend.graph
    if g is None:
        raise RuntimeError("compiled_attn: init_cuda_graph_state must be called before graph metadata")
    state = g.verify.get(k)
    if state is None:
        if not create:
            raise RuntimeError(f"compiled_attn: no TARGET_VERIFY graph was captured with draft_token_num={k} "
                               f"(captured: {sorted(g.verify) or 'none'})")
        block, dev = verify_block_size(k, backend.device), backend.device

        def z():
            return torch.zeros(g.max_bs, dtype=torch.int64, device=dev)

        state = g.verify[k] = VerifyGraphState(
            k, block, z(), z(), chain_mask(g.max_bs, k, dev).contiguous(),
            torch.arange(_capacity(backend, g.max_bs, block), device=dev), torch.arange(block, device=dev))
    return state


def verify_out_graph(backend, forward_batch, in_capture: bool = False) -> None:
    """Host side, before a capture or a replay: check the batch fits the captured graph of its size and write its
    draft masks into the static buffer (padding rows: the chain). ``forward_batch`` may be the runner's view."""
    spec = getattr(forward_batch, "spec_info", None)
    k = draft_len_of(spec)
    state = _graph_state(backend, k, create=in_capture)
    bs = graph_batch_size(forward_batch, backend.graph.max_bs)
    prefix = host_int64(getattr(forward_batch, "seq_lens_cpu", None), forward_batch.seq_lens)
    if prefix.shape != (bs,):
        raise ValueError(f"compiled_attn: seq_lens must have shape [{bs}] (the batch size), got {tuple(prefix.shape)}")
    check_kv_end(prefix + k, backend.max_context_len, f"compiled_attn: TARGET_VERIFY seq_lens + draft_token_num ({k})")
    needed = total_blocks_needed(torch.zeros_like(prefix), prefix, state.block_size, backend.page_size)
    check_graph_blocks(lambda: f"TARGET_VERIFY batch (bs={bs}, {int(prefix.sum())} cached tokens)", needed,
                       _capacity(backend, bs, state.block_size), state.block_size, backend.graph.kv_tokens)
    state.draft_mask[:bs].copy_(chain_mask(bs, k, state.draft_mask.device))
    real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)  # the live mask covers the real rows only
    state.last_bs, state.last_prefix = bs, prefix[:real]
    _copy_tree_masks(state, spec, state.last_prefix)


def _copy_tree_masks(state: VerifyGraphState, spec, prefix: torch.Tensor) -> None:
    """The step's tree masks (``spec.custom_mask``, checked against the batch) into the static buffer's first
    ``real`` rows; a chain keeps the chain rows. prefix: [real] int64 host, the real rows' cached lengths."""
    real = prefix.shape[0]
    if real == 0 or is_chain(spec):
        return
    mask = state.draft_mask[:real]
    layout = mask_layout(mask.device)
    custom = mask_of(spec, prefix, state.k, layout)
    check_custom_mask(custom, prefix, state.k, layout, mask.device)
    mask.copy_(draft_mask_from_custom(custom, prefix.to(mask.device), state.k, layout))


def verify_refill_after_draft(backend, spec_info, cuda_graph_bs: int | None) -> None:
    """``update_verify_buffers_to_fill_after_draft``: after the plan stream's ``verify_out_graph`` for the graph of
    ``cuda_graph_bs`` rows (the runner's ``bs``), copy ``spec_info``'s tree masks into that graph's mask buffer again
    (module docstring). ``cuda_graph_bs`` None (eager verify: its forward reads ``spec_info`` itself) and chains (no
    mask) need nothing."""
    if cuda_graph_bs is None:
        return
    state = _graph_state(backend, draft_len_of(spec_info), create=False)
    if state.last_prefix is None or state.last_bs != cuda_graph_bs:
        raise RuntimeError(f"compiled_attn: update_verify_buffers_to_fill_after_draft(cuda_graph_bs={cuda_graph_bs}) "
                           f"needs init_forward_metadata_out_graph for a graph of that batch size first (the last "
                           f"one was for bs={state.last_bs})")
    _copy_tree_masks(state, spec_info, state.last_prefix)


def verify_in_graph(backend, forward_batch) -> VerifyIndex:
    """Recorded into the graph: the batch's rows and prefix lengths into the static buffers, and the verify index
    over them (pure tensor code; shapes fixed by ``bs`` and ``k``)."""
    k = draft_len_of(getattr(forward_batch, "spec_info", None))
    state = _graph_state(backend, k, create=False)
    lens = forward_batch.seq_lens
    bs = lens.shape[0]
    state.req_rows[:bs].copy_(forward_batch.req_pool_indices)
    state.prefix_lens[:bs].copy_(lens)
    inputs = VerifyInputs(state.req_rows[:bs], state.prefix_lens[:bs],
                          state.block_ids[: _capacity(backend, bs, state.block_size)], state.block_offsets,
                          state.draft_mask[:bs])
    index = build_verify_index(backend.req_to_token, inputs, backend.page_size, host_form=False)  # recorded
    return with_written_slots(index, getattr(forward_batch, "out_cache_loc", None), bs, k)
