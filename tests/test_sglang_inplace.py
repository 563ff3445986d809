"""The eager SGLang backend over slots handed out by SGLang's own allocator (``TokenToKVPoolAllocator``: a fresh
pool's free list in order, so each request's keys are one run of consecutive slots): read in place by the C++
kernel (``native_decode``) where it is built, a batch of one too, with ``torch_native``'s outputs. Skipped where
SGLang isn't installed."""
import pytest
import torch

import compiled_attn.sglang.testing as H

H.ensure_sglang_importable()
pytest.importorskip("sglang")

from reference import spy_calls  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang_compare import run_forward  # noqa: E402

import compiled_attn.decode as decode  # noqa: E402
from compiled_attn.kernels.cpu.kernel import native_available  # noqa: E402
from compiled_attn.sglang.backend import CompiledAttnBackend  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sglang_allocator_slots_are_read_in_place(monkeypatch, dtype):
    native = spy_calls(monkeypatch, decode, "native_decode_blocks")
    g = H.GEOMETRIES["gqa"]
    outs = []
    for make in (H.make_torch_native_backend, CompiledAttnBackend):
        mr = H.make_model_runner(g, dtype=dtype, max_context_len=512, pool_size=4096, seed=3)
        # the batch builder asks for each request's slots with alloc(n): SGLang's allocator now answers
        mr.slot_allocator = TokenToKVPoolAllocator(4096, dtype, "cpu", mr.token_to_kv_pool, need_sort=False)
        for lens in ([300, 150, 400, 7], [260]):
            batch = H.make_decode_batch(mr, lens, dtype=dtype)
            outs.append(run_forward(make(mr), batch, [H.make_layer(g)])[0])
    # the batch and the batch of one (by the kernel where it is built)
    assert len(native) == (2 if native_available() else 0), "the compiled_attn forwards did not run the kernel"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for ours, native in zip(outs[2:], outs[:2], strict=True):
        torch.testing.assert_close(ours, native, atol=tol, rtol=0)
