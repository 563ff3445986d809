"""The EAGLE speculative ops of ``compiled_attn.sglang.spec_kernels_cpu`` (what the ``sgl_kernel`` stand-in answers
for SGLang's EAGLE worker on CPU) against plain references written here (loops over requests, draft candidates and
tree nodes), against SGLang's own triton kernels for the same ops (run through triton's interpreter in a subprocess,
on the same inputs), and ``DraftDecodeSteps`` (the multi-step draft decode over our backend) against a float64
attention over each branch's keys."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from compiled_attn.sglang import cpu_fixups
from compiled_attn.sglang import spec_kernels_cpu as ops

SEEDS = range(16)

# --- references ----------------------------------------------------------------------------------------------


def eagle_draft(gen, topk: int, steps: int, n: int):
    """One request's draft as SGLang's draft_forward + organize_draft_results leave it: candidates by level (``topk``
    children of the root, then ``topk * topk`` per later step, each step expanding the ``topk`` best so far), the
    ``n - 1`` best by cumulative score selected. Returns (parent_list, selected, parent candidate of each candidate)."""
    p0 = torch.rand(topk, generator=gen).sort(descending=True).values
    scores, parent_of = p0.tolist(), [-1] * topk
    parents_list = [list(range(-1, topk))]
    branches, branch_scores = list(range(topk)), p0
    for i in range(1, steps):
        child_p = torch.rand(topk, topk, generator=gen).sort(dim=1, descending=True).values
        expand = (branch_scores[:, None] * child_p).reshape(-1)
        first = topk + (i - 1) * topk * topk  # this level's first candidate id
        parent_of += [branches[j // topk] for j in range(topk * topk)]
        scores += expand.tolist()
        chosen = torch.topk(expand, topk).indices.tolist()
        parents_list.append([first + c for c in chosen])
        branches, branch_scores = [first + c for c in chosen], expand[chosen]
    selected = sorted(torch.topk(torch.tensor(scores), n - 1).indices.tolist())
    flat_parents = [p for level in parents_list[:-1] for p in level]
    return flat_parents, selected, parent_of


def ref_tree(selected, parent_of, depth, n):
    """(mask [n, n], depths [n], first child [n], next sibling [n]) by walking the explicit parents."""
    node_of = {c: i + 1 for i, c in enumerate(selected)}
    parent = [-1] + [0 if parent_of[c] == -1 else node_of.get(parent_of[c], -1) for c in selected]
    mask = [[j == 0 for j in range(n)] for _ in range(n)]
    depths = [0] * n
    for i in range(1, n):
        node = i
        while depths[i] < depth and node > 0:
            mask[i][node] = True
            depths[i], node = depths[i] + 1, parent[node]
    first = [min([c for c in range(1, n) if parent[c] == p], default=-1) for p in range(n)]
    sib = [-1] + [min([c for c in range(i + 1, n) if parent[c] == parent[i]], default=-1) if parent[i] >= 0 else -1
                  for i in range(1, n)]
    return mask, depths, first, sib


def tree_case(seed: int):
    """bs requests' drafts (one topk / steps / n for the batch) and their verified lengths."""
    gen = torch.Generator().manual_seed(seed)
    topk, steps = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 5, (), generator=gen))
    most = topk + (steps - 1) * topk * topk + 1
    n = steps + 1 if topk == 1 else int(torch.randint(2, min(most, 12) + 1, (), generator=gen))
    bs = int(torch.randint(1, 4, (), generator=gen))
    drafts = [eagle_draft(gen, topk, steps, n) for _ in range(bs)]
    seq_lens = torch.randint(1, 40, (bs,), generator=gen)
    parent_list = torch.tensor([d[0] for d in drafts], dtype=torch.int64).reshape(bs, -1)
    selected = torch.tensor([d[1] for d in drafts], dtype=torch.int64).reshape(bs, n - 1)
    return dict(topk=topk, steps=steps, n=n, drafts=drafts, seq_lens=seq_lens, parent_list=parent_list,
                selected=selected)


