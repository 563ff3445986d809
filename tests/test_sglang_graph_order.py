"""Our SGLang backend driven in SGLang 0.5.23's decode CUDA-graph order (``testing.graph_order``, which names the
SGLang lines it follows): replays of batches of different real lengths, padded to the captured batch sizes, equal a
float64 reference written here (per request: its keys' K/V gathered from the pool through the request table, one
softmax), and leave each step's new K/V in the pool; the backend's hooks come in SGLang's order. The CPU twin
(``capture=False``) runs over SGLang's own types and over the replica's stand-ins (what a GPU machine without SGLang
runs); the ``cuda`` twin records real graphs (skipped without CUDA); and ``bench.gpu_decode`` runs its CPU smoke
configuration.
"""
import json
import sys

import pytest
import torch

import compiled_attn.sglang.testing as H
from compiled_attn.sglang.testing import graph_order as GO

H.ensure_sglang_importable()
SGLANG = H.sglang_available()
SOURCES = [pytest.param(False, id="sglang", marks=pytest.mark.skipif(not SGLANG, reason="SGLang not installed")),
           pytest.param(True, id="standins")]
CAPTURE_BS = (1, 4, 8)
# each real batch size replayed through the graph of its bucket: 8 (raw 5, 8, 6), 4 (raw 3, 4), 1 (twice); lengths
# of 1 (the new token alone), at and across the 64-key block edges, and up to the request table's width (256)
STEPS = [[7, 130, 1, 64, 200], [65, 3, 256, 90, 12, 40, 1, 128], [33, 2, 250], [129], [5, 77, 64, 19],
         [1], [180, 60, 2, 9, 111, 31]]


def reference(world: GO.World, batch: GO.DecodeBatch, layer_id: int) -> torch.Tensor:
    """Float64 decode of ``batch``'s layer ``layer_id`` from the pool as it was before the step: each request's
    keys are the slots its table row names, its last key this step's K/V. Returns [n, Hq * Dv] float64."""
    g = world.geometry
    table = world.req_to_token.cpu()
    k_pool = world.pool.get_key_buffer(layer_id).cpu().double()
    v_pool = None if g.mla else world.pool.get_value_buffer(layer_id).cpu().double()
    rows, lens = batch.req_pool_indices.cpu(), batch.seq_lens_cpu
    out = []
    for i in range(batch.batch_size):
        slots = table[rows[i], : lens[i]].long()
        k = k_pool[slots].clone()  # [L, Hkv, D]
        k[-1] = batch.k[layer_id][i].cpu().double().view(g.num_kv_heads, g.head_dim)
        if g.mla:
            v = k[..., : g.kv_lora_rank]
        else:
            v = v_pool[slots].clone()
            v[-1] = batch.v[layer_id][i].cpu().double().view(g.num_kv_heads, g.v_head_dim)
        q = batch.q[layer_id][i].cpu().double().view(g.num_kv_heads, g.group_size, g.head_dim)
        p = (torch.einsum("hgd,lhd->hgl", q, k) * g.sm_scale).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", p, v).reshape(-1))
    return torch.stack(out)


def check_replays(geom: str, standin: bool, *, device: str, capture: bool, dtype=torch.float32, atol=2e-5):
    """Two layers, graphs of CAPTURE_BS, each of STEPS replayed and compared with the reference and the pool."""
    g = H.GEOMETRIES[geom]
    world = GO.make_world(g, device=device, dtype=dtype, num_layers=2, max_num_reqs=64, max_context_len=256,
                          pool_size=6000, standin=standin, seed=3)
    backend = GO.load_backend_class(standin)(world.runner)
    replica = GO.DecodeGraphReplica(backend, world, CAPTURE_BS, capture=capture)
    replica.capture_all()
    gen = torch.Generator().manual_seed(4)
    for lens in STEPS:
        batch = GO.make_batch(world, lens, gen=gen)
        refs = [reference(world, batch, i) for i in range(2)]
        outs = replica.replay(batch)
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            assert out.shape == (len(lens), g.num_heads * g.v_head_dim)
            torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=atol, msg=lambda m, i=i, lens=lens:
                                       f"layer {i}, lengths {lens}: {m}")
            stored = world.pool.get_key_buffer(i)[batch.out_cache_loc]
            assert torch.equal(stored.reshape(len(lens), -1), batch.k[i]), "the step's new K is not in the pool"


