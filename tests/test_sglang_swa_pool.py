"""Our SGLang backend over SGLang's hybrid sliding-window memory (``SWAKVPool``, gpt-oss's default): window layers
keep their K/V in a smaller pool of their own, reached through the pool's full-to-window slot mapping; full layers
read the full pool.

Each case builds an ``SWAKVPool``-backed stand-in (``testing.swa``: layers 0 and 2 windowed, layer 1 full, as
gpt-oss alternates them), frees every request's positions below its first query's window from the window pool (the
mapping entry back to 0, as SGLang's eviction; paged: whole pages) and fills with NaN every window-pool slot no
request keeps and every full-pool slot no request owns; then decode, extend with a prefix and ``TARGET_VERIFY``
(chain and tree) run through ``CompiledAttnBackend`` layer by layer, eagerly and in the graph hooks' order (CUDA
graph runner: ``init_cuda_graph_state``, out-of-graph, in-graph; CPU graph runner: the index built inside its
compiled forward, ``fullgraph``), and must equal a float64 reference written here (per request: each query's keys
gathered by position through the mapping, the window mask, softmax with the sinks). The slot translation itself,
the Triton form's table of translated slots (through Triton's interpreter) and the pools refused at start-up too.
Skipped where SGLang isn't installed.
"""
from types import SimpleNamespace

import pytest
import torch

import compiled_attn.sglang.testing as H

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from compiled_attn.bench.ops_verify import random_tree  # noqa: E402
from compiled_attn.decode import SlotMap, build_decode_index, decode_blocks, translate_slots  # noqa: E402
from compiled_attn.plan import plan_decode  # noqa: E402
from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402
from compiled_attn.sglang.speculative import mask_layout  # noqa: E402
from compiled_attn.verify import build_verify_index, chain_mask, plan_verify, verify_blocks  # noqa: E402

SG = H.import_sglang()
G = H.gqa(num_heads=8, num_kv_heads=2, head_dim=32)
W = 12  # the window layers' sliding_window_size: a query at p sees keys p - W .. p
WINDOWS = (W, None, W)
K = 4  # draft tokens per request (TARGET_VERIFY)
SINKS = torch.linspace(-1.5, 1.5, G.num_heads)
ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DECODE_LENS = [7, 1, 40, 13, 90, 25]
EXT_LENS, PREFIX_LENS = [5, 1, 17, 30], [3, 40, 0, 24]
VERIFY_PREFIX = [5, 0, 40, 17]


def _runner(seed, page_size=1, dtype=torch.float32):
    # a window pool smaller than the full pool's slot numbers: an untranslated read would leave it or hit a NaN
    return H.make_swa_model_runner(G, WINDOWS, swa_pool_size=512, pool_size=2048, max_context_len=256, max_num_reqs=32,
                                   page_size=page_size, dtype=dtype, seed=seed)


def _layers():
    return [H.make_layer(G, i, -1 if w is None else w) for i, w in enumerate(WINDOWS)]


def _free_and_poison(mr, batch, first_query, owned_lens):
    """Free each request's positions below its first query's window from the window pool, then poison."""
    table = mr.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices[:batch.num_real_reqs].tolist()
    for row, p in zip(rows, first_query, strict=True):
        mr.swa_memory.free_below(table, row, p - W)
    mr.swa_memory.poison(table, rows, owned_lens)


def _run(backend, batch, layers, sinks=None, init=True):
    outs = []
    for n, layer in enumerate(layers):
        ld = batch.layers[layer.layer_id]
        extra = {} if sinks is None else {"sinks": sinks.to(ld.q.dtype)}
        outs.append(H.run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v,
                                       init_metadata=init and n == 0, **extra)[0])
    return outs