def run_build_tree(parent_list, selected, seq_lens, topk, depth, n, mode, fn=ops.build_tree_kernel_efficient_cpu):
    """The op on buffers as SGLang's build_tree_kernel_efficient prepares them (mask True, retrieve -1)."""
    bs = seq_lens.shape[0]
    size = bs * n * n + (int(seq_lens.sum()) * n if mode == 0 else 0)
    mask = torch.ones(size, dtype=torch.bool)
    positions = torch.full((bs * n,), -7, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)
    fn(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, depth, n, mode)
    return mask, positions, retrieve


@pytest.mark.parametrize("mode", [1, 0])
@pytest.mark.parametrize("seed", SEEDS)
def test_build_tree_matches_parent_walk(seed, mode):
    c = tree_case(seed)
    n, lens = c["n"], c["seq_lens"].tolist()
    mask, positions, (index, first, sib) = run_build_tree(c["parent_list"], c["selected"], c["seq_lens"],
                                                          c["topk"], c["steps"], n, mode)
    start = 0
    for b, (_, selected, parent_of) in enumerate(c["drafts"]):
        want_mask, depths, want_first, want_sib = ref_tree(selected, parent_of, c["steps"], n)
        if mode == 1:
            rows = mask[b * n * n:(b + 1) * n * n].view(n, n)
        else:  # FULL_MASK: [n, seq_len + n] per request, the prefix columns left as the caller filled them
            full = mask[start:start + n * (lens[b] + n)].view(n, lens[b] + n)
            assert full[:, :lens[b]].all()
            rows, start = full[:, lens[b]:], start + n * (lens[b] + n)
        assert rows.tolist() == want_mask
        assert positions[b * n:(b + 1) * n].tolist() == [lens[b] + d for d in depths]
        assert index[b].tolist() == list(range(b * n, (b + 1) * n))
        assert first[b].tolist() == want_first and sib[b].tolist() == want_sib


def test_build_tree_unselected_parent_and_depth_bound():
    """A candidate whose parent was not selected stays unlinked and its ancestor walk stops there (as SGLang's
    kernel); the walk is cut after ``depth`` steps."""
    topk, n = 2, 4
    # candidates: 0, 1 (root's children); 2..5 children of 0 (2, 3) and 1 (4, 5) -> parent_list [-1, 0, 1]
    parent_list = torch.tensor([[-1, 0, 1]])
    mask, positions, (_, first, sib) = run_build_tree(parent_list, torch.tensor([[0, 2, 4]]), torch.tensor([5]),
                                                      topk, 2, n, 1)
    # node 3 is candidate 4, whose parent (candidate 1) is not among the nodes
    assert first[0].tolist() == [1, 2, -1, -1] and sib[0].tolist() == [-1] * 4
    assert mask.view(n, n)[3].tolist() == [True, False, False, True] and positions[3] == 5 + 1
    mask, positions, _ = run_build_tree(parent_list, torch.tensor([[0, 2, 3]]), torch.tensor([5]), topk, 1, n, 1)
    assert mask.view(n, n)[2].tolist() == [True, False, True, False] and positions[2] == 5 + 1  # cut at depth 1
    with pytest.raises(NotImplementedError, match="QLEN_ONLY_BITPACKING"):
        ops.build_tree_kernel_efficient_cpu(parent_list, torch.tensor([[0, 2, 3]]), torch.tensor([5]),
                                            *([torch.zeros(16)] * 5), topk, 2, n, 2)


# --- the slot, token and table ops ----------------------------------------------------------------------------


def slot_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, width, bs = 9, 64, int(torch.randint(1, 5, (), generator=gen))
    table = torch.randint(0, 10_000, (rows, width), generator=gen, dtype=torch.int32)
    rpi = torch.randperm(rows, generator=gen)[:bs]
    topk, steps = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
    seq_lens = torch.randint(1, width - topk * steps, (bs,), generator=gen)
    return gen, table, rpi, seq_lens, topk, steps


