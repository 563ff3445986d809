"""Reference models end to end (CPU, fp32): eager vs loop logits, greedy ids across all three backends, and
MLA's absorbed decode against its normal (decompressed) form on the same latent cache.

Runs with one intra-op thread: these 2-core machines are shared, and a parallel region whose second thread is
descheduled waits a whole scheduler slice (measured: a 1 ms tiny-model step took 320 ms under another job).
"""
import pytest
import torch

from compiled_attn.bench.backends import ExtendBatch, make_backend
from compiled_attn.bench.engine import Engine
from compiled_attn.bench.models import PRESETS, build_model, get_config
from compiled_attn.runners.decode import GraphConfig

TINY = ["tiny-llama", "tiny-deepseek"]
PROMPTS = [5, 17, 33]


pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(model, backend, max_context=64, buckets=(4,)):
    config = GraphConfig(max_batch_size=max(buckets), max_kv_tokens=max(buckets) * 64, cuda_graph_bs=list(buckets),
                         progress=False)
    return Engine(model, make_backend(backend, config), max_batch=4, max_context=max_context)


def _run(model, backend, steps, **kw):
    engine = _engine(model, backend, **kw)
    prefill = engine.admit(PROMPTS, seed=7, keep_logits=True)
    decode = engine.decode(steps, keep_logits=True)
    engine.release()
    return prefill, decode


@pytest.mark.parametrize("name", TINY)
def test_eager_logits_match_loop(name):
    model = build_model(get_config(name, layers=2, mlp=True), seed=1)
    p_loop, d_loop = _run(model, "loop", 6)
    p_eager, d_eager = _run(model, "eager", 6)
    torch.testing.assert_close(p_eager.logits, p_loop.logits, atol=1e-4, rtol=0)
    assert len(d_eager.logits) == 6
    for step, (a, b) in enumerate(zip(d_eager.logits, d_loop.logits, strict=False)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"decode step {step}")


@pytest.mark.parametrize("name", TINY)
def test_greedy_ids_identical_across_backends(name):
    """16 greedy steps, fp32: loop, eager and compiled (batch of 3 in bucket 4) produce the same ids."""
    model = build_model(get_config(name, layers=2), seed=2)
    tokens = {}
    for backend in ("loop", "eager", "compiled"):
        prefill, decode = _run(model, backend, 16)
        tokens[backend] = torch.cat([prefill.tokens[:, None], decode.tokens], 1)
        if backend == "compiled":
            assert decode.buckets == ["4x256"] * 16
    assert tokens["loop"].shape == (3, 17)
    assert torch.equal(tokens["eager"], tokens["loop"])
    assert torch.equal(tokens["compiled"], tokens["loop"])


def _normal_decode_logits(model, engine, batch):
    """The same decode step in MLA's normal form: K/V decompressed for every cached token plus the new one,
    attention with Dqk = nope + rope, Dv = v_head_dim (through the extend path: one new token per request)."""
    table = engine.table.req_to_token
    lens = batch.seq_lens
    kv_slots = torch.cat([table[int(r), : int(n)].long() for r, n in zip(batch.rows, lens, strict=False)])
    ext = ExtendBatch(batch.rows, lens, lens - 1, torch.ones_like(lens), kv_slots)
    attn = engine.backend.extend_attn(model, engine.persistent, table, ext)
    return model.extend(batch.tokens, batch.positions, batch.out_loc, engine.persistent, attn,
                        torch.arange(lens.shape[0]), kv_slots)


@pytest.mark.parametrize("backend", ["eager", "loop"])
def test_mla_absorbed_decode_equals_normal(backend):
    model = build_model(get_config("tiny-deepseek", layers=2), seed=3)
    engine = _engine(model, backend)
    engine.admit(PROMPTS, seed=4)
    with torch.no_grad():
        for _ in range(3):  # a few steps, so the latent cache holds decoded tokens too
            batch = engine.next_decode_batch()
            absorbed, _ = engine.backend.decode(model, engine.persistent, batch)
            latent = [engine.persistent[f"kv{i}"].clone() for i in range(2)]
            normal = _normal_decode_logits(model, engine, batch)
            # both forms wrote the same latent for the new token: exactly in layer 0 (same input), up to
            # rounding in layer 1 (its input went through the two attention forms)
            torch.testing.assert_close(engine.persistent["kv0"], latent[0], atol=0, rtol=0)
            torch.testing.assert_close(engine.persistent["kv1"], latent[1], atol=1e-5, rtol=0)
            torch.testing.assert_close(normal, absorbed, atol=1e-4, rtol=0)
            engine._tokens = absorbed.argmax(-1)


def test_mla_absorbed_weights_are_kv_b_proj():
    """W_UK / W_UV of the absorbed form are the per-head slices of kv_b_proj (no separate random weights)."""
    cfg = get_config("tiny-deepseek", layers=1)
    model = build_model(cfg, seed=5)
    w = model.kv_b_proj[0].view(cfg.num_heads, cfg.qk_nope_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    assert torch.equal(model.w_uk[0], w[:, : cfg.qk_nope_dim])
    assert torch.equal(model.w_uv_t[0], w[:, cfg.qk_nope_dim:].transpose(1, 2))
    assert model.scale == pytest.approx((cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5)


def test_presets_have_the_real_shapes():
    llama, ds = PRESETS["llama-3-8b"], PRESETS["deepseek-v2-lite"]
    assert (llama.hidden, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4096, 32, 8, 128)
    assert (ds.hidden, ds.num_heads, ds.kv_lora_rank, ds.qk_nope_dim, ds.qk_rope_dim, ds.v_head_dim) == \
        (2048, 16, 512, 128, 64, 128)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_config("llama-70b")


def test_same_seed_same_weights():
    a = build_model(get_config("tiny-llama", layers=1), seed=9)
    b = build_model(get_config("tiny-llama", layers=1), seed=9)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=False))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_dense_linear_matches_float64(dtype, tol):
    from compiled_attn.bench.models.dense import linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 64, generator=g), torch.randn(48, 64, generator=g) / 8
    ref = x.double() @ w.double().T
    for fn in (linear, torch.compile(linear, fullgraph=True, dynamic=True)):
        out = fn(x.to(dtype), w.to(dtype))
        assert out.shape == (2, 5, 48) and out.dtype == dtype
        assert (out.double() - ref).abs().max() < tol * ref.abs().max()
