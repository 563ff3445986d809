"""``compiled_attn.sglang.spec_kernels_cpu`` (the n-gram speculative ops the ``sgl_kernel`` stand-in answers)
against plain references written here: loops over requests and tree nodes, on random cases and the edges (no
draft accepted, every draft accepted, ``-1`` padding, empty ranges, overlapping slot moves)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from compiled_attn.sglang import cpu_fixups
from compiled_attn.sglang import spec_kernels_cpu as ops

SEEDS = range(20)


# --- references ----------------------------------------------------------------------------------------------


def random_parents(gen: torch.Generator, n: int, forest: bool = False) -> list[int]:
    """A tree over n nodes in draft order (node 0 the root; each parent before its child); ``forest``: some
    later nodes are roots too."""
    parents = [-1]
    for i in range(1, n):
        if forest and torch.rand((), generator=gen) < 0.2:
            parents.append(-1)
        else:
            parents.append(int(torch.randint(0, i, (), generator=gen)))
    return parents


def tree_mask_of(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i marks i and its ancestors (what the n-gram corpus hands SGLang)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def ref_links(parents: list[int], seq_len: int, b: int):
    """positions, retrieve_index, next_token, next_sibling of one request, by walking the parent list."""
    n = len(parents)
    positions, index, first_child, sibling = [], [], [], []
    for i in range(n):
        depth, j = 0, parents[i]
        while j >= 0:
            depth, j = depth + 1, parents[j]
        positions.append(seq_len + depth)
        index.append(b * n + i)
        children = [k for k in range(n) if parents[k] == i]
        first_child.append(children[0] if children else -1)
        later = [k for k in range(i + 1, n) if parents[k] == parents[i]]
        sibling.append(later[0] if later and parents[i] >= 0 else -1)
    return positions, index, first_child, sibling


def ref_walk(parents, cand, target_flat, b, n, max_accept):
    """Accepted flat rows of one request: from the root, the first child (in draft order) whose token equals
    the target's token at the current node."""
    path, node = [b * n], 0
    while len(path) < max_accept:
        want = target_flat[b * n + node]
        match = [k for k in range(n) if parents[k] == node and cand[k] == want]
        if not match:
            break
        node = match[0]
        path.append(b * n + node)
    return path


# --- reconstruct_indices_from_tree_mask ----------------------------------------------------------------------


def _reconstruct(trees: list[list[int]], seq_lens: list[int], spare: int = 3):
    """Runs the op on buffers larger than the batch (as the n-gram worker's preallocated ones); returns them."""
    bs, n = len(trees), len(trees[0])
    mask = torch.zeros((bs + spare) * n * n, dtype=torch.bool)
    if bs:
        mask[: bs * n * n] = torch.stack([tree_mask_of(p) for p in trees]).reshape(-1)
    positions = torch.full(((bs + spare) * n,), -7, dtype=torch.int64)
    bufs = [torch.full((bs + spare, n), -7, dtype=torch.int64) for _ in range(3)]
    ops.reconstruct_indices_from_tree_mask(mask, torch.tensor(seq_lens, dtype=torch.int64), positions[: bs * n],
                                           *(buf[:bs] for buf in bufs), bs, n)
    return positions, bufs


@pytest.mark.parametrize("seed", SEEDS)
def test_reconstruct_indices_matches_parent_walk(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 13, (), generator=gen))
    trees = [random_parents(gen, n, forest=seed % 3 == 0) for _ in range(bs)]
    seq_lens = torch.randint(1, 300, (bs,), generator=gen).tolist()
    positions, (index, next_token, sibling) = _reconstruct(trees, seq_lens)
    for b, parents in enumerate(trees):
        want = ref_links(parents, seq_lens[b], b)
        assert positions[b * n:(b + 1) * n].tolist() == want[0]
        assert index[b].tolist() == want[1]
        assert next_token[b].tolist() == want[2]
        assert sibling[b].tolist() == want[3]
    # nothing past the batch is written
    assert (positions[bs * n:] == -7).all() and all((buf[bs:] == -7).all() for buf in (index, next_token, sibling))


def test_reconstruct_indices_chain_and_empty_batch():
    n = 5
    positions, (index, next_token, sibling) = _reconstruct([[-1, 0, 1, 2, 3]], [10])
    assert positions[:n].tolist() == [10, 11, 12, 13, 14]
    assert next_token[0].tolist() == [1, 2, 3, 4, -1] and sibling[0].tolist() == [-1] * n
    positions, bufs = _reconstruct([[-1]], [3])  # one request with a single (root) token
    assert positions[0] == 3 and bufs[1][0, 0] == -1 and bufs[2][0, 0] == -1
    empty = torch.full((4,), -7, dtype=torch.int64)
    ops.reconstruct_indices_from_tree_mask(torch.zeros(4, dtype=torch.bool), torch.zeros(0, dtype=torch.int64),
                                           empty, empty.view(2, 2), empty.view(2, 2), empty.view(2, 2), 0, 2)
    assert (empty == -7).all()