def _reference(mr, batch, layer_id, queries, sinks=None):
    """float64. queries: per query token (request row, its position, [(table position, key position), ...]: the
    candidate keys). A window layer reads a key's K/V at the mapping's slot of its table entry, a full layer at the
    entry; the key is seen if at or after the query's window start; sinks: one more softmax column per head."""
    pool, table = mr.token_to_kv_pool, mr.req_to_token_pool.req_to_token
    window = WINDOWS[layer_id]
    k_buf, v_buf = pool.get_key_buffer(layer_id).double(), pool.get_value_buffer(layer_id).double()
    q_all = batch.layers[layer_id].q.double().view(-1, G.num_heads, G.head_dim)
    out = []
    for t, (row, qpos, keys) in enumerate(queries):
        seen = [tp for tp, kp in keys if window is None or kp >= qpos - window]
        slots = table[row, seen].to(torch.int64)
        if window is not None:
            slots = mr.swa_memory.mapping[slots]
            assert bool((slots > 0).all()), "the reference reads a position the window pool freed"
        k = k_buf[slots].repeat_interleave(G.group_size, 1)  # [n, H, D]
        v = v_buf[slots].repeat_interleave(G.group_size, 1)
        s = torch.einsum("hd,nhd->hn", q_all[t], k) * G.sm_scale
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        w = torch.softmax(s, -1)[:, :slots.shape[0]]
        out.append(torch.einsum("hn,nhd->hd", w, v).reshape(-1))
    return torch.stack(out)


def _causal_queries(batch, prefix_lens, new_lens):
    rows = batch.req_pool_indices.tolist()
    return [(rows[b], p, [(j, j) for j in range(p + 1)])
            for b, (pre, n) in enumerate(zip(prefix_lens, new_lens, strict=True)) for p in range(pre, pre + n)]


def _check(mr, batch, outs, queries, sinks, dtype=torch.float32):
    n = len(queries)
    for lid, out in enumerate(outs):
        ref = _reference(mr, batch, lid, queries, sinks)
        assert torch.isfinite(out[:n]).all()
        torch.testing.assert_close(out[:n].double(), ref, atol=ATOL[dtype], rtol=0)
        # the new tokens' K/V went to out_cache_loc, a window layer's to its mapped slots
        k_new, v_new = H.read_kv(mr, lid, batch.out_cache_loc[:n])
        ld = batch.layers[lid]
        assert torch.equal(k_new.reshape(n, -1), ld.k[:n]) and torch.equal(v_new.reshape(n, -1), ld.v[:n])


# ---------------------------------------------------------------------------------------- decode and extend


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["plain", "sinks"])
def test_decode_reads_window_layers_through_the_mapping(sinks, page_size):
    mr = _runner(31, page_size)
    batch = H.make_decode_batch(mr, DECODE_LENS, layer_ids=(0, 1, 2))
    _free_and_poison(mr, batch, [n - 1 for n in DECODE_LENS], DECODE_LENS)
    outs = _run(CompiledAttnBackend(mr), batch, _layers(), sinks)
    _check(mr, batch, outs, _causal_queries(batch, [n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS)), sinks)