@pytest.mark.parametrize("seed", SEEDS)
def test_assign_draft_cache_locs_contiguous_reads_after_prefix(seed):
    _, table, rpi, seq_lens, topk, steps = slot_case(seed)
    m = topk * steps
    out = torch.full((rpi.numel() * m + 3,), -7, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rpi, table, seq_lens, out, table.shape[1], topk, steps)
    want = [int(table[r, s + j]) for r, s in zip(rpi.tolist(), seq_lens.tolist(), strict=True) for j in range(m)]
    assert out[:len(want)].tolist() == want and (out[len(want):] == -7).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_build_draft_decode_metadata_rows_per_branch(seed):
    _, table, rpi, seq_lens, topk, steps = slot_case(seed)
    out = ops.build_draft_decode_metadata_cpu(table, rpi, seq_lens, topk, steps, table.shape[1])
    assert out.shape == (rpi.numel() * topk, table.shape[1]) and out.dtype == table.dtype
    for b, (r, s) in enumerate(zip(rpi.tolist(), seq_lens.tolist(), strict=True)):
        for t in range(topk):
            row = out[b * topk + t].tolist()
            assert row[:s] == table[r, :s].tolist()
            assert row[s:s + steps] == [int(table[r, s + t * steps + j]) for j in range(steps)]


