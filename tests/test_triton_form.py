"""The Triton kernels as the dispatchers' CUDA form: ``choose_form`` picks them for CUDA calls (asked with fake CUDA
tensors, on any machine), and ``decode_attention`` / ``verify_attention`` with ``form="triton"`` (here through
Triton's interpreter: ``triton_interpret``) equal the float64 reference; a graph's block capacity changes nothing;
``form=`` errors. The kernels themselves: ``test_triton_kernels.py``."""
import pytest
import torch
from reference import reference_attention
from test_verify import _case, random_trees, reference_verify
from test_verify_window import reference_window
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpret import import_kernels

from compiled_attn import build_decode_index, decode_blocks, plan_decode
from compiled_attn.api import decode_attention
from compiled_attn.bench.batches import make_batch
from compiled_attn.forms import choose_form
from compiled_attn.kernels import triton_form
from compiled_attn.verify import verify_attention

import_kernels()


def _cuda_call(hq, hkv, d, dv=None, dtype=torch.bfloat16, kv=None):
    """Fake CUDA q and caches (shapes, dtypes and the device only: no GPU needed)."""
    with FakeTensorMode():
        q = torch.empty(4, hq, d, dtype=dtype, device="cuda")
        k = torch.empty(64, hkv, d, dtype=kv or dtype, device="cuda")
        # MLA's V: K's strides over its first dv columns (a view, which fake CUDA tensors cannot take here)
        v = torch.empty_strided((64, hkv, dv or d), k.stride(), dtype=kv or dtype, device="cuda")
        return q, k, v


def test_cuda_calls_take_the_triton_kernel(monkeypatch):
    """CUDA: the Triton kernel for MHA/GQA, MLA's latent and float8 caches, by its reason; form="matmul", head
    sizes it does not take, or no triton installed: the matmul form, saying why."""
    for call, rows in ((_cuda_call(32, 8, 128), 4), (_cuda_call(16, 1, 576, 512), 16),
                       (_cuda_call(8, 2, 64, kv=torch.float8_e4m3fn), 4)):
        c = choose_form("decode", *call, rows_per_kv_head=rows)
        assert (c.form, c.path) == ("triton", "") and "Triton kernel" in c.reason
        assert choose_form("verify", *call, rows_per_kv_head=rows * 4).form == "triton"
    call = _cuda_call(32, 8, 128)
    assert choose_form("decode", *call, rows_per_kv_head=4, form="matmul").form == "matmul"
    odd = choose_form("decode", *_cuda_call(8, 2, 40), rows_per_kv_head=4)
    assert odd.form == "matmul" and "head sizes not equal multiples of 16" in odd.reason
    monkeypatch.setattr(triton_form, "_triton_installed", lambda: False)
    missing = choose_form("decode", *call, rows_per_kv_head=4)
    assert missing.form == "matmul" and "triton is not installed" in missing.reason
    with pytest.raises(ValueError, match=r"form='triton': the Triton kernel cannot serve this call \(triton is not"):
        choose_form("decode", *call, rows_per_kv_head=4, form="triton")


def test_form_errors():
    b = make_batch([5, 9], hq=4, hkv=2, dqk=16, decode=True)
    call = (b.q, b.k_cache, b.v_cache)
    with pytest.raises(ValueError, match=r"form must be one of \('auto', 'kernel', 'triton', 'matmul'\)"):
        choose_form("decode", *call, rows_per_kv_head=2, form="fast")
    with pytest.raises(ValueError, match=r"form='kernel': the C\+\+ kernel cannot serve this call \(not a CPU call"):
        choose_form("decode", *_cuda_call(8, 2, 64), rows_per_kv_head=4, form="kernel")
    assert choose_form("decode", *call, rows_per_kv_head=2, form="matmul").form == "matmul"


@pytest.mark.parametrize("case", ["gqa_bf16_pages", "mla_fp8", "window_sinks_cap"])
def test_decode_by_the_triton_form_matches_float64(case):
    """GQA over a bf16 cache in pages of 16; MLA's latent (V a view of K) in float8 with scales; a sliding window
    with sinks and a soft-cap; each request's keys against float64."""
    kw, call = {}, {}
    if case == "gqa_bf16_pages":
        b = make_batch([1, 37, 130], hq=8, hkv=2, dqk=32, decode=True, page_size=16, seed=1, dtype=torch.bfloat16)
        call, tol = dict(page_size=16), 3e-2
    elif case == "mla_fp8":
        b = make_batch([20, 70], hq=16, hkv=1, dqk=576, dv=512, mla=True, decode=True, seed=2,
                       kv_dtype=torch.float8_e4m3fn)
        call, kw, tol = dict(k_scale=0.5, v_scale=0.5), dict(kv_scale=0.5), 1e-4
    else:
        b = make_batch([9, 60, 3], hq=4, hkv=2, dqk=16, decode=True, seed=3)
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        call = dict(sliding_window=20, logit_cap=3.0, sinks=sinks)
        kw, tol = dict(sliding_window=20, logit_cap=3.0, sinks=sinks), 1e-4
    out = decode_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, scale=0.3, form="triton",
                           **call)
    k_scale = kw.pop("kv_scale", 1.0)
    ref = reference_attention(b.q, b.k_cache.float() * k_scale, b.v_cache.float() * k_scale, b.req_to_token, b.rows,
                              b.seq_lens, b.prefix_lens, b.ext_lens, scale=0.3, **kw)
    assert (out.double() - ref).abs().max() < tol


def test_a_graphs_block_capacity_changes_nothing():
    """The same batch planned at its own block count and at a capacity 16 times larger (what a graph sized for a
    large pool holds): the Triton form reads each request's range, so both give the same output, and the reference's."""
    b = make_batch([40, 7], hq=4, hkv=2, dqk=16, decode=True, seed=4)
    outs = []
    for capacity in (None, 64):
        meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=16,
                           block_capacity=capacity)
        index = build_decode_index(b.req_to_token, meta.inputs, host_form=False)
        outs.append(decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.25, form="triton"))
    assert torch.equal(outs[0], outs[1])
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.25)
    assert (outs[0].double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_by_the_triton_form_matches_float64(tree):
    """Chain and tree masks over GQA (a batch of one included), and a sliding window over a tree."""
    k = 3
    for prefix in ([5, 0, 130], [64]):
        b, pre = _case(prefix, k, hq=8, hkv=2, seed=5)
        masks = random_trees(len(prefix), k, torch.Generator().manual_seed(7)) if tree else None
        flat = None if masks is None else masks.reshape(-1)
        out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, flat, form="triton")
        full = masks if tree else torch.ones(len(prefix), k, k, dtype=torch.bool).tril()
        ref = reference_verify(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, full, 16 ** -0.5)
        assert (out.double() - ref).abs().max() < 1e-5
    if tree:
        out = verify_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, flat, sliding_window=10,
                               form="triton")
        ref = reference_window(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, pre, k, masks, 10, 16 ** -0.5)
        assert (out.double() - ref).abs().max() < 1e-5
