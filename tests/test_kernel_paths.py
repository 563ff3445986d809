"""The C++ kernel's paths at every instruction-set level this CPU runs, and the one choice of form.

- ``COMPILED_ATTN_ISA``: the levels a CPU runs (from its flags), the errors for an unknown level or one above the
  CPU, and what each level's build says it runs (``ca_isa``).
- At every level this CPU runs (``ISA_LEVELS``; a level above it skips, naming the flags it lacks): the kernel
  runs exactly the paths ``path_fits`` names (and refuses the others), and every path the level's build has
  gives the float64 reference's decode and verify through the dispatchers, which run what ``choose_form`` names.
- ``choose_form``'s logic for every kind of build (AMX, AVX512-BF16, AVX2, none), on any machine.
- ``COMPILED_ATTN_EXPLAIN=1``: one log line per distinct choice, eagerly and at trace time.
"""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from test_verify import _case, random_trees, reference_verify

from compiled_attn import forms
from compiled_attn.bench.batches import make_batch
from compiled_attn.decode import build_decode_index, decode_blocks
from compiled_attn.forms import choose_form
from compiled_attn.kernels.cpu import kernel as cpu_kernel
from compiled_attn.kernels.cpu.kernel import (
    ISA_AMX,
    ISA_AVX2,
    ISA_AVX512,
    ISA_AVX512_BF16,
    ISA_LEVELS,
    ISA_TILES_USABLE,
    KINDS,
    PATHS,
    native_decode_blocks,
    path_fits,
)
from compiled_attn.plan import plan_decode
from compiled_attn.verify import verify_attention
from tests.reference import keys_attention, reference_attention

LEVELS = cpu_kernel.cpu_isa_levels()
#: the bits each level's build must report (beside them: only the tile registers' permission, with AMX)
LEVEL_BITS = {"avx2": ISA_AVX2, "avx512": ISA_AVX2 | ISA_AVX512, "avx512_bf16": ISA_AVX2 | ISA_AVX512 | ISA_AVX512_BF16,
              "amx": ISA_AVX2 | ISA_AVX512 | ISA_AVX512_BF16 | ISA_AMX}


@pytest.fixture(params=list(ISA_LEVELS))
def level_kernel(request, monkeypatch):
    """(level, library): the kernel built for one ``ISA_LEVELS`` level, made this process's kernel for the test
    (every op and ``choose_form`` then use it); skipped where this CPU lacks the level or cannot build."""
    isa = request.param
    if isa not in LEVELS:
        pytest.skip(f"this CPU lacks {isa} (needs the flags {' '.join(ISA_LEVELS[isa][1])} and the levels below)")
    lib = cpu_kernel.library_for(isa)
    if lib is None:
        _fail_where_a_compiler_is(ISA_LEVELS[isa][0])
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setattr(cpu_kernel, "library", lambda: lib)
    return isa, lib


def _fail_where_a_compiler_is(march: str) -> None:
    """With a C++ compiler on the PATH a build that failed is an error, raised here with the compiler's message: the
    kernel's tests skip where no build exists, so a compile error would otherwise pass as skips."""
    if shutil.which(os.environ.get("CXX") or "g++"):
        cpu_kernel.load(cpu_kernel.build(march=march))


def test_the_whole_cpu_build_compiles_where_a_compiler_is():
    """The build the library uses by default (``-march=native``) exists wherever a compiler does."""
    if cpu_kernel.library_for(None) is None:
        _fail_where_a_compiler_is("native")
        pytest.skip("no C++ compiler on this machine")


def test_levels_follow_the_cpu_flags():
    """Each level needs its flags and every level below it."""
    avx2 = "flags : fpu sse2 avx avx2 fma f16c bmi1 bmi2"
    avx512 = avx2 + " avx512f avx512bw avx512vl avx512dq avx512cd"
    assert cpu_kernel.cpu_isa_levels(avx2) == ["avx2"]
    assert cpu_kernel.cpu_isa_levels(avx512) == ["avx2", "avx512"]
    assert cpu_kernel.cpu_isa_levels(avx512 + " avx512_bf16 avx512_vnni") == ["avx2", "avx512", "avx512_bf16"]
    assert cpu_kernel.cpu_isa_levels(avx512 + " avx512_bf16 avx512_vnni amx_tile amx_bf16") == list(ISA_LEVELS)
    assert cpu_kernel.cpu_isa_levels(avx512 + " amx_tile amx_bf16") == ["avx2", "avx512"]  # no AVX512-BF16
    assert cpu_kernel.cpu_isa_levels("flags : fpu sse2 avx") == []