# --- assign_extend_cache_locs_cpu / assign_req_to_token_pool_cpu ---------------------------------------------


def _table_and_ranges(seed: int, rows: int = 9, width: int = 40):
    """A random [rows, width] int32 slot table and 1-5 requests' ranges ``[start, end)`` of distinct rows (one range
    empty) -> gen, table, rpi, start, end, total length."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 10_000, (rows, width), generator=gen, dtype=torch.int32)
    bs = int(torch.randint(1, 6, (), generator=gen))
    rpi = torch.randperm(rows, generator=gen)[:bs]
    start = torch.randint(0, width // 2, (bs,), generator=gen)
    lens = torch.randint(0, 8, (bs,), generator=gen)
    lens[0] = 0  # an empty range among the others
    return gen, table, rpi, start, start + lens, int(lens.sum())


@pytest.mark.parametrize("seed", SEEDS)
def test_assign_extend_cache_locs_packs_table_ranges(seed):
    _, table, rpi, start, end, total = _table_and_ranges(seed)
    out = torch.full((total + 4,), -7, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rpi, table, start, end, out, table.shape[1])
    want = [int(table[r, s]) for r, a, e in zip(rpi.tolist(), start.tolist(), end.tolist(), strict=True)
            for s in range(a, e)]
    assert out[:total].tolist() == want and (out[total:] == -7).all()


def test_assign_extend_cache_locs_front_of_verify_windows():
    """SGLang's fill_front_out_cache_loc: rows 0..bs-1 of the [bs, k] verify window, the first n[i] of each."""
    window = torch.arange(100, 112, dtype=torch.int64).view(3, 4)
    num_front = torch.tensor([1, 4, 2], dtype=torch.int32)
    out = torch.zeros(12, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(torch.arange(3), window.int(), torch.zeros_like(num_front), num_front, out, 4)
    assert out.tolist() == [100, 104, 105, 106, 107, 108, 109] + [0] * 5


@pytest.mark.parametrize("seed", SEEDS)
def test_assign_req_to_token_pool_writes_ranges_back(seed):
    gen, table, rpi, start, end, total = _table_and_ranges(seed)
    locs = torch.randint(0, 10_000, (total + 3,), generator=gen, dtype=torch.int64)
    want = table.clone()
    pos = 0
    for r, a, e in zip(rpi.tolist(), start.tolist(), end.tolist(), strict=True):
        for s in range(a, e):
            want[r, s] = int(locs[pos])
            pos += 1
    ops.assign_req_to_token_pool_cpu(rpi, table, start, end, locs, table.shape[1])
    assert torch.equal(table, want)


# --- verify_tree_greedy_cpu ----------------------------------------------------------------------------------


def _verify(trees, cand, target, max_accept):
    """Runs the op as eagle_sample calls it (links from reconstruct, accept_index -1, predicts 0)."""
    bs, n = cand.shape
    _, (index, next_token, sibling) = _reconstruct(trees, [0] * bs, spare=0)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, max_accept), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                               candidates=cand, retrive_index=index, retrive_next_token=next_token,
                               retrive_next_sibling=sibling, target_predict=target)
    return predicts, accept_index, accept_num


def _check_verify(trees, cand, target, max_accept):
    bs, n = cand.shape
    predicts, accept_index, accept_num = _verify(trees, cand, target, max_accept)
    target_flat = target.reshape(-1).tolist()
    want_predicts = [0] * (bs * n)
    for b, parents in enumerate(trees):
        path = ref_walk(parents, cand[b].tolist(), target_flat, b, n, max_accept)
        assert accept_index[b].tolist() == path + [-1] * (max_accept - len(path))
        assert int(accept_num[b]) == len(path) - 1
        for row in path:
            want_predicts[row] = target_flat[row]
    assert predicts.tolist() == want_predicts
    return accept_num


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_tree_greedy_matches_walk(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(2, 12, (), generator=gen))
    trees = [random_parents(gen, n) for _ in range(bs)]
    vocab = 3  # small, so that many drafts match (and siblings share tokens: the first in draft order wins)
    cand = torch.randint(0, vocab, (bs, n), generator=gen)
    target = torch.randint(0, vocab, (bs, n), generator=gen)
    _check_verify(trees, cand, target, max_accept=int(torch.randint(1, n + 1, (), generator=gen)))