def test_decode_batch_of_one_and_bf16():
    """A batch of one (its index built on the host) and a bf16 model, sinks on."""
    for lens, dtype in (([70], torch.float32), (DECODE_LENS, torch.bfloat16)):
        mr = _runner(32, dtype=dtype)
        batch = H.make_decode_batch(mr, lens, layer_ids=(0, 1, 2))
        _free_and_poison(mr, batch, [n - 1 for n in lens], lens)
        outs = _run(CompiledAttnBackend(mr), batch, _layers(), SINKS)
        _check(mr, batch, outs, _causal_queries(batch, [n - 1 for n in lens], [1] * len(lens)), SINKS, dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_prefix_reads_window_layers_through_the_mapping(page_size):
    mr = _runner(33, page_size)
    batch = H.make_extend_batch(mr, EXT_LENS, PREFIX_LENS, layer_ids=(0, 1, 2))
    lens = [p + e for p, e in zip(PREFIX_LENS, EXT_LENS, strict=True)]
    _free_and_poison(mr, batch, PREFIX_LENS, lens)
    outs = _run(CompiledAttnBackend(mr), batch, _layers(), SINKS)
    _check(mr, batch, outs, _causal_queries(batch, PREFIX_LENS, EXT_LENS), SINKS)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_freed_mapping_entries_never_reach_a_read(graph):
    """The mapping entries of freed positions set to values outside the window pool (-1, past its end): the windows
    never read them, and the translation clamps whatever it reads into the pool (a graph's unused blocks look up
    position 0 of the last row, here a real one, whose entry is such a value)."""
    mr = _runner(34)
    batch = H.make_decode_batch(mr, DECODE_LENS, layer_ids=(0, 1, 2))
    table = mr.req_to_token_pool.req_to_token
    _free_and_poison(mr, batch, [n - 1 for n in DECODE_LENS], DECODE_LENS)
    for row, n in zip(batch.req_pool_indices.tolist(), DECODE_LENS, strict=True):
        freed = table[row, :max(n - 1 - W, 0)].to(torch.int64)
        mr.swa_memory.mapping[freed] = torch.tensor([-1, 10**6])[torch.arange(freed.numel()) % 2]
    backend = CompiledAttnBackend(mr)
    if graph:  # the CUDA graph runner's order, a full bucket (no padding row)
        backend.init_cuda_graph_state(len(DECODE_LENS), len(DECODE_LENS))
        with H.parallel_scope():
            backend.init_forward_metadata_out_graph(_view(batch.forward_batch))
            backend.init_forward_metadata_in_graph(batch.forward_batch)
    outs = _run(backend, batch, _layers(), init=not graph)
    for row, n in zip(batch.req_pool_indices.tolist(), DECODE_LENS, strict=True):  # back to 0 for the reference
        mr.swa_memory.mapping[table[row, :max(n - 1 - W, 0)].to(torch.int64)] = 0
    _check(mr, batch, outs, _causal_queries(batch, [n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS)), None)


def test_translate_slots_stays_inside_the_pool():
    table = torch.tensor([0, 5, 9, 3, -1])  # SGLang's layout: entries, then the -1 sentinel
    got = translate_slots(torch.tensor([[1, 2, -3], [4, 70, 3]]), SlotMap(table, 8))
    assert got.tolist() == [[5, 7, 0], [0, 0, 3]]  # 9 and the sentinel clamped into [0, 8); slots into the table
    assert translate_slots(torch.tensor([4]), None).tolist() == [4]


# ---------------------------------------------------------------------------------------- TARGET_VERIFY


def _verify_batch(mr, prefix, spec):
    b = H.make_extend_batch(mr, [K] * len(prefix), prefix, layer_ids=(0, 1, 2))
    lens = torch.tensor(prefix, dtype=torch.int64)
    b.forward_batch = SG.ForwardBatch(
        forward_mode=SG.ForwardMode.TARGET_VERIFY, batch_size=len(prefix),
        input_ids=torch.zeros(len(prefix) * K, dtype=torch.int64), req_pool_indices=b.req_pool_indices,
        seq_lens=lens, out_cache_loc=b.out_cache_loc, seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.clone(),
        positions=b.positions, spec_info=spec)
    return b


def _verify_case(mr, prefix, tree, seed):
    """(batch, queries): a chain or random trees, the spec_info SGLang hands, freed and poisoned pools."""
    if tree:
        gen = torch.Generator().manual_seed(seed)
        masks = torch.stack([random_tree(K, gen) for _ in prefix])
        flat = masks.reshape(-1)
        if mask_layout(torch.device("cpu")) == "full":
            flat = torch.cat([torch.cat([torch.ones(K, p, dtype=torch.bool), m], 1).reshape(-1)
                              for p, m in zip(prefix, masks, strict=True)])
        spec = SimpleNamespace(draft_token_num=K, topk=4, custom_mask=flat)
    else:
        masks, spec = chain_mask(len(prefix), K), SimpleNamespace(draft_token_num=K, topk=1, custom_mask=None)
    batch = _verify_batch(mr, prefix, spec)
    _free_and_poison(mr, batch, prefix, [p + K for p in prefix])
    rows, queries = batch.req_pool_indices.tolist(), []
    for b, p in enumerate(prefix):  # draft token i sits at p + its depth and sees its ancestors (and itself)
        depth = masks[b].sum(-1) - 1
        for i in range(K):
            keys = [(j, j) for j in range(p)] + [(p + c, p + int(depth[c])) for c in range(K) if masks[b, i, c]]
            queries.append((rows[b], p + int(depth[i]), keys))
    return batch, queries


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_target_verify_reads_window_layers_through_the_mapping(tree, page_size):
    mr = _runner(35, page_size)
    batch, queries = _verify_case(mr, VERIFY_PREFIX, tree, 3)
    outs = _run(CompiledAttnBackend(mr), batch, _layers(), SINKS)
    _check(mr, batch, outs, queries, SINKS)


def test_target_verify_bf16():
    """bf16: 16 query rows per KV head (4 drafts x 4 heads per KV head), the C++ kernel's tile or wide path."""
    mr = _runner(36, dtype=torch.bfloat16)
    batch, queries = _verify_case(mr, VERIFY_PREFIX, True, 4)
    outs = _run(CompiledAttnBackend(mr), batch, _layers(), SINKS)
    _check(mr, batch, outs, queries, SINKS, torch.bfloat16)


# ---------------------------------------------------------------------------------------- graph hooks


def _view(fb):
    """What SGLang's decode graph runner hands init_forward_metadata_out_graph at replay (build_replay_fb_view)."""
    return SimpleNamespace(batch_size=fb.batch_size, forward_mode=fb.forward_mode, req_pool_indices=fb.req_pool_indices,
                           seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, seq_lens_sum=fb.seq_lens_sum,
                           encoder_lens=None, out_cache_loc=fb.out_cache_loc, positions=fb.positions)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_hooks(page_size):
    """The CUDA graph runner's order (static buffers of 8 rows, the batch padded: row 0, seq_len 1, slot 0): its
    index recorded with the translation, two forwards through the same buffers (the second's windows moved on)."""
    mr = _runner(37, page_size)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(8, 8)
    for lens in (DECODE_LENS, [n + 30 for n in DECODE_LENS[:4]]):
        batch = H.make_decode_batch(mr, lens, layer_ids=(0, 1, 2), pad_to_bs=8, seq_len_fill_value=1)
        _free_and_poison(mr, batch, [n - 1 for n in lens], lens)
        fb = batch.forward_batch
        with H.parallel_scope():
            backend.init_forward_metadata_out_graph(_view(fb), in_capture=False)
            backend.init_forward_metadata_in_graph(fb)
        assert backend.forward_metadata.static
        outs = _run(backend, batch, _layers(), SINKS, init=False)
        _check(mr, batch, outs, _causal_queries(batch, [n - 1 for n in lens], [1] * len(lens)), SINKS)
    assert (W, False, True) in backend.decode_keys and (None, False) in backend.decode_keys


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False)
def test_cpu_graph_runner_compiles_the_translation_in_one_graph():
    """CPUGraphRunner's order: metadata eagerly (static buffers), then the whole forward compiled (fullgraph here):
    the window layers' index and write location translated inside it. The first forward learns the window layers'
    configuration (in SGLang the capture's run), which recompiles once; later batches do not."""
    mr = _runner(38)
    backend = CompiledAttnBackend(mr)
    backend.init_cpu_graph_state(8, 8)
    layers, compiles, counts = _layers(), [], []

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def forward(qkv, fb, sinks):
        return [backend.forward_decode(q, k, v, layer, fb, sinks=sinks) for layer, (q, k, v) in zip(layers, qkv,
                                                                                                   strict=True)]

    torch._dynamo.reset()
    step = torch.compile(forward, fullgraph=True, dynamic=False, backend=count)
    for lens in (DECODE_LENS, [n + 3 for n in DECODE_LENS[::-1]], [n + 20 for n in DECODE_LENS[1:]]):
        batch = H.make_decode_batch(mr, lens, layer_ids=(0, 1, 2), pad_to_bs=8)
        _free_and_poison(mr, batch, [n - 1 for n in lens], lens)
        fb = batch.forward_batch
        qkv = [(ld.q, ld.k.view(8, G.num_kv_heads, G.head_dim), ld.v.view(8, G.num_kv_heads, G.v_head_dim))
               for ld in (batch.layers[i] for i in range(3))]
        with H.parallel_scope():
            backend.init_forward_metadata(fb)
            assert backend.forward_metadata.static and not backend.forward_metadata.decode
            with SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
                outs = step(qkv, fb, SINKS)
        _check(mr, batch, outs, _causal_queries(batch, [n - 1 for n in lens], [1] * len(lens)), SINKS)
        counts.append(len(compiles))
    assert counts[1] == counts[2] <= 2