@pytest.mark.parametrize("standin", SOURCES)
@pytest.mark.parametrize("geom", ["mha", "gqa", "mla_absorbed"])
def test_cpu_twin_replays_match_reference(geom, standin, one_thread):
    """One intra-op thread: on a shared 2-core machine a parallel region waits on a descheduled second thread (3.6 s
    against 0.2 s measured)."""
    check_replays(geom, standin, device="cpu", capture=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("geom", ["gqa", "mla_absorbed"])
def test_cuda_graph_replays_match_reference(geom, dtype):
    """The same with real CUDA graphs: what a replay computes comes from the buffers filled before it, not from the
    capture's values (SGLang's types where they import, else the stand-ins)."""
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    check_replays(geom, None, device="cuda", capture=True, dtype=dtype, atol=atol)


def test_drive_decode_graph(one_thread):
    """The one-call form: batches placed apart (make_batch's default), so each one's reference can be taken before
    any replay; the default capture sizes follow SGLang's small buckets."""
    assert GO.default_capture_bs(1) == [1] and GO.default_capture_bs(5) == [1, 2, 4, 8]
    assert GO.default_capture_bs(20) == [1, 2, 4, 8, 16, 24]
    world = GO.make_world(H.GEOMETRIES["gqa"], max_num_reqs=32, pool_size=4000, standin=True, seed=5)
    batches = [GO.make_batch(world, lens) for lens in ([9, 70, 3], [130], [5, 64, 65, 2, 200])]
    refs = [reference(world, b, 0) for b in batches]
    outs = GO.drive_decode_graph(GO.load_backend_class(True)(world.runner), world, batches, capture=False)
    for (out,), ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


class Recorder:
    """The backend, with its graph hooks and ``forward`` logged as (name, detail)."""

    def __init__(self, backend):
        self._backend, self.calls = backend, []

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if name == "init_forward_metadata_out_graph":
                self.calls.append((name, args[0].batch_size, kwargs.get("in_capture", False)))
            elif name in ("init_forward_metadata_in_graph", "forward"):
                fb = args[0] if name != "forward" else args[4]
                self.calls.append((name, fb.batch_size))
            else:
                self.calls.append((name, *args))
            return attr(*args, **kwargs)

        return call


@pytest.mark.parametrize("standin", SOURCES)
def test_calls_follow_sglang_order(standin, one_thread):
    """init_cuda_graph_state(max_bs, max_bs), the fill value; per size, largest first: the out-of-graph hook with
    in_capture=True, then the step (in-graph hook, each layer) for 2 warm-ups and the capture; per replay the
    out-of-graph hook without in_capture on the padded size (and, without graphs, the step again)."""
    world = GO.make_world(H.GEOMETRIES["gqa"], num_layers=2, standin=standin)
    backend = Recorder(GO.load_backend_class(standin)(world.runner))
    replica = GO.DecodeGraphReplica(backend, world, [1, 4], capture=False)
    replica.capture_all()
    for lens in ([5, 9, 3], [12]):
        replica.replay(GO.make_batch(world, lens))

    def step(bs):
        return [("init_forward_metadata_in_graph", bs), ("forward", bs), ("forward", bs)]

    expected = [("init_cuda_graph_state", 4, 4), ("get_cuda_graph_seq_len_fill_value",)]
    for bs in (4, 1):
        expected += [("init_forward_metadata_out_graph", bs, True)] + step(bs) * 3
    expected += [("init_forward_metadata_out_graph", 4, False)] + step(4)
    expected += [("init_forward_metadata_out_graph", 1, False)] + step(1)
    assert backend.calls == expected


def test_replica_refuses_bad_input():
    world = GO.make_world(H.GEOMETRIES["gqa"], standin=True)
    backend = GO.load_backend_class(True)(world.runner)
    with pytest.raises(ValueError, match="capture=True"):
        GO.DecodeGraphReplica(backend, world, [1], capture=True)
    with pytest.raises(ValueError, match="capture_bs"):
        GO.DecodeGraphReplica(backend, world, [], capture=False)
    replica = GO.DecodeGraphReplica(backend, world, [1, 2], capture=False)
    with pytest.raises(RuntimeError, match="capture_all"):
        replica.replay(GO.make_batch(world, [3]))
    replica.capture_all()
    with pytest.raises(ValueError, match="exceeds the largest captured batch size 2"):
        replica.replay(GO.make_batch(world, [3, 4, 5]))
    with pytest.raises(ValueError, match="seq_lens"):
        GO.make_batch(world, [257])
    with pytest.raises(ValueError, match="first_slot"):
        GO.make_batch(world, [200] * 11, first_slot=1)
    with pytest.raises(ValueError, match="num_layers"):
        GO.make_world(H.GEOMETRIES["gqa"], num_layers=0, standin=True)


def test_standin_backend_leaves_sglang_modules_alone():
    """The stand-in backend is a module of its own; the SGLang names it was loaded over are gone afterwards (or
    SGLang's own again), so an importorskip("sglang") elsewhere still says what is installed."""
    before = {n: sys.modules.get(n) for n in ("sglang", "sglang.srt.mem_cache.memory_pool",
                                               "compiled_attn.sglang.backend")}
    cls = GO.load_backend_class(True)
    assert cls.__module__ == "compiled_attn.sglang._backend_over_standins"
    assert {n: sys.modules.get(n) for n in before} == before
    if SGLANG:
        from compiled_attn.sglang.backend import CompiledAttnBackend

        assert GO.load_backend_class(None) is CompiledAttnBackend is not cls


def test_gpu_decode_cpu_smoke(tmp_path, capsys, one_thread):
    """The timing script's CPU configuration: it says it is a smoke run without graphs, and writes every row."""
    from compiled_attn.bench import gpu_decode

    out = tmp_path / "gpu_decode.json"
    argv = ["--smoke", "--out", str(out), "--bs", "1", "3", "--ctx", "40", "--iters", "2", "--geoms", "gqa",
            "--capacity-ctx", "40", "--capacity-big", "1024", "--standin"]
    assert gpu_decode.main(argv) == 0
    text = capsys.readouterr().out
    assert "capture=False" in text and "not GPU numbers" in text and "capacity cost (gqa" in text
    result = json.loads(out.read_text())
    assert result["run"]["capture"] is False and result["run"]["sglang"] == "stand-ins"
    assert [(r["bs"], r["ctx"]) for r in result["rows"]] == [(1, 40), (3, 40)]
    for r in result["rows"]:
        assert all(r[k] > 0 for k in ("first_ms", "step_ms", "replay_ms", "eager_ms", "bound_ms"))
        assert "compiled_ms" not in r  # off on CPU unless --compiled
        assert r["max_diff_vs_eager"] < 1e-4
        assert r["kv_bytes"] == r["bs"] * 40 * 2 * 2 * 64 * 4  # keys x (K, V) x Hkv x D x float32
    (cap,) = result["capacity"]
    assert cap["big_blocks"] == 1024 // 64 and cap["small_blocks"] == 1 + 1 and cap["ratio"] > 0