def test_verify_tree_greedy_none_and_all_accepted():
    n = 6
    chain = [-1, 0, 1, 2, 3, 4]
    cand = torch.tensor([[9, 1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 5]])
    # request 0: the target continues the chain everywhere; request 1: never (no draft accepted)
    target = torch.tensor([[1, 2, 3, 4, 5, 77], [8, 8, 8, 8, 8, 8]])
    num = _check_verify([chain, chain], cand, target, max_accept=n)
    assert num.tolist() == [5, 0]
    num = _check_verify([chain, chain], cand, target, max_accept=3)  # the path is capped at max_accept
    assert num.tolist() == [2, 0]


def test_verify_tree_greedy_picks_matching_sibling():
    tree = [-1, 0, 0, 0, 3, 3]  # root with children 1, 2, 3; node 3 with children 4, 5
    cand = torch.tensor([[0, 10, 11, 12, 20, 21]])
    target = torch.tensor([[12, 0, 0, 21, 0, 5]])  # root -> 3 (token 12) -> 5 (token 21), then bonus 5
    predicts, accept_index, num = _verify([tree], cand, target, 4)
    assert accept_index.tolist() == [[0, 3, 5, -1]] and num.tolist() == [2]
    assert predicts.tolist() == [12, 0, 0, 21, 0, 5]


# --- fill_accept_out_cache_loc_cpu ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_fill_accept_out_cache_loc_packs_accepted_slots(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 8, (), generator=gen))
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    for b in range(bs):
        m = int(torch.randint(0, n + 1, (), generator=gen))  # 0: a row of padding only
        accept_index[b, :m] = (b * n + torch.randperm(n, generator=gen)[:m]).int()
    out_cache_loc = torch.randint(0, 10_000, (bs * n,), generator=gen)
    out = torch.full((bs * n,), -7, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, out)
    want = [int(out_cache_loc[i]) for i in accept_index.reshape(-1).tolist() if i != -1]
    assert out[: len(want)].tolist() == want and (out[len(want):] == -7).all()


# --- copy_all_layer_kv_cache_cpu -----------------------------------------------------------------------------


def _pool(gen, slots: int):
    """Buffers as SGLang's pools hold them: per-layer K and V, contiguous, slot-major, of different row sizes."""
    return [torch.randn(slots, 2, 8, generator=gen), torch.randn(slots, 2, 8, generator=gen).to(torch.bfloat16),
            torch.randint(0, 255, (slots, 1, 24), generator=gen, dtype=torch.uint8)]


def _copy(bufs, tgt, src):
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor(tgt), torch.tensor(src))


@pytest.mark.parametrize("tgt, src", [
    ([0], [0]),                      # SGLang's warm-up copy
    ([3, 9, 4], [12, 1, 4]),
    ([6, 7, 8], [5, 6, 7]),          # overlapping: every source is read before any target is written
    ([5, 6, 7], [6, 7, 8]),
    ([], []),
])
def test_copy_all_layer_kv_cache_moves_slots(tgt, src):
    gen = torch.Generator().manual_seed(0)
    bufs = _pool(gen, 16)
    want = [b.clone() for b in bufs]
    for w, b in zip(want, bufs, strict=True):
        for t, s in zip(tgt, src, strict=True):
            w[t] = b[s]
    _copy(bufs, tgt, src)
    assert all(torch.equal(b, w) for b, w in zip(bufs, want, strict=True))


# --- the stand-in answers these names --------------------------------------------------------------------------


def test_stand_in_answers_spec_ops_and_only_the_speculative_submodule():
    """Checked on the finder itself: installing it would change this process's SGLang mode (cpu_fixups)."""
    finder = cpu_fixups._StandInFinder()
    root = importlib.util.module_from_spec(finder.find_spec("sgl_kernel"))
    for name, fn in ops.OPS.items():
        assert getattr(root, name) is fn
    with pytest.raises(NotImplementedError, match="decode_attention_cpu"):
        root.decode_attention_cpu()
    spec_mod = importlib.util.module_from_spec(finder.find_spec("sgl_kernel.speculative"))
    assert spec_mod.reconstruct_indices_from_tree_mask is ops.reconstruct_indices_from_tree_mask
    assert not hasattr(spec_mod, "verify_tree_greedy")  # `from sgl_kernel.speculative import x` -> ImportError
    for sub in ("sgl_kernel.scalar_type", "sgl_kernel.kvcacheio", "sgl_kernel.flash_attn"):
        assert finder.find_spec(sub) is None
