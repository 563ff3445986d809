"""The C++ decode kernel (``kernels.cpu.kernel``'s merged op): each block alone (a row that owns it and no other)
and whole rows against a float64 computation, over random paged tables, every cache dtype, head sizes with and
without a compiled-in size, group sizes that are and are not multiples of 4, a soft-cap, and NaN in every slot it
must not read; the builds for other instruction sets (the portable half-precision path); the off switch and a failed
build falling back to the portable matmul form."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.forms import choose_form
from compiled_attn.kernels.cpu import kernel as cpu_kernel
from compiled_attn.kernels.cpu.kernel import native_available, native_decode_blocks, native_fits
from compiled_attn.plan import plan_decode
from tests.reference import keys_attention, reference_attention
from tests.test_kv_formats import poison_unread

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler on this machine")


def _batch(lens, *, hq, hkv, d, page_size, block_size, kv_dtype=torch.float32, seed=0):
    b = make_batch(lens, hq=hq, hkv=hkv, dqk=d, decode=True, page_size=page_size, seed=seed, kv_dtype=kv_dtype)
    poison_unread(b, torch.zeros(len(lens)), b.seq_lens, page_size)  # NaN wherever the kernel must not read
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, block_size=block_size,
                       page_size=page_size)
    return b, build_decode_index(b.req_to_token, meta.inputs, page_size, host_form=False)


def _block_keys(index, n):
    """The valid slots of each of the first n blocks."""
    return [index.slots[j][index.valid[j]] for j in range(n)]


def _each_block_alone(q, index, n, k_cache, v_cache, k_scale, v_scale, cap, q_bf16_scale=0.0, path=""):
    """The merged op with each of the first n blocks as a row of its own (row j: block j, its request's query): row
    j's output is then block j's softmax alone, [n, Hq, Dv]."""
    return native_decode_blocks(q[index.block_req[:n]], torch.arange(n), index.slots[:n], index.valid[:n],
                                k_cache, v_cache, k_scale, v_scale, cap, n, None, q_bf16_scale, path=path)


@pytest.mark.parametrize("kv_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5), (torch.float16, 1e-5),
                                           (torch.float8_e4m3fn, 1e-5), (torch.float8_e5m2, 1e-5)])
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 128), (6, 2, 64), (3, 3, 32), (16, 2, 80), (8, 1, 256),
                                        (32, 2, 128), (64, 2, 64), (48, 1, 80)])
@pytest.mark.parametrize("page_size, block_size", [(1, 16), (16, 48), (64, 64), (16, 24)])
@pytest.mark.parametrize("bf16_query", [False, True], ids=["f32q", "bf16q"])
def test_blocks_match_float64(kv_dtype, tol, hq, hkv, d, page_size, block_size, bf16_query):
    """Each block alone (a row that owns it and no other) and each request's blocks merged equal a float64 softmax
    over the same stored values (dequantised exactly: the tolerance is float32 arithmetic's, for every dtype), with
    scales and a soft-cap; NaN in unread slots never reaches them. A bf16 query with its scale (below 8 query rows per
    KV head: the vector path, its scores by exact bf16 pair products where the CPU has AVX512-BF16) too. 16, 32 and
    48 rows per KV head with a float32 query take the wide path (``csrc/wide_blocks.h``: one and two groups of 16
    rows per step, a head size of 80 leaving a partial block of V columns)."""
    lens = [1, 17, 64, 200, 129]
    b, index = _batch(lens, hq=hq, hkv=hkv, d=d, page_size=page_size, block_size=block_size, kv_dtype=kv_dtype,
                      seed=d + page_size)
    if bf16_query and hq // hkv >= 8:
        pytest.skip("8+ rows per KV head: the tile path where there is one (test_tile_path_matches_float64)")
    # a bf16 query scaled in float32, q_bf16_scale saying by what: the kernel takes it back to bf16 exactly
    q, q_scale = (b.q.bfloat16().float() * d ** -0.5, d ** -0.5) if bf16_query else (b.q * d ** -0.5, 0.0)
    n = int((index.block_req < len(lens)).sum())
    keys = _block_keys(index, n)
    rows = [b.req_to_token[b.rows[r], :length].long() for r, length in enumerate(lens)]
    for k_scale, v_scale, cap in ((1.0, 1.0, 0.0), (0.5, 2.0, 0.0), (1.0, 1.0, 2.5)):
        scales = dict(k_scale=k_scale, v_scale=v_scale, logit_cap=cap)
        out = _each_block_alone(q, index, n, b.k_cache, b.v_cache, k_scale, v_scale, cap, q_scale)
        want = keys_attention(q[index.block_req[:n]], keys, b.k_cache, b.v_cache, **scales)
        torch.testing.assert_close(out.double(), want, atol=tol * 4 * v_scale, rtol=tol)
        out = native_decode_blocks(q, index.block_req, index.slots, index.valid, b.k_cache, b.v_cache,
                                   k_scale, v_scale, cap, len(lens), None, q_scale)
        want = keys_attention(q, rows, b.k_cache, b.v_cache, **scales)
        torch.testing.assert_close(out.double(), want, atol=tol * 4 * v_scale, rtol=tol)


def test_empty_block_and_no_blocks():
    """A block with no valid key gives nothing: alone in its row the row is zeros (finite: nothing read), beside a
    row's other blocks the row is their softmax alone; a call with no blocks gives zeros."""
    b, index = _batch([40, 3], hq=4, hkv=2, d=64, page_size=1, block_size=16)
    q = b.q * 0.125
    valid = index.valid.clone()
    valid[0] = False
    index = dataclasses.replace(index, valid=valid)
    assert int(index.block_req[1]) == 0 and valid[1].any()  # request 0 keeps blocks after the empty one
    out = _each_block_alone(q, index, 4, b.k_cache, b.v_cache, 1.0, 1.0, 0.0)
    assert (out[0] == 0).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), keys_attention(q[index.block_req[:4]], _block_keys(index, 4), b.k_cache,
                                                            b.v_cache), atol=1e-5, rtol=1e-5)
    out = native_decode_blocks(q, index.block_req, index.slots, valid, b.k_cache, b.v_cache, 1.0, 1.0, 0.0, 2)
    rows = [b.req_to_token[b.rows[0], 16:40].long(), b.req_to_token[b.rows[1], :3].long()]  # block 0: slots 0-15
    torch.testing.assert_close(out.double(), keys_attention(q, rows, b.k_cache, b.v_cache), atol=1e-5, rtol=1e-5)
    none = native_decode_blocks(q, index.block_req[:0], index.slots[:0], valid[:0], b.k_cache, b.v_cache, 1.0, 1.0,
                                0.0, 2)
    assert none.shape == (2, 4, 64) and (none == 0).all()


