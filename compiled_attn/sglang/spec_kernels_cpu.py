"""Pure-PyTorch CPU versions of the ``sgl_kernel`` ops SGLang 0.5.23's speculative decoding calls on CPU.

SGLang's CPU path imports these from ``sgl_kernel`` (its AMX C++ build, not on PyPI); the stand-in in
:mod:`compiled_attn.sglang.cpu_fixups` answers the names in :data:`OPS` (and
``sgl_kernel.speculative.reconstruct_indices_from_tree_mask``) with the functions here. Each keeps the signature
and the in-place contract of the call site that uses it (SGLang's module named in each docstring):

- :func:`reconstruct_indices_from_tree_mask`: positions and tree links of the draft tokens, from the n-gram tree
  mask (``speculative/ngram_worker.py``, via ``kernels/ops/speculative/reconstruct_tree.py``);
- :func:`assign_extend_cache_locs_cpu`: ranges of the slot table, packed
  (``kernels/ops/speculative/cache_locs.py``);
- :func:`assign_req_to_token_pool_cpu`: the reverse write (``mem_cache/allocation.py``);
- :func:`verify_tree_greedy_cpu`: walk each draft tree along the target's greedy tokens
  (``kernels/ops/speculative/spec_tree.py``);
- :func:`fill_accept_out_cache_loc_cpu`: the accepted tokens' slots, packed (``kernels/ops/speculative/eagle.py``);
- :func:`copy_all_layer_kv_cache_cpu`: copy slots in every layer's K/V buffer, given as raw pointers
  (``kernels/ops/kvcache/cache_move.py``).

EAGLE / EAGLE-3 (draft-model workers) call these besides (``fill_accept_out_cache_loc_cpu``, the verify walk and the
slot-table ops above are shared):

- :func:`build_tree_kernel_efficient_cpu`: the draft tree's mask, positions and links from the draft's top-k
  selection (``kernels/ops/speculative/spec_tree.py``);
- :func:`assign_draft_cache_locs_contiguous_cpu`: the draft tokens' slots, read from the slot table
  (``kernels/ops/speculative/cache_locs.py``);
- :func:`fill_bonus_tokens_cpu`: each request's last accepted token (``kernels/ops/speculative/eagle.py``);
- :func:`rotate_input_ids_cpu`: multi-layer EAGLE's (MTP's) shift of the extend tokens
  (``kernels/ops/speculative/multi_layer_eagle.py``);
- :func:`build_draft_decode_metadata_cpu`: per-branch slot-table rows for multi-step draft decode (SGLang's
  ``IntelAMXMultiStepDraftBackend``), which :class:`DraftDecodeSteps` runs over our backend.

The batches are small (a few requests, a few draft tokens each) and live on the CPU, so the tree ops read their
inputs into Python lists once instead of launching a tensor op per tree node.
"""

from __future__ import annotations

import ctypes
import types

import torch