@pytest.mark.parametrize("page_size", [1, 16])
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False)
def test_target_verify_graph_hooks(page_size):
    """TARGET_VERIFY as SGLang's CUDA graph runner captures it: the out-of-graph hook, then the recorded part (the
    in-graph hook and the layers) compiled with fullgraph (pure tensor code, static shapes), on a tree batch."""
    mr = _runner(39, page_size)
    backend = CompiledAttnBackend(mr)
    backend.init_cuda_graph_state(len(VERIFY_PREFIX), len(VERIFY_PREFIX) * K)
    batch, queries = _verify_case(mr, VERIFY_PREFIX, True, 5)
    fb, layers, compiles = batch.forward_batch, _layers(), []

    qkv = [(ld.q, ld.k.view(-1, G.num_kv_heads, G.head_dim), ld.v.view(-1, G.num_kv_heads, G.v_head_dim))
           for ld in (batch.layers[i] for i in range(3))]

    def recorded():
        backend.init_forward_metadata_in_graph(fb)
        return [backend.forward(q, k, v, layer, fb, sinks=SINKS) for layer, (q, k, v) in zip(layers, qkv, strict=True)]

    def count(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with H.parallel_scope(), SG.forward_context(SG.ForwardContext(attn_backend=backend), forward_batch=fb):
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        outs = torch.compile(recorded, fullgraph=True, dynamic=False, backend=count)()
    assert len(compiles) == 1
    _check(mr, batch, outs, queries, SINKS)


# ---------------------------------------------------------------------------------------- Triton form, refusals


def _window_pool_case(page_size: int, seed: int):
    """A hand-made window pool for the index builders and every form: 3 requests over a full-pool table (lens[b]
    positions and K draft tokens), each keeping its positions from its decode query's window start on (paged: from
    that position's page), the rest freed (mapping 0: the padding slot); every window-pool slot no request keeps
    holds NaN. -> (table, slot map, k/v caches, rows, lens)."""
    gen = torch.Generator().manual_seed(seed)
    lens, ps = [9, 40, 23], page_size
    full_pages, swa_pages = 1024 // ps, 384 // ps
    table = torch.zeros(4, 80, dtype=torch.int32)
    mapping = torch.zeros(full_pages * ps + ps + 1, dtype=torch.int64)
    mapping[-1] = -1
    fulls = (torch.randperm(full_pages - 1, generator=gen) + 1)[:, None] * ps + torch.arange(ps)  # [pages, ps]
    swas = (torch.randperm(swa_pages - 1, generator=gen) + 1)[:, None] * ps + torch.arange(ps)
    fp = sp = 0
    for row, n in enumerate(lens, start=1):
        need = -(-(n + K) // ps)
        slots = fulls[fp:fp + need].reshape(-1)[:n + K]
        table[row, :n + K] = slots.to(torch.int32)
        keep = max(n - 1 - W, 0) // ps * ps  # the first kept position: decode's window start's page
        kept_pages = need - keep // ps
        mapping[fulls[fp + keep // ps:fp + need].reshape(-1)] = swas[sp:sp + kept_pages].reshape(-1)
        fp, sp = fp + need, sp + kept_pages
    rows_swa = swa_pages * ps + ps
    k_cache = torch.randn(rows_swa, G.num_kv_heads, G.head_dim, generator=gen)
    v_cache = torch.randn(rows_swa, G.num_kv_heads, G.head_dim, generator=gen)
    owned = torch.zeros(rows_swa, dtype=torch.bool)
    owned[mapping[mapping > 0]] = True
    k_cache[~owned] = v_cache[~owned] = float("nan")
    return table, SlotMap(mapping, rows_swa), k_cache, v_cache, torch.tensor([1, 2, 3]), torch.tensor(lens)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("form", ["kernel", "matmul", "triton"])
def test_every_form_reads_the_translated_index(form, page_size):
    """Decode and windowed verify (a tree) with a slot map, each form (the Triton kernels, CUDA's form, through
    Triton's interpreter: they read each request's range from the index's table, which holds the translated slots:
    decode's block slots as one row, verify's each row's window) equal to the matmul form over the same caches with
    every freed slot cleaned (whatever a form reads of them is masked, and must leave no NaN)."""
    from compiled_attn.kernels.cpu.kernel import native_available

    if form == "triton":
        from triton_interpret import import_kernels

        import_kernels()
    if form == "kernel" and not native_available():
        pytest.skip("no C++ kernel here")
    table, slot_map, k_cache, v_cache, rows, lens = _window_pool_case(page_size, 40)
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(3, G.num_heads, G.head_dim, generator=gen)
    meta = plan_decode(q, k_cache, v_cache, table, rows, lens, sliding_window=W, check_slots=False,
                       page_size=page_size)
    index = build_decode_index(table, meta.inputs, page_size, host_form=False, slot_map=slot_map)
    ref = decode_blocks(q, clean_k, clean_v, index, 0.2, sinks=SINKS, form="matmul")
    torch.testing.assert_close(decode_blocks(q, k_cache, v_cache, index, 0.2, sinks=SINKS, form=form), ref,
                               atol=1e-5, rtol=0)
    qv = torch.randn(3 * K, G.num_heads, G.head_dim, generator=gen)
    masks = torch.stack([random_tree(K, gen) for _ in range(3)])
    vmeta = plan_verify(qv, k_cache, v_cache, table, rows, lens, K, masks.reshape(-1), check_slots=False,
                        sliding_window=W, page_size=page_size)
    vindex = build_verify_index(table, vmeta.inputs, page_size, host_form=False, sliding_window=W, slot_map=slot_map)
    vref = verify_blocks(qv, clean_k, clean_v, vindex, 0.2, sinks=SINKS, form="matmul")
    torch.testing.assert_close(verify_blocks(qv, k_cache, v_cache, vindex, 0.2, sinks=SINKS, form=form), vref,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, attrs, flag", [
    ("SWAKVPool", {"swa_req_ring_size": 64}, "--disable-hybrid-swa-memory"),
    ("SWAKVPool", {}, "--disable-hybrid-swa-memory"),  # its window layers' pool not an MHA one
    ("UnifiedSWAKVPool", {}, "--enable-unified-memory"),
    ("DeepSeekV4TokenToKVPool", {}, "--disable-hybrid-swa-memory"),
])
def test_pools_it_cannot_read_are_refused_naming_the_flag(kind, attrs, flag):
    mr = H.make_model_runner(G)
    bases = {"UnifiedSWAKVPool": (type("SWAKVPool", (), {}),),
             "DeepSeekV4TokenToKVPool": (type("BaseSWAKVPool", (), {}),)}.get(kind, ())
    mr.token_to_kv_pool = type(kind, bases, attrs)()
    with pytest.raises(NotImplementedError, match=flag) as e:
        CompiledAttnBackend(mr)
    assert "\n" not in str(e.value) and kind in str(e.value)
