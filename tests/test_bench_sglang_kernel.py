"""``bench-ops --against sglang``: SGLang's own CPU decode kernel (``decode_attention_cpu``, from the kit outside the
project, ``compiled_attn/bench/sglang_kit.py``) as a column, checked against ours before it is timed.

The kernel tests run where the kit is built on this machine (``python build.py`` in the kit, about 60 s; the tests
do not build it) and skip otherwise, naming the kit; the mismatch check runs everywhere, on a stand-in op."""
import os
from types import SimpleNamespace

import pytest
import torch

from compiled_attn.bench import sglang_kit
from compiled_attn.bench.ops_decode import ATOL, SglangMismatch, bench_case

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kit_ops():
    path = sglang_kit.default_kit_path()
    if path is None:
        pytest.skip(f"SGLang's CPU attention kit not found (${sglang_kit.KIT_ENV} unset, {sglang_kit.DEFAULT_KIT} "
                    "missing from here)")
    library = os.path.join(sglang_kit.build_dir(), sglang_kit.LIBRARY)
    if not sglang_kit._fresh(library, os.path.abspath(path)):
        pytest.skip(f"SGLang's CPU attention kit at {os.path.abspath(path)} is not built here ({library} missing or "
                    f"older than its sources; run its build.py)")
    kit = sglang_kit.load_kit(path, build=False)
    if kit.ops is None:
        pytest.skip(kit.line)
    return kit.ops


@pytest.mark.parametrize("name, lens", [("tiny-mha", [5, 70]), ("mla", [100, 37])], ids=["mha", "mla"])
def test_sglang_column_is_timed_after_it_agrees_with_ours(kit_ops, name, lens):
    """Tiny MHA (GQA 4/2 heads x 16) and MLA (16 heads over the 576/512 latent cache: the kernel's MLA path) in
    bfloat16, over two copies of the K/V read in turn: the column is there and its first call matched ours."""
    row = bench_case(name, len(lens), "custom", lens=lens, iters=1, dtype=torch.bfloat16, bound=True,
                     cold_bytes=1 << 10, sglang=kit_ops)
    assert row["kv_copies"] == 2 and "sglang_skipped" not in row
    assert row["sglang_ms"] > 0 and row["sglang/compiled"] == pytest.approx(row["sglang_ms"] / row["compiled_ms"])
    assert 0 <= row["sglang_diff"] <= ATOL


def test_sglang_column_skips_float32(kit_ops):
    row = bench_case("tiny-mha", 1, "custom", lens=[9], iters=1, dtype=torch.float32, sglang=kit_ops)
    assert "sglang_ms" not in row and "no float32" in row["sglang_skipped"]


def test_a_kernel_that_disagrees_is_an_error_not_a_column():
    def decode_attention_cpu(q, k_cache, v_cache, out, *rest):
        out.fill_(0.5)  # not the attention

    ops = SimpleNamespace(decode_attention_cpu=decode_attention_cpu)
    with pytest.raises(SglangMismatch, match="differs from ours on tiny-mha decode bs 2.*max abs diff"):
        bench_case("tiny-mha", 2, "custom", lens=[5, 70], iters=1, dtype=torch.bfloat16, sglang=ops)