def _packed_ranges(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor):
    """Rows and columns of ``req_to_token`` covered by each request's ``[start, end)``, packed in request order.

    All ``[bs]``. Returns ``(rows, cols)``, each ``[sum(end - start)]`` int64.
    """
    start = start_offset.to(torch.int64)
    lens = (end_offset.to(torch.int64) - start).clamp_min(0)
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lens)
    # column = the request's start + the token's rank inside its own range
    first = torch.cumsum(lens, 0) - lens
    rank = torch.arange(rows.numel(), dtype=torch.int64) - torch.repeat_interleave(first, lens)
    cols = torch.repeat_interleave(start, lens) + rank
    return rows, cols


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """``out_cache_loc[packed] = req_to_token[req_pool_indices[i], start[i]:end[i]]`` for each request ``i``.

    req_pool_indices, start_offset, end_offset: ``[bs]``; req_to_token: ``[rows, pool_len]`` (int32, or a view of
    another request-major table); out_cache_loc: ``[>= sum(end - start)]``, written in place from its start,
    request after request; entries past the packed length are left as they are. ``pool_len`` is the table's row
    length (kept for the op's signature; the table's own shape says the same).
    """
    rows, cols = _packed_ranges(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed]``: the reverse of
    :func:`assign_extend_cache_locs_cpu` (new slots recorded in the table).

    Same shapes; req_to_token is written in place (cast to its dtype); ``out_cache_loc`` is read from its start.
    """
    rows, cols = _packed_ranges(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """Positions and retrieval links of ``n = draft_token_num`` draft tokens per request from their tree mask.

    tree_mask: flat bool, ``[>= bs * n * n]``; ``[b, i, j]`` (row-major) is True when token j is token i or one of
    its ancestors (a parent always comes before its children). verified_seq_len: ``[bs]``, each request's length
    before the drafts. Written in place: positions ``[bs * n]`` (ancestor count + verified length),
    retrieve_index ``[bs, n]`` (``b * n + i``: the token's row in the batch's flat verify output),
    retrieve_next_token ``[bs, n]`` (first child, -1 for a leaf), retrieve_next_sibling ``[bs, n]`` (next child of
    the same parent, -1 for the last one and for a root).
    """
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    node = torch.arange(n)
    mask = tree_mask[: bs * n * n].view(bs, n, n).to(torch.bool)
    # ancestors[b, i, j]: j is a strict ancestor of i (the mask's diagonal marks the token itself)
    ancestors = mask & (node[None, :] < node[:, None])
    depth = ancestors.sum(-1)
    positions[: bs * n] = (depth + verified_seq_len[:bs].to(torch.int64)[:, None]).reshape(-1).to(positions.dtype)
    retrieve_index.copy_((torch.arange(bs)[:, None] * n + node).to(retrieve_index.dtype))
    # the parent is the nearest ancestor, i.e. the one with the largest index
    parent = torch.where(ancestors, node, -1).amax(-1)                            # [bs, n], -1 for a root
    # the first child of j is its descendant with the smallest index (a descendant's parent is j or comes earlier)
    first_desc = torch.where(ancestors, node[:, None], n).amin(1)                 # [bs, n], n when none
    retrieve_next_token.copy_(torch.where(first_desc < n, first_desc, -1).to(retrieve_next_token.dtype))
    # next sibling of i: the smallest k > i with the same parent; roots get none (ngram trees have one root)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])  # [b, k, i]
    next_sib = torch.where(same_parent, node[:, None], n).amin(1)
    retrieve_next_sibling.copy_(torch.where((parent >= 0) & (next_sib < n), next_sib, -1)
                                .to(retrieve_next_sibling.dtype))


def _walk_tree(cand: list, index: list, next_token: list, next_sibling: list, target: list,
               max_accept: int) -> list:
    """One request's greedy walk: from the root, step to the child whose draft token equals the target's token at
    the current node, while there is one and the path is shorter than ``max_accept``.

    All lists of one request's ``n`` entries, except ``target``: the batch's flat ``[bs * n]`` greedy tokens.
    Returns the flat verify rows of the accepted nodes, root first.
    """
    path = [index[0]]
    node = 0
    while len(path) < max_accept:
        want = target[path[-1]]
        child = next_token[node]
        while child != -1 and cand[child] != want:
            child = next_sibling[child]
        if child == -1:
            break
        path.append(index[child])
        node = child
    return path


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy verification of draft trees (keyword names as SGLang's call: ``retrive_*``).

    candidates, retrive_index/next_token/next_sibling, target_predict: ``[bs, n]`` (draft tokens, tree links
    from :func:`reconstruct_indices_from_tree_mask`, the target model's argmax at each draft token). Written in
    place: accept_index ``[bs, S]`` (the flat verify rows of the accepted path, root first; later entries left as
    they are, -1 from the caller), accept_token_num ``[bs]`` (accepted drafts, root excluded, at most ``S - 1``),
    predicts ``[bs * n]`` (at each accepted row, the target's token there: the next token; other rows untouched).
    """
    bs, n = candidates.shape
    max_accept = accept_index.shape[1]
    target = target_predict.reshape(-1).tolist()
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for b in range(bs):
        path = _walk_tree(cand[b], index[b], next_token[b], next_sibling[b], target, max_accept)
        rows = torch.tensor(path, dtype=torch.int64)
        accept_index[b, : len(path)] = rows.to(accept_index.dtype)
        accept_token_num[b] = len(path) - 1
        # each accepted row predicts the target's token there (the next accepted draft, or the bonus token)
        predicts[rows] = target_predict.reshape(-1)[rows].to(predicts.dtype)


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor, size: int | None = None) -> None:
    """Pack the slots of the accepted tokens: ``accept_out_cache_loc[:m] = out_cache_loc[accepted]``.

    accept_index: ``[bs, S]`` flat verify rows, -1 = none (read row-major); out_cache_loc: ``[bs * n]`` slots of
    the verify tokens; accept_out_cache_loc: ``[>= m]``, written in place from its start, the rest left as it is.
    ``size``: read only the first ``size`` entries of ``accept_index`` (later sgl_kernel builds take it; SGLang
    0.5.23 calls without it: all).
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    flat = flat if size is None else flat[:size]
    rows = flat[flat >= 0]
    accept_out_cache_loc[: rows.numel()] = out_cache_loc[rows].to(accept_out_cache_loc.dtype)


def _tree_parents(sel: list, parents: list, topk: int, n: int) -> list:
    """Each draft node's parent node (0 = the root) from the draft's top-k selection, -1 where the parent is not
    among the selected nodes (SGLang's kernels then leave the node unlinked).

    ``sel``: the ``n - 1`` selected candidate indices (node ``i`` is candidate ``sel[i - 1]``); candidate ``c``'s
    parent is the root when ``c // topk == 0``, else the candidate ``parents[c // topk]``.
    """
    out = [-1, *([0] * (n - 1))]
    for i in range(1, n):
        ptb = sel[i - 1] // topk
        if ptb > 0:
            want = parents[ptb]
            out[i] = next((pp + 1 for pp in range(n - 1) if sel[pp] == want), -1)
    return out


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """The EAGLE draft tree of ``n = draft_token_num`` nodes per request (node 0 the root, the verified token).

    parent_list: ``[bs, topk * (depth - 1) + 1]`` candidate index of each expanded node (``organize_draft_results``;
    ``[bs, 0]`` for one step); selected_index: ``[bs, n - 1]`` the chosen candidates, ascending; verified_seq_len:
    ``[bs]``. Written in place, as SGLang's triton kernel (``spec_tree.sgl_build_tree_kernel_efficient_triton``):
    retrive_index ``[bs, n]`` = ``b * n + i``; retrive_next_token / retrive_next_sibling ``[bs, n]``: the first
    child and next sibling (ascending node order), written only where a link exists (the caller fills -1);
    positions ``[bs * n]``: verified length + depth; tree_mask: row ``i`` marks node ``i`` and its ancestors
    (root included) over the ``n`` draft columns, the rest False; mode 1 (QLEN_ONLY) ``[bs, n, n]``, mode 0
    (FULL_MASK) rows of ``seq_len + n`` per request whose ``seq_len`` prefix columns are left as they are.
    An ancestor walk stops after ``depth`` steps or at a parent that was not selected.
    """
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError(f"build_tree_kernel_efficient_cpu: tree_mask_mode {int(tree_mask_mode)} "
                                  "(QLEN_ONLY_BITPACKING) is not supported on CPU")
    bs, n, seq_lens = verified_seq_len.shape[0], int(draft_token_num), verified_seq_len.tolist()
    sels, pars = selected_index.tolist(), parent_list.reshape(bs, -1).tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    mask, pos = torch.zeros(bs, n, n, dtype=torch.bool), torch.zeros(bs, n, dtype=torch.int64)
    mask[:, :, 0] = True
    for b in range(bs):
        parent = _tree_parents(sels[b], pars[b], topk, n)
        for i in range(n - 1, 0, -1):  # children linked in descending order: the first child is the smallest
            p = parent[i]
            if p < 0:
                continue
            if nxt[b][p] != -1:
                sib[b][i] = nxt[b][p]
            nxt[b][p] = i
        for i in range(1, n):
            node, steps = i, 0
            while steps < depth and node > 0:
                mask[b, i, node] = True
                steps, node = steps + 1, parent[node]
            pos[b, i] = steps
    retrive_next_token.copy_(torch.tensor(nxt, dtype=torch.int64).view_as(retrive_next_token))
    retrive_next_sibling.copy_(torch.tensor(sib, dtype=torch.int64).view_as(retrive_next_sibling))
    retrive_index.copy_(torch.arange(bs * n).view(bs, n).to(retrive_index.dtype))
    positions[: bs * n] = (pos + torch.tensor(seq_lens, dtype=torch.int64)[:, None]).reshape(-1).to(positions.dtype)
    if int(tree_mask_mode) == 1:
        tree_mask[: bs * n * n] = mask.reshape(-1)
        return
    start = 0
    for b in range(bs):  # FULL_MASK: request b's rows start after the earlier requests' [n, seq_len + n] blocks
        width = seq_lens[b] + n
        tree_mask[start: start + n * width].view(n, width)[:, seq_lens[b]:] = mask[b]
        start += n * width


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """``out_cache_loc[b * m : (b + 1) * m] = req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + m]``
    with ``m = topk * num_steps``: the draft tokens' slots, allocated right after each request's prefix (page size 1
    or topk 1). out_cache_loc: ``[>= bs * m]``, written from its start."""
    start = seq_lens.to(torch.int64)
    rows, cols = _packed_ranges(req_pool_indices, start, start + int(topk) * int(num_steps))
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """``bonus_tokens[b] = accept_tokens.flat[accept_stride * b + accept_lens[b] - 1]``: each request's last
    accepted token (``accept_lens`` counts the bonus token). bonus_tokens ``[>= bs]`` written in place."""
    bs = accept_lens.shape[0]
    idx = torch.arange(bs, dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def rotate_input_ids_cpu(input_ids: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                         topk_index: torch.Tensor, select_index: torch.Tensor | None = None) -> None:
    """Multi-layer EAGLE: shift each request's extend tokens one left and put its new token last, in place.

    For request ``b`` (``start``, ``len`` from extend_start_loc / extend_seq_lens): ``input_ids[start + j] =
    input_ids[start + j + 1]`` for ``j < len - 1`` (old values), then, if ``len > 0``, ``topk_index[b]`` at
    ``select_index[b]`` (given) or at ``start + len - 1``.
    """
    start, lens = extend_start_loc.to(torch.int64), extend_seq_lens.to(torch.int64)
    rows, cols = _packed_ranges(torch.zeros_like(start), start, start + (lens - 1).clamp_min(0))
    input_ids[cols] = input_ids[cols + 1]  # the right side is gathered first: old values
    has = lens > 0
    last = select_index.to(torch.int64) if select_index is not None else start + lens - 1
    input_ids[last[has]] = topk_index.reshape(-1)[: lens.numel()][has].to(input_ids.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """A slot table with one row per draft branch (``[bs * topk, pool_len]``, row ``b * topk + t``): request b's
    prefix ``[0, seq_len)``, then branch t's ``num_steps`` draft slots (``req_to_token`` columns ``seq_len + t *
    num_steps + s``) at ``[seq_len, seq_len + num_steps)``; the rest 0 (unspecified in sgl_kernel's)."""
    bs, topk, num_steps = req_pool_indices.shape[0], int(topk), int(num_steps)
    out = torch.zeros(bs * topk, int(pool_len), dtype=req_to_token.dtype)
    src = req_to_token[req_pool_indices.to(torch.int64)]
    lens = seq_lens.tolist()
    for b in range(bs):
        sl = lens[b]
        for t in range(topk):
            out[b * topk + t, :sl] = src[b, :sl]
            out[b * topk + t, sl: sl + num_steps] = src[b, sl + t * num_steps: sl + (t + 1) * num_steps]
    return out


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``address`` (no copy): how the op reaches the buffers."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Copy slot ``src_loc[i]`` to slot ``tgt_loc[i]`` in each of the KV pool's buffers (every layer's K and V).

    data_ptrs: ``[num_buffers]`` uint64 addresses of contiguous CPU buffers whose slots are rows of
    ``strides[b]`` bytes (SGLang asserts contiguity before it hands these over); tgt_loc, src_loc: ``[N]``.
    All sources are read before any target is written (as the tiled kernel does), so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    rows = int(max(tgt.max(), src.max())) + 1  # only the slots up to the highest one touched are viewed
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        slots = _bytes_at(int(address), rows * int(stride)).view(rows, int(stride))
        slots[tgt] = slots[src]  # the right side is gathered into a new tensor first


class _BranchBatch:
    """A draft-decode ``forward_batch`` seen one row per draft branch (request-major, ``bs * topk`` rows over the
    branch table); every other attribute (``out_cache_loc``, set per step) read from the batch itself."""

    def __init__(self, forward_batch, rows: torch.Tensor, lens: torch.Tensor):
        self._batch, self.req_pool_indices, self.seq_lens = forward_batch, rows, lens
        self.seq_lens_cpu, self.batch_size, self.encoder_lens = lens.cpu(), rows.numel(), None

    def __getattr__(self, name):
        return getattr(self._batch, name)


class _DraftStep:
    """One draft-decode step's backend: ours over the branch table, handed the batch as :class:`_BranchBatch`."""

    def __init__(self, backend):
        self.backend, self.rows, self.lens, self._view = backend, None, None, None

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_idle():
            return self.backend.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if self._view is None or self._view._batch is not forward_batch:  # one view (and plan) per forward
            self._view = _BranchBatch(forward_batch, self.rows, self.lens)
        return self.backend.forward(q, k, v, layer, self._view, save_kv_cache, **kwargs)


class DraftDecodeSteps:
    """EAGLE's multi-step draft decode over ``compiled_attn`` (what SGLang's ``IntelAMXMultiStepDraftBackend`` does
    with sgl_kernel): ``attn_backends[i]`` runs draft step ``i`` (of ``speculative_num_steps - 1``) as a decode of
    one row per branch (``bs * topk``) over :func:`build_draft_decode_metadata_cpu`'s table, each row the request's
    prefix and its branch's first ``i + 1`` draft tokens (the one written in this step last)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        from .plugin import create_backend

        self.topk, self.speculative_num_steps = int(topk), int(speculative_num_steps)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.attn_backends = [_DraftStep(create_backend(model_runner)) for _ in range(self.speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.forward_mode.is_idle():
            return
        table = build_draft_decode_metadata_cpu(self.req_to_token, forward_batch.req_pool_indices,
                                                forward_batch.seq_lens, self.topk, self.speculative_num_steps,
                                                self.req_to_token.shape[1])
        pool = types.SimpleNamespace(req_to_token=table)
        rows = torch.arange(table.shape[0], device=forward_batch.seq_lens.device)
        lens = forward_batch.seq_lens.to(torch.int64).repeat_interleave(self.topk)
        for i, step in enumerate(self.attn_backends):
            step.backend.req_to_token_pool = pool  # the backend reads its table through req_to_token_pool
            step.rows, step.lens, step._view = rows, lens + i + 1, None


# The sgl_kernel names SGLang 0.5.23 imports on CPU, answered by the stand-in with these.
OPS = {
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    # EAGLE / EAGLE-3 / multi-layer EAGLE (MTP)
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient_cpu,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous_cpu,
    "fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "rotate_input_ids_cpu": rotate_input_ids_cpu,
    "build_draft_decode_metadata_cpu": build_draft_decode_metadata_cpu,
}
# sgl_kernel.speculative's names (SGLang imports that submodule only for the n-gram tree links).
SPECULATIVE_OPS = {"reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask}
