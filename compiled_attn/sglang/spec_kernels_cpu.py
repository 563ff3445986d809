"""Pure-PyTorch CPU versions of the ``sgl_kernel`` ops SGLang 0.5.23's n-gram speculative decoding calls on CPU.

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

The batches are small (a few requests, a few draft tokens each) and live on the CPU, so the tree walk reads its
inputs into Python lists once instead of launching a tensor op per tree node.
"""

from __future__ import annotations

import ctypes

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
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Pack the slots of the accepted tokens: ``accept_out_cache_loc[:m] = out_cache_loc[accepted]``.

    accept_index: ``[bs, S]`` flat verify rows, -1 = none (read row-major); out_cache_loc: ``[bs * n]`` slots of
    the verify tokens; accept_out_cache_loc: ``[>= m]``, written in place from its start, the rest left as it is.
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    rows = flat[flat >= 0]
    accept_out_cache_loc[: rows.numel()] = out_cache_loc[rows].to(accept_out_cache_loc.dtype)


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


# The sgl_kernel names SGLang 0.5.23 imports at module level on CPU, answered by the stand-in with these.
OPS = {
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}
# sgl_kernel.speculative's names (SGLang imports that submodule only for the n-gram tree links).
SPECULATIVE_OPS = {"reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask}