def test_isa_override_errors(monkeypatch):
    """An unknown level, or one above the CPU's, is one ValueError naming ``COMPILED_ATTN_ISA`` and what the CPU
    supports; unset, empty or ``native`` builds for the whole CPU; a bad value stops ``library()`` too."""
    monkeypatch.setattr(cpu_kernel, "_cpu_flags", lambda: "flags : avx avx2 fma f16c bmi1 bmi2")
    assert cpu_kernel.requested_isa("") is None and cpu_kernel.requested_isa("native") is None
    assert cpu_kernel.requested_isa("avx2") == "avx2"
    with pytest.raises(ValueError, match=r"COMPILED_ATTN_ISA='amx' is above what this CPU supports \(avx2\)"):
        cpu_kernel.requested_isa("amx")
    with pytest.raises(ValueError, match=r"COMPILED_ATTN_ISA='sse9' is not a level: one of avx2, avx512, "
                                         r"avx512_bf16, amx or native \(this CPU supports: avx2\)"):
        cpu_kernel.requested_isa("sse9")
    monkeypatch.setenv(cpu_kernel.ISA_ENV, "avx512")
    try:
        cpu_kernel.library.cache_clear()
        with pytest.raises(ValueError, match="COMPILED_ATTN_ISA='avx512' is above"):
            cpu_kernel.library()
    finally:
        monkeypatch.undo()
        cpu_kernel.library.cache_clear()


def test_each_level_builds_what_it_names(level_kernel):
    """A level's build is cached under its own name (the ``-march`` is part of the key) and runs that level's
    instructions and no higher ones (``ca_isa``)."""
    isa, lib = level_kernel
    assert ISA_LEVELS[isa][0] in lib._name
    bits = lib.ca_isa()
    assert bits & ~ISA_TILES_USABLE == LEVEL_BITS[isa]
    assert not bits & ISA_TILES_USABLE or isa == "amx"