@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_builds_for_other_instruction_sets_agree(march, tmp_path):
    """The same source built for plain x86-64 (half precision converted by moving bits) and for AVX2 + F16C gives
    the native build's results (fp16 and float8 caches exercise the conversions), and has no tile path."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86 instruction sets")
    if march == "haswell" and "avx2" in cpu_kernel.cpu_isa_levels():  # the avx2 level's build, cached
        lib = cpu_kernel.library_for("avx2")
    else:
        lib = cpu_kernel.load(cpu_kernel.build(out_dir=tmp_path, march=march))
    def both_builds(*args, **kwargs):  # the native build's output, then lib's
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernel, "library", lambda: lib)  # the op calls whatever library() returns
            got = _each_block_alone(*args, **kwargs)
        return _each_block_alone(*args, **kwargs), got

    for kv_dtype in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        b, index = _batch([33, 70], hq=8, hkv=2, d=128, page_size=16, block_size=32, kv_dtype=kv_dtype)
        # a bf16 query with its scale: the native build's bf16 pair products (AVX512-BF16), exact as these builds'
        # float32 ones
        for q, q_scale in ((b.q * 0.1, 0.0), (b.q.bfloat16().float() * 0.1, 0.1)):
            want, got = both_builds(q, index, 4, b.k_cache, b.v_cache, 0.5, 1.0, 0.0, q_scale)
            tol = 1e-5 if q_scale else 1e-6  # pairs summed in another order
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        # 16 query rows per KV head, a float32 query: the wide path, in vector extensions without AVX-512 too
        b, index = _batch([33, 70], hq=32, hkv=2, d=64, page_size=16, block_size=32, kv_dtype=kv_dtype)
        want, got = both_builds(b.q * 0.1, index, 4, b.k_cache, b.v_cache, 0.5, 1.0, 0.0, path="wide")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # a build without FMA rounds each product
    # the merged op on a token-major query (2 tokens per row, 2 heads each per KV head) in each query dtype: the same
    # float32 arithmetic, the output in q's dtype, bf16 rounded as torch rounds (without AVX512-BF16: by moving bits)
    b, index = _batch([33, 70], hq=8, hkv=2, d=128, page_size=16, block_size=32, kv_dtype=torch.bfloat16)
    q = torch.randn(4, 4, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    args = (index.block_req, index.slots, index.valid, b.k_cache, b.v_cache, 0.1, 1.0, 0.0, 2, None, 0.0,
            None, None, 2)
    outs = []
    for library in (cpu_kernel.library(), lib):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernel, "library", lambda library=library: library)
            out = {dt: native_decode_blocks(q.to(dt), *args) for dt in (torch.float32, torch.bfloat16, torch.float16)}
        assert out[torch.bfloat16].dtype == torch.bfloat16 and out[torch.float16].dtype == torch.float16
        assert torch.equal(out[torch.bfloat16], out[torch.float32].bfloat16())
        assert torch.equal(out[torch.float16], out[torch.float32].half())
        outs.append(out[torch.float32])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    # no AMX in these instruction sets (nor AVX-512 or AVX512-BF16): the tile and bf16 pair paths are not built
    assert lib.ca_isa() & (cpu_kernel.ISA_AVX512 | cpu_kernel.ISA_AVX512_BF16 | cpu_kernel.ISA_AMX) == 0


def test_decode_takes_the_kernel_eagerly_and_matches_the_reference():
    """Eagerly on CPU a batch of more than one takes the kernel by default (``form="matmul"`` gives the portable
    form); both equal the float64 reference."""
    b, index = _batch([5, 70, 130], hq=8, hkv=2, d=32, page_size=1, block_size=16)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.3)
    assert choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=4).form == "kernel"
    assert choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=4, form="matmul").form == "matmul"
    out = decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3)
    off = decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3, form="matmul")
    for o in (out, off):
        torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)


def test_off_switch_and_failed_build_fall_back(monkeypatch, tmp_path):
    """``COMPILED_ATTN_NATIVE=0`` turns the kernel off; a build that cannot run (no such compiler) warns once and
    turns it off too; either way the decode stays correct (the portable matmul form)."""
    b, index = _batch([5, 70], hq=4, hkv=2, d=32, page_size=1, block_size=16)
    ref = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                              b.ext_lens, scale=0.3)
    try:
        monkeypatch.setenv(cpu_kernel.ENABLE_ENV, "0")
        cpu_kernel.library.cache_clear()
        assert cpu_kernel.library() is None and not native_fits(b.q, b.k_cache, b.v_cache)
        monkeypatch.delenv(cpu_kernel.ENABLE_ENV)
        monkeypatch.setenv("CXX", "no-such-compiler-here")
        monkeypatch.setenv(cpu_kernel.CACHE_ENV, str(tmp_path))
        cpu_kernel.library.cache_clear()
        cpu_kernel.library_for.cache_clear()
        with pytest.warns(RuntimeWarning, match="no-such-compiler-here"):
            assert cpu_kernel.library() is None
        out = decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_kernel.library.cache_clear()
        cpu_kernel.library_for.cache_clear()
    assert cpu_kernel.library() is not None


def test_build_is_cached_and_a_compiler_error_is_reported(tmp_path):
    """A second build of the same source finds the library in the cache folder (same path, not rebuilt); a
    source that does not compile raises with the compiler's message. The cache's behaviour, not the kernel's: a
    small source (linked with the ops' object all the same) builds in a second where the kernel takes a minute."""
    source = tmp_path / "small.cpp"
    source.write_text('extern "C" int small_kernel() { return 1; }\n')
    first = cpu_kernel.build(source, out_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_kernel.build(source, out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f( {")
    with pytest.raises(RuntimeError, match="bad.cpp"):
        cpu_kernel.build(bad, out_dir=tmp_path)
    assert [p.name for p in tmp_path.glob("*.so")] == [first.name]  # no half-written file left


def test_a_kernel_from_another_tree_links_that_trees_op(tmp_path):
    """A build of a kernel source from another checkout (an A/B script's) compiles the op file beside it, whose
    ``KernelCall`` struct is that tree's; a source with no op file beside it takes this package's."""
    from compiled_attn.kernels.cpu.build import OP_SOURCE, op_source

    other = tmp_path / "csrc"
    other.mkdir()
    (other / "block_partials.cpp").write_text(cpu_kernel.SOURCE.read_text())
    assert op_source(other / "block_partials.cpp") == OP_SOURCE
    (other / "torch_op.cpp").write_text(OP_SOURCE.read_text())
    assert op_source(other / "block_partials.cpp") == other / "torch_op.cpp"
    assert op_source(cpu_kernel.SOURCE) == OP_SOURCE


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, bf16", [(4, False), (16, True)], ids=["vector", "tiles"])
def test_slot_outside_the_cache_is_refused_not_read(page_size, hq, bf16):
    """A table whose valid position names a slot past the cache (a corrupted req_to_token) is a ValueError naming
    the cache's size, and nothing outside the cache is read (the check is in the kernel): on the vector path and (a
    bf16 query, 8 rows per KV head) the tile path where there is one."""
    b, index = _batch([40, 70], hq=hq, hkv=2, d=64, page_size=page_size, block_size=16, kv_dtype=torch.bfloat16)
    q_scale = 0.125 if bf16 else 0.0
    q = (b.q.bfloat16().float() if bf16 else b.q) * 0.125
    block_slots = index.slots.clone()
    block_slots[1, 0] = b.k_cache.shape[0] + 1000  # its first position is valid
    assert index.valid[1, 0]
    with pytest.raises(ValueError, match=rf"outside the cache at a valid position \(num_slots {b.k_cache.shape[0]}\)"):
        native_decode_blocks(q, index.block_req, block_slots, index.valid, b.k_cache, b.v_cache, 1.0, 1.0, 0.0, 2,
                             None, q_scale)
    # a draft key some token sees (verify's draft block, merged in the same op); one no token sees is never read
    slots = torch.tensor([[3, b.k_cache.shape[0] + 7], [5, 6]])
    shows = torch.tensor([[[True, False]], [[True, True]]])
    draft = (index.block_req, index.slots, index.valid, b.k_cache, b.v_cache, 1.0, 1.0, 0.0, 2, None,
             q_scale, slots)
    native_decode_blocks(q, *draft, shows)
    with pytest.raises(ValueError, match="outside the cache"):
        native_decode_blocks(q, *draft, torch.ones_like(shows))
    # queries that are not num_rows * tokens rows of a KV-head multiple, or of a dtype the kernel does not read
    for bad in (q[:1], q[:, :3], q.double()):
        with pytest.raises(ValueError, match="q must be"):
            native_decode_blocks(bad, *draft, shows)


tiles_only = pytest.mark.skipif(not (native_available() and cpu_kernel.native_tiles_available()),
                                reason="no AMX tile path in this kernel build (no AMX on the CPU, COMPILED_ATTN_ISA "
                                       "below amx, or the OS refuses the tile registers)")


@tiles_only
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hq, hkv, d", [(16, 2, 128), (32, 2, 64), (64, 2, 128), (8, 1, 256), (16, 2, 96),
                                        (8, 1, 32), (48, 1, 64)])
@pytest.mark.parametrize("page_size, block_size", [(1, 16), (16, 48), (64, 64), (16, 24)])
def test_tile_path_matches_float64(kv_dtype, hq, hkv, d, page_size, block_size):
    """The tile path (a bf16 query, 8 / 16 / 32 / 48 query rows per KV head), each block alone: the scores' products
    are exact (the query taken back to bf16 from the scaled float32 one) and the softmax's sums float32, but the V
    sum rounds each softmax weight to bf16, so a block's output is within 2^-9 of the largest |V| of float64's, and
    not equal to the vector path's (float32 weights). Scales, a soft-cap, NaN in unread slots,
    chunks staged (page size 1, a block's end) and read in place (16 consecutive slots), and head sizes whose V
    sums leave a group of four accumulator tiles partly used (96: 4 + 2 tiles, 32: 2); 32 and 48 rows per KV head
    take their V sums two row groups at a time (48: a pair, then one group alone)."""
    lens = [1, 17, 64, 200, 129]
    b, index = _batch(lens, hq=hq, hkv=hkv, d=d, page_size=page_size, block_size=block_size, kv_dtype=kv_dtype,
                      seed=d + page_size)
    _check_tile_path(b, index, hkv, d ** -0.5, ((1.0, 1.0, 0.0), (0.5, 2.0, 0.0), (1.0, 1.0, 2.5)))


@tiles_only
@pytest.mark.parametrize("page_size, hq", [(1, 32), (16, 16), (16, 64)])
def test_tile_path_skips_invalid_positions_anywhere_in_a_block(page_size, hq):
    """Valid positions need not open a block (a window's first block starts late) nor be contiguous: the tile
    path skips 32-position chunks with no valid position before, between and after valid ones, drops the rest
    position by position, and a block with none gives zeros; as above against float64."""
    b, index = _batch([300, 97, 130], hq=hq, hkv=2, d=64, page_size=page_size, block_size=128,
                      kv_dtype=torch.bfloat16, seed=3)
    holes = torch.rand(index.valid.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    holes[:, :32] = holes[:, 64:96] = True  # dead chunks before and between live ones
    holes[1] = True  # a block with no valid position
    index = dataclasses.replace(index, valid=index.valid & ~holes)
    _check_tile_path(b, index, 2, 0.125, ((1.0, 1.0, 0.0), (0.5, 2.0, 3.0)))


def _check_tile_path(b, index, hkv, scale, scales_and_caps):
    """The tile path (named: the op refuses a path that does not serve the call) on a bf16 query, each block alone,
    against float64, and different from the vector path's."""
    q = b.q.bfloat16().float() * scale  # q_bf16_scale = scale: the kernel takes it back to bf16 exactly
    n = int((index.block_req < q.shape[0]).sum())
    keys = _block_keys(index, n)
    for k_scale, v_scale, cap in scales_and_caps:
        args = (q, index, n, b.k_cache, b.v_cache, k_scale, v_scale, cap)
        out = _each_block_alone(*args, scale, path="tile").double()
        want = keys_attention(q[index.block_req[:n]], keys, b.k_cache, b.v_cache, k_scale=k_scale, v_scale=v_scale,
                              logit_cap=cap)
        vmax = (b.v_cache.double() * v_scale).nan_to_num(0).abs().max()
        assert ((out - want).abs() <= 2.0 ** -9 * vmax + 1e-5 * (1 + vmax)).all()
        vector = _each_block_alone(*args, path="vector")  # float32 products and weights
        assert (vector.double() - out).abs().max() > 1e-5


def test_a_block_table_that_does_not_fit_is_refused():
    """Shapes that disagree (block_req, slots, valid), a block whose row is negative, and sinks of the wrong
    size: each a ValueError naming it; nothing is read. Rows past the batch are a bucket's unused blocks: skipped."""
    b, index = _batch([33, 70], hq=8, hkv=2, d=64, page_size=16, block_size=32)
    args = [b.q, index.block_req, index.slots, index.valid, b.k_cache, b.v_cache, 0.1, 1.0, 0.0, 2]
    want = reference_attention(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens,
                               b.ext_lens, scale=0.1)
    torch.testing.assert_close(native_decode_blocks(*args).double(), want, atol=1e-5, rtol=1e-5)
    for at, bad, words in ((1, index.block_req.int(), "block_req must be int64"),
                           (2, index.slots[:-1], "slots must be int64"),
                           (3, index.valid[:, :8], r"slots must be int64 \[n=\d+, B=8\]"),
                           (1, index.block_req - 9, r"block_req holds a row outside \[0, 2\).*unused block")):
        with pytest.raises(ValueError, match=words):
            native_decode_blocks(*args[:at], bad, *args[at + 1:])
    assert (native_decode_blocks(*args[:1], index.block_req + 5, *args[2:]) == 0).all()
    with pytest.raises(ValueError, match="sinks must hold Hkv x G = 8 logits"):
        native_decode_blocks(*args, torch.zeros(3))