@pytest.mark.parametrize("seed", SEEDS)
def test_fill_bonus_tokens_takes_last_accepted(seed):
    gen = torch.Generator().manual_seed(seed)
    bs, stride = int(torch.randint(1, 6, (), generator=gen)), int(torch.randint(1, 6, (), generator=gen))
    tokens = torch.randint(0, 1000, (bs, stride), generator=gen, dtype=torch.int32)
    lens = torch.randint(1, stride + 1, (bs,), generator=gen, dtype=torch.int32)
    bonus = torch.full((bs + 2,), -7, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(tokens, lens, bonus, stride)
    assert bonus.tolist() == [int(tokens[b, int(lens[b]) - 1]) for b in range(bs)] + [-7, -7]


@pytest.mark.parametrize("select", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_rotate_input_ids_shifts_each_request(seed, select):
    gen = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(1, 5, (), generator=gen))
    lens = torch.randint(0, 7, (bs,), generator=gen)
    starts = torch.cumsum(lens, 0) - lens
    ids = torch.randint(0, 1000, (int(lens.sum()) + 2,), generator=gen)
    new = torch.randint(1000, 2000, (bs,), generator=gen)
    sel = (starts + torch.randint(0, 7, (bs,), generator=gen) % lens.clamp_min(1)) if select else None
    want = ids.tolist()
    for b, (s, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        want[s:s + n - 1] = ids[s + 1:s + n].tolist() if n > 1 else want[s:s + n - 1]
        if n > 0:
            want[int(sel[b]) if select else s + n - 1] = int(new[b])
    ops.rotate_input_ids_cpu(ids, starts, lens, new, sel)
    assert ids.tolist() == want


def test_fill_accept_out_cache_loc_reads_size_entries():
    accept_index = torch.tensor([[0, 2, -1], [3, 5, 4]], dtype=torch.int32)
    locs = torch.arange(100, 106)
    out = torch.full((6,), -7, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, locs, out, 4)  # the first 4 entries: rows 0, 2, 3
    assert out.tolist() == [100, 102, 103, -7, -7, -7]


def test_stand_in_answers_the_eagle_ops():
    root = importlib.util.module_from_spec(cpu_fixups._StandInFinder().find_spec("sgl_kernel"))
    for name in ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu",
                 "assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
                 "rotate_input_ids_cpu", "build_draft_decode_metadata_cpu"):
        assert getattr(root, name) is ops.OPS[name]


# --- SGLang's own triton kernels, interpreted, on the same inputs ---------------------------------------------

ORACLE = r"""
import importlib.util, os, sys, torch
from compiled_attn.sglang.cpu_fixups import ensure_torchvision_importable
ensure_torchvision_importable()
import sglang
base = os.path.join(os.path.dirname(sglang.__file__), "kernels", "ops", "speculative")
def load(name):  # a fresh module: its kernels decorated under TRITON_INTERPRET=1
    spec = importlib.util.spec_from_file_location("oracle_" + name, os.path.join(base, name + ".py"))
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod
tree, eagle, locs, rotate = load("spec_tree"), load("eagle"), load("cache_locs"), load("multi_layer_eagle")
cases, out = torch.load(sys.argv[1]), {}
for key, c in cases.items():
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    if key[0] == "tree":
        tree.sgl_build_tree_kernel_triton(c["parent_list"], c["selected"], c["seq_lens"], c["mask"], c["positions"],
                                          *c["retrieve"], c["topk"], c["steps"], c["n"], tree.TreeMaskMode(c["mode"]))
        out[key] = [c["mask"], c["positions"], c["retrieve"]]
    elif key[0] == "verify":
        tree.verify_tree_greedy_triton(c["predicts"], c["accept_index"], c["accept_num"], c["candidates"],
                                       *c["retrieve"], c["target"])
        out[key] = [c["predicts"], c["accept_index"], c["accept_num"]]
    elif key[0] == "draft_locs":
        bs = c["rpi"].numel()
        locs.assign_draft_cache_locs_contiguous[(bs,)](c["rpi"], c["table"], c["seq_lens"], c["out"],
                                                       c["table"].shape[1], c["topk"], c["steps"], BS=bs)
        out[key] = [c["out"]]
    elif key[0] == "bonus":
        eagle.fill_bonus_tokens[(c["lens"].numel(),)](c["tokens"], c["lens"], c["out"], c["tokens"].shape[1])
        out[key] = [c["out"]]
    elif key[0] == "rotate":
        rotate.rotate_input_ids(c["ids"], c["starts"], c["lens"], c["new"], c.get("select"))
        out[key] = [c["ids"]]
torch.save(out, sys.argv[2])
"""


def oracle_cases() -> dict:
    """{key: the inputs and output buffers of one call} for the oracle and :func:`run_ours` alike."""
    cases = {}
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        for mode in (0, 1):
            c = tree_case(seed)
            bs, n = c["seq_lens"].shape[0], c["n"]
            size = bs * n * n + (int(c["seq_lens"].sum()) * n if mode == 0 else 0)
            cases[("tree", seed, mode)] = dict(
                parent_list=c["parent_list"], selected=c["selected"], seq_lens=c["seq_lens"], topk=c["topk"],
                steps=c["steps"], n=n, mode=mode, mask=torch.ones(size, dtype=torch.bool),
                positions=torch.full((bs * n,), -7), retrieve=torch.full((3, bs, n), -1))
        if seed % 2:  # greedy verify over the trees built above, tokens from a tiny vocabulary (many matches)
            _, _, retrieve = run_build_tree(c["parent_list"], c["selected"], c["seq_lens"], c["topk"], c["steps"],
                                            n, 1)
            cases[("verify", seed)] = dict(
                predicts=torch.zeros(bs * n, dtype=torch.int32), accept_index=torch.full(
                    (bs, c["steps"] + 1), -1, dtype=torch.int32), accept_num=torch.zeros(bs, dtype=torch.int32),
                candidates=torch.randint(0, 3, (bs, n), generator=gen), retrieve=retrieve,
                target=torch.randint(0, 3, (bs, n), generator=gen))
        _, table, rpi, seq_lens, topk, steps = slot_case(seed)
        cases[("draft_locs", seed)] = dict(table=table, rpi=rpi, seq_lens=seq_lens, topk=topk, steps=steps,
                                           out=torch.full((rpi.numel() * topk * steps,), -7, dtype=torch.int64))
        cases[("bonus", seed)] = dict(tokens=torch.randint(0, 1000, (3, 5), generator=gen, dtype=torch.int32),
                                      lens=torch.randint(1, 6, (3,), generator=gen, dtype=torch.int32),
                                      out=torch.full((3,), -7, dtype=torch.int32))
        lens = torch.randint(0, 6, (3,), generator=gen)
        starts = torch.cumsum(lens, 0) - lens
        cases[("rotate", seed)] = dict(ids=torch.randint(0, 1000, (int(lens.sum()) + 1,), generator=gen),
                                       starts=starts, lens=lens, new=torch.randint(1000, 2000, (3,), generator=gen))
    return cases


def run_ours(key, c) -> list:
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    if key[0] == "tree":
        ops.build_tree_kernel_efficient_cpu(c["parent_list"], c["selected"], c["seq_lens"], c["mask"],
                                            c["positions"], *c["retrieve"], c["topk"], c["steps"], c["n"], c["mode"])
        return [c["mask"], c["positions"], c["retrieve"]]
    if key[0] == "verify":
        ops.verify_tree_greedy_cpu(c["predicts"], c["accept_index"], c["accept_num"], c["candidates"], *c["retrieve"],
                                   c["target"])
        return [c["predicts"], c["accept_index"], c["accept_num"]]
    if key[0] == "draft_locs":
        ops.assign_draft_cache_locs_contiguous_cpu(c["rpi"], c["table"], c["seq_lens"], c["out"],
                                                   c["table"].shape[1], c["topk"], c["steps"])
        return [c["out"]]
    if key[0] == "bonus":
        ops.fill_bonus_tokens_cpu(c["tokens"], c["lens"], c["out"], c["tokens"].shape[1])
        return [c["out"]]
    ops.rotate_input_ids_cpu(c["ids"], c["starts"], c["lens"], c["new"])
    return [c["ids"]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """Runs SGLang's kernels on :func:`oracle_cases` in one subprocess with ``TRITON_INTERPRET=1`` set before triton
    is imported (a kernel decorated for a GPU cannot run here); returns (cases, ``{key: outputs}``)."""
    pytest.importorskip("triton")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs SGLang (its triton kernels are the oracle)")
    cases = oracle_cases()
    tmp = tmp_path_factory.mktemp("oracle")
    torch.save(cases, tmp / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # SGLang's generic (triton) path, not its CPU one
    res = subprocess.run([sys.executable, "-c", ORACLE, str(tmp / "in.pt"), str(tmp / "out.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return cases, torch.load(tmp / "out.pt")


def test_ops_equal_sglang_triton_kernels(oracle):
    cases, want = oracle
    assert {k[0] for k in cases} == {"tree", "verify", "draft_locs", "bonus", "rotate"}
    for key, c in cases.items():
        got = run_ours(key, c)
        assert all(torch.equal(g, w) for g, w in zip(got, want[key], strict=True)), key


# --- DraftDecodeSteps: the multi-step draft decode over our backend -------------------------------------------


@pytest.mark.parametrize("geom, topk", [("gqa", 1), ("gqa", 3), ("mla_absorbed", 2)])
def test_draft_decode_steps_attend_prefix_and_own_branch(geom, topk):
    """Step i of a draft (one row per branch, ``bs * topk``): each row's query over its request's prefix and its own
    branch's draft keys of steps 0..i (written by this and the earlier steps at the slots SGLang's
    ``assign_draft_cache_locs_contiguous`` hands out), as a float64 attention computes it."""
    H = pytest.importorskip("compiled_attn.sglang.testing")
    H.ensure_sglang_importable()
    pytest.importorskip("sglang")
    sg = H.import_sglang()
    g, prefix, steps = H.GEOMETRIES[geom], [5, 11], 3
    mr = H.make_model_runner(g, seed=21)
    # rows and slots: each request's prefix (K/V in the pool) and then topk * steps draft slots, branch-major
    batch = H.make_extend_batch(mr, [topk * steps] * len(prefix), prefix)
    bs, rows = len(prefix), batch.req_pool_indices
    lens = torch.tensor(prefix, dtype=torch.int64)
    draft_slots = batch.out_cache_loc.view(bs, topk, steps)
    fb = sg.ForwardBatch(forward_mode=sg.ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs * topk,
                         dtype=torch.int64), req_pool_indices=rows, seq_lens=lens, out_cache_loc=None,
                         seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone(),
                         positions=lens.repeat_interleave(topk))
    draft = ops.DraftDecodeSteps(mr, topk, steps)
    assert len(draft.attn_backends) == steps - 1
    draft.init_forward_metadata(fb)
    layer, gen, table = H.make_layer(g), torch.Generator().manual_seed(5), mr.req_to_token_pool.req_to_token
    for i, step in enumerate(draft.attn_backends):
        fb.out_cache_loc = draft_slots[:, :, i].reshape(-1)  # as draft_forward sets it per step
        q = torch.randn(bs * topk, g.num_heads * g.head_dim, generator=gen)
        k = torch.randn(bs * topk, g.num_kv_heads, g.head_dim, generator=gen)
        v = k[..., :g.v_head_dim].clone() if g.mla else torch.randn(bs * topk, g.num_kv_heads, g.v_head_dim,
                                                                    generator=gen)
        out, _ = H.run_sglang_layer(step, layer, fb, q, k.reshape(bs * topk, -1), v.reshape(bs * topk, -1),
                                    init_metadata=False)
        for r in range(bs * topk):
            b, t = divmod(r, topk)
            slots = torch.cat([table[rows[b], :prefix[b]].long(), draft_slots[b, t, :i + 1]])
            kk, vv = (x.double().repeat_interleave(g.group_size, 1) for x in H.read_kv(mr, 0, slots))
            s = torch.einsum("hd,khd->hk", q[r].double().view(g.num_heads, -1), kk) * g.sm_scale
            want = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv).reshape(-1)
            torch.testing.assert_close(out[r].double(), want, atol=1e-4, rtol=0)


def test_eagle_draft_backends_fixup_adds_ours_to_sglangs_tables(monkeypatch):
    """SGLang's DraftBackendFactory knows backends by name: the fix-up answers ``compiled_attn`` with our backend
    (draft extend) and DraftDecodeSteps (multi-step draft decode); other names still get SGLang's error."""
    H = pytest.importorskip("compiled_attn.sglang.testing")
    H.ensure_sglang_importable()
    pytest.importorskip("sglang")
    from sglang.srt.speculative import draft_utils

    from compiled_attn.sglang.backend import CompiledAttnBackend

    monkeypatch.setattr(draft_utils.DraftBackendFactory, "_create_backend",
                        draft_utils.DraftBackendFactory._create_backend)  # the patch is undone afterwards
    assert cpu_fixups.eagle_draft_backends() and not cpu_fixups.eagle_draft_backends()  # once
    monkeypatch.setattr(draft_utils, "attention_backends", lambda: ("compiled_attn", "compiled_attn"))
    mr = H.make_model_runner(H.GEOMETRIES["gqa"])
    mr.draft_attention_backend, mr.model_config.hf_text_config = None, object()
    factory = draft_utils.DraftBackendFactory(mr, topk=2, speculative_num_steps=3)
    extend = factory._create_backend("prefill_attention_backend", {}, "no {backend_type}")
    steps = factory._create_backend("decode_attention_backend", {}, "no {backend_type}", stamps_children=True)
    assert isinstance(extend, CompiledAttnBackend) and extend.prefill_attention_backend_str == "compiled_attn"
    assert isinstance(steps, ops.DraftDecodeSteps) and len(steps.attn_backends) == 2
    factory.draft_attn_backend = "nope"  # --speculative-draft-attention-backend nope
    with pytest.raises(ValueError, match="no nope"):
        factory._create_backend("prefill_attention_backend", {}, "no {backend_type}")