def _one_block_call(kv_dtype, q_bf16: bool, g: int, d: int, dv: int):
    """A call of one row, one KV head with ``g`` query rows and one block of 16 keys, q bf16 (``q_bf16_scale`` 1.0)
    or float32: (merged op args, the float64 reference's output)."""
    gen = torch.Generator().manual_seed(g * 1000 + d)
    q = torch.randn(1, g, d, generator=gen).to(torch.bfloat16 if q_bf16 else torch.float32)
    k_cache = torch.randn(16, 1, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(16, 1, dv, generator=gen).to(kv_dtype)
    slots = torch.arange(16)
    args = (q, torch.zeros(1, dtype=torch.long), slots[None], torch.ones(1, 16, dtype=torch.bool), k_cache,
            v_cache, d ** -0.5, 1.0, 0.0, 1, None, 1.0 if q_bf16 else 0.0)
    return args, keys_attention(q, [slots], k_cache, v_cache, k_scale=d ** -0.5)


def test_the_kernel_accepts_exactly_the_paths_path_fits_names(level_kernel):
    """Every path, cache dtype, bf16 or float32 query, row count and head size, asked of the merged op by name for a
    call of one block: the kernel runs a path where ``path_fits`` says it fits (and gives the float64 softmax) and
    refuses it otherwise (a ValueError naming the path), so the Python choice and the kernel agree."""
    _, lib = level_kernel
    bits = lib.ca_isa()
    for dtype in KINDS:
        for q_bf16 in (False, True):
            for g in (1, 2, 4, 8, 12, 16, 20, 32, 48):
                for d, dv in ((64, 64), (128, 128), (256, 256), (80, 80), (96, 96), (576, 512)):
                    args, want = _one_block_call(dtype, q_bf16, g, d, dv)
                    tol = 3e-2 if q_bf16 else 1e-4  # bf16: the output's rounding, the tile path's weights'
                    for path in PATHS:
                        if not path_fits(path, dtype, q_bf16, g, d, dv, bits):
                            with pytest.raises(ValueError, match=f"path '{path}' does not serve this call"):
                                native_decode_blocks(*args, path=path)
                            continue
                        got = native_decode_blocks(*args, path=path).double()
                        assert (got - want).abs().max() < tol, (path, dtype, q_bf16, g, d, dv)


#: a decode case for each path (hq, hkv, d, q dtype, cache dtype) and a verify case (k draft tokens)
PATH_CASES = {
    "tile": dict(hq=16, hkv=2, d=64, q=torch.bfloat16, kv=torch.bfloat16, k=2),
    "wide": dict(hq=32, hkv=2, d=80, q=torch.float32, kv=torch.float16, k=2),
    "vector_bf16": dict(hq=8, hkv=2, d=128, q=torch.bfloat16, kv=torch.float8_e4m3fn, k=2),
    "vector": dict(hq=12, hkv=3, d=32, q=torch.float32, kv=torch.float32, k=2),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_path_of_every_level_matches_float64(level_kernel, path):
    """Where this level's build has the path (``path_fits`` with its bits), the dispatchers take it for the path's
    case (``choose_form`` names it) and decode (pages of 16, soft-cap, sinks) and verify (a tree mask) equal the
    float64 reference."""
    isa, lib = level_kernel
    c = PATH_CASES[path]
    group = c["hq"] // c["hkv"]
    if not path_fits(path, c["kv"], c["q"] == torch.bfloat16, group, c["d"], c["d"], lib.ca_isa()):
        pytest.skip(f"the {isa} build has no {path} path")
    tol = 1e-4 if c["q"] == torch.float32 else 3e-2
    b = make_batch([1, 40, 300], hq=c["hq"], hkv=c["hkv"], dqk=c["d"], decode=True, page_size=16, seed=3,
                   kv_dtype=c["kv"])
    q = b.q.to(c["q"])
    choice = choose_form("decode", q, b.k_cache, b.v_cache, rows_per_kv_head=group)
    assert (choice.form, choice.path) == ("kernel", path), choice
    meta = plan_decode(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, page_size=16)
    index = build_decode_index(b.req_to_token, meta.inputs, 16)
    sinks = torch.linspace(-1.0, 1.0, c["hq"])
    out = decode_blocks(q, b.k_cache, b.v_cache, index, 0.2, logit_cap=4.0, sinks=sinks)
    ref = reference_attention(q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens, b.prefix_lens, b.ext_lens,
                              scale=0.2, logit_cap=4.0, sinks=sinks)
    assert (out.double() - ref).abs().max() < tol
    k = c["k"]
    vb, prefix = _case([5, 0, 130], k, hq=c["hq"] // k, hkv=c["hkv"], d=c["d"], kv_dtype=c["kv"], seed=4)
    vq = vb.q.to(c["q"])
    choice = choose_form("verify", vq, vb.k_cache, vb.v_cache, rows_per_kv_head=group)
    assert (choice.form, choice.path) == ("kernel", path), choice
    masks = random_trees(3, k, torch.Generator().manual_seed(6))
    out = verify_attention(vq, vb.k_cache, vb.v_cache, vb.req_to_token, vb.rows, prefix, k, masks.reshape(-1))
    ref = reference_verify(vq, vb.k_cache, vb.v_cache, vb.req_to_token, vb.rows, prefix, k, masks, c["d"] ** -0.5)
    assert (out.double() - ref).abs().max() < tol


def _call(hq, hkv, d, dv=None, *, dtype=torch.float32, kv=None, device="cpu"):
    q = torch.zeros(2, hq, d, dtype=dtype, device=device)
    k_cache = torch.zeros(8, hkv, d, dtype=kv or dtype, device=device)
    return q, k_cache, k_cache[..., :dv] if dv else k_cache.clone()


@pytest.fixture
def build_with(monkeypatch):
    """Makes ``choose_form`` see a kernel build with the given ``ISA_*`` bits (None: no kernel built)."""
    def use(bits):
        monkeypatch.setattr(cpu_kernel, "native_available", lambda: bits is not None)
        monkeypatch.setattr(cpu_kernel, "kernel_isa_bits", lambda: bits or 0)
    return use


AMX_BITS = LEVEL_BITS["amx"] | ISA_TILES_USABLE


def test_choice_with_each_kind_of_build(build_with):
    """The forms and paths of ``forms``' docstring, for builds this machine may not have: the kernel wherever it
    serves the call, its path by the rows and the build's instructions, MLA's latent; without a build, the matmul
    form."""
    def choose(site, call, rows, **kw):
        c = choose_form(site, *call, rows_per_kv_head=rows, **kw)
        return c.form, c.path

    bf16_gqa, f32_gqa = _call(16, 2, 64, dtype=torch.bfloat16), _call(16, 2, 64)
    build_with(AMX_BITS)
    assert choose("decode", bf16_gqa, 8) == ("kernel", "tile")
    assert choose("verify", bf16_gqa, 32) == ("kernel", "tile")
    assert choose("decode", f32_gqa, 8) == ("kernel", "vector")
    assert choose("verify", f32_gqa, 32) == ("kernel", "wide")
    assert choose("decode", _call(16, 1, 576, 512, dtype=torch.bfloat16), 16) == ("kernel", "tile")
    build_with(LEVEL_BITS["avx512_bf16"])
    assert choose("decode", bf16_gqa, 8) == ("kernel", "vector_bf16")
    assert choose("decode", bf16_gqa, 16) == ("kernel", "wide")
    assert choose("verify", bf16_gqa, 20) == ("kernel", "vector_bf16")
    assert choose("decode", _call(8, 2, 80, dtype=torch.bfloat16), 4) == ("kernel", "vector")  # no compiled-in 80
    build_with(LEVEL_BITS["avx2"])
    assert choose("decode", bf16_gqa, 8) == ("kernel", "vector")
    c = choose_form("decode", *bf16_gqa, rows_per_kv_head=8)
    assert "no AVX512-BF16 in this build" in c.reason
    build_with(None)
    assert choose("decode", f32_gqa, 8) == ("matmul", "")
    assert choose("verify", bf16_gqa, 16) == ("matmul", "")
    assert choose("decode", _call(16, 1, 576, 512), 16) == ("matmul", "")
    assert "not built" in choose_form("decode", *f32_gqa, rows_per_kv_head=8).reason


def test_named_forms_and_other_devices(build_with):
    """A named form runs as named, or is a ValueError naming ``form`` and why not; a device that is not a CPU (nor
    CUDA) takes the matmul form."""
    build_with(AMX_BITS)
    call = _call(8, 2, 64)
    assert choose_form("decode", *call, rows_per_kv_head=4, form="matmul").form == "matmul"
    assert choose_form("decode", *call, rows_per_kv_head=4, form="kernel").form == "kernel"
    assert choose_form("decode", *call, rows_per_kv_head=4, form=None).form == "kernel"
    with pytest.raises(ValueError, match="form must be one of"):
        choose_form("decode", *call, rows_per_kv_head=4, form="flash")
    meta = choose_form("decode", *_call(8, 2, 64, device="meta"), rows_per_kv_head=4)
    assert (meta.form, meta.path) == ("matmul", "") and "not a CPU call (meta)" in meta.reason
    with pytest.raises(ValueError, match="form='kernel': the C\\+\\+ kernel cannot serve this call"):
        choose_form("decode", *_call(8, 2, 64, device="meta"), rows_per_kv_head=4, form="kernel")


def test_explain_logs_each_choice_once(monkeypatch, caplog):
    """``COMPILED_ATTN_EXPLAIN=1``: one line per distinct choice (site, shapes, dtypes, form, path, reason): a second
    batch of the same shapes logs nothing, another head layout logs again, and a compiled step logs at trace time;
    unset, nothing."""
    b = make_batch([5, 70], hq=8, hkv=2, dqk=32, decode=True, seed=1)
    meta = plan_decode(b.q, b.k_cache, b.v_cache, b.req_to_token, b.rows, b.seq_lens)
    index = build_decode_index(b.req_to_token, meta.inputs, host_form=False)
    forms._log_line.cache_clear()
    with caplog.at_level(logging.INFO, logger="compiled_attn.forms"):
        decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3)
        assert not caplog.records
        monkeypatch.setenv(forms.EXPLAIN_ENV, "1")
        for _ in range(2):
            decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3)
        decode_blocks(b.q, b.k_cache, b.v_cache, index, 0.3, form="matmul")
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2, lines
        choice = choose_form("decode", b.q, b.k_cache, b.v_cache, rows_per_kv_head=4)
        assert lines[0].startswith("compiled_attn: decode_blocks (eager, cpu) q [*, 8, 32] float32, kv [*, 2, "
                                   "32/32] float32, 4 rows per KV head -> form ")
        assert lines[0].endswith(f"{choice.form}{' path ' + choice.path if choice.path else ''}: {choice.reason}")
        assert "form matmul" in lines[1] and "form='matmul' given" in lines[1]
        torch._dynamo.reset()
        step = torch.compile(lambda q, kc, vc: decode_blocks(q, kc, vc, index, 0.3), fullgraph=True, dynamic=True,
                             backend="eager")
        torch.testing.assert_close(step(b.q, b.k_cache, b.v_cache), decode_blocks(b.q, b.k_cache, b.v_cache, index,
                                                                                 0.3))
        compiled = [r.getMessage() for r in caplog.records[2:]]
        assert len(compiled) == 1, compiled
        assert compiled[0].startswith("compiled_attn: decode_blocks (compiled, cpu) q float32, kv float32 (sizes "
                                      "traced) -> form "), compiled


def test_three_rows_per_kv_head_stay_on_the_kernel(build_with):
    """SmolLM2-135M's heads (9 query / 3 KV heads of 64: 3 rows per KV head, no multiple of 4) are served by the
    kernel's vector path at every level, over float32 and bf16 caches, not by the matmul form."""
    for bits in (AMX_BITS, LEVEL_BITS["avx512_bf16"], LEVEL_BITS["avx2"]):
        build_with(bits)
        for dtype in (torch.float32, torch.bfloat16):
            c = choose_form("decode", *_call(9, 3, 64, dtype=dtype), rows_per_kv_head=3)
            assert (c.form, c.path) == ("kernel", "vector"), (bits, dtype, c)
