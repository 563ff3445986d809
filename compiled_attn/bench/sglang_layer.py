"""``compiled-attn bench-sglang``: our SGLang backend vs SGLang's own ``torch_native``, same ForwardBatches.

Per case, one attention layer through SGLang's ``RadixAttention`` (K/V write included), the way ``ModelRunner``
drives it: metadata for the forward, then the layer. Columns (milliseconds; medians over rounds that call each
column once, so load from other processes hits every column alike):

- ``torch_native``: SGLang's ``TorchNativeAttnBackend`` (``init_forward_metadata`` + layer).
- ``eager``: ours without graph state (exact-size plan + index + layer).
- ``compiled`` (decode only): what SGLang's graph runners run: the out-of-graph checks and the in-graph metadata
  (static buffers, block capacity per batch size) eagerly, then ``forward_decode`` compiled through
  ``compile_step`` (this project's policy, ``dynamic=True``); ``compiled-fixed``: the same with ``dynamic=False``, as
  SGLang's ``CPUGraphRunner`` compiles the model. ``blocks`` = KV blocks the batch needs / the capacity the graph
  computes over. ``compile_s``: first call (inductor's caches make a second run of the script fast).

Decode: each request has a context of 768..1280 tokens (mean ~1024). Extend: 256 new tokens on a 768-token cached
prefix (chunked prefill). MHA: 32 q heads, 8 KV heads, head dim 128; MLA (absorbed): 16 heads, 576/512.
Needs SGLang installed (see requirements-sglang*.txt); drives it through ``compiled_attn.sglang.testing``.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from profiling.timers import format_table, median, time_interleaved

from ..compile_policy import compile_step
from .models import get_attention_shape

MAX_CONTEXT = 1280


def _harness():
    from ..sglang import testing  # applies the torchvision fix-up; sglang itself is imported by import_sglang

    return testing


def _geometries(H):
    """The one preset table's attention shapes as SGLang geometries."""
    mha, mla = get_attention_shape("mha"), get_attention_shape("mla")
    return {"mha": H.gqa(num_heads=mha.hq, num_kv_heads=mha.hkv, head_dim=mha.dqk, name="mha"),
            "mla": H.mla_absorbed(num_heads=mla.hq, kv_lora_rank=mla.dv, qk_rope_head_dim=mla.dqk - mla.dv)}


def bench_case(H, geom_name: str, mode: str, bs: int, *, iters: int, budget_s: float, seed: int = 0) -> dict:
    # SGLang's parallel names stated once for the case, as a server states them once: the harness states the
    # unset ones per call, and that override cost ~1.5 ms a call here (more than our bs-1 layer), which no server pays
    with H.parallel_scope():
        return _bench_case(H, geom_name, mode, bs, iters=iters, budget_s=budget_s, seed=seed)


def _bench_case(H, geom_name: str, mode: str, bs: int, *, iters: int, budget_s: float, seed: int) -> dict:
    from ..sglang.backend import CompiledAttnBackend

    sg = H.import_sglang()
    g = _geometries(H)[geom_name]
    gen = torch.Generator().manual_seed(seed + bs)
    lens = torch.randint(768, MAX_CONTEXT + 1, (bs,), generator=gen).tolist()

    def setup():
        mr = H.make_model_runner(g, max_num_reqs=bs + 1, max_context_len=MAX_CONTEXT,
                                 pool_size=bs * MAX_CONTEXT + 16, seed=seed)
        batch = (H.make_decode_batch(mr, lens) if mode == "decode"
                 else H.make_extend_batch(mr, [256] * bs, [768] * bs))
        return mr, batch

    layer = H.make_layer(g)
    row = {"case": f"{geom_name} {mode} bs={bs}"}

    def layer_fn(backend, batch):
        return lambda: H.run_sglang_layer(backend, layer, batch.forward_batch, batch.q, batch.k, batch.v)

    fns = {}
    mr, batch = setup()
    fns["torch_native"] = layer_fn(H.make_torch_native_backend(mr), batch)
    mr, batch = setup()
    fns["eager"] = layer_fn(CompiledAttnBackend(mr), batch)
    if mode == "decode":
        mr, batch = setup()
        backend = CompiledAttnBackend(mr)
        backend.init_cuda_graph_state(bs, bs)
        fb = batch.forward_batch
        k = batch.k.view(bs, g.num_kv_heads, g.head_dim)
        v = batch.v.view(bs, g.num_kv_heads, g.v_head_dim)

        def compiled_fn(dynamic):
            step = compile_step(lambda q, k, v, fb: backend.forward_decode(q, k, v, layer, fb), dynamic=dynamic)

            def run():
                with H.parallel_scope():
                    backend.init_forward_metadata_out_graph(fb)
                    backend.init_forward_metadata_in_graph(fb)
                    with sg.forward_context(sg.ForwardContext(attn_backend=backend), forward_batch=fb):
                        return step(batch.q, k, v, fb)

            return run

        for name, dynamic in (("compiled", True), ("compiled-fixed", False)):
            fns[name] = compiled_fn(dynamic)
            start = time.perf_counter()
            fns[name]()
            row[f"{name} compile_s"] = time.perf_counter() - start
        needed = sum(-(-n // backend.block_size) for n in lens)
        row["blocks"] = f"{needed}/{backend.graph_block_capacity(bs)}"
    times = time_interleaved(fns, warmup=1, iters=iters, budget_s=budget_s)
    row.update({name: median(t) * 1e3 for name, t in times.items()})
    row["x eager"] = row["torch_native"] / row["eager"]
    for name in ("compiled", "compiled-fixed"):
        if name in row:
            row[f"x {name}"] = row["torch_native"] / row[name]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compiled-attn bench-sglang", description=__doc__.split("\n\n")[0])
    p.add_argument("--geometries", nargs="+", default=["mha", "mla"], choices=["mha", "mla"])
    p.add_argument("--modes", nargs="+", default=["decode", "extend"], choices=["decode", "extend"])
    p.add_argument("--batch-size", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--iters", type=int, default=20, help="most timed calls per measurement (at least 3)")
    p.add_argument("--budget-s", type=float, default=6.0, help="about this long per case")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        H = _harness()
        H.import_sglang()
    except ImportError as e:
        print(f"compiled-attn bench-sglang: SGLang is not importable here ({e}); install requirements-sglang*.txt",
              file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, one layer per step "
          f"(metadata + K/V write + attention); times in ms", flush=True)
    rows = []
    for geom in args.geometries:
        for mode in args.modes:
            for bs in args.batch_size:
                try:
                    rows.append(bench_case(H, geom, mode, bs, iters=args.iters, budget_s=args.budget_s))
                except Exception as e:
                    rows.append({"case": f"{geom} {mode} bs={bs}", "blocks": f"error: {type(e).__name__}: {e}"})
                print(format_table([rows[-1]], COLUMNS, precision=2).splitlines()[-1], flush=True)
    print()
    print(format_table(rows, COLUMNS, precision=2))
    return 0


COLUMNS = ["case", "torch_native", "eager", "compiled", "compiled-fixed", "x eager", "x compiled", "x compiled-fixed",
           "blocks", "compiled compile_s", "compiled-fixed compile_s"]

if __name__ == "__main__":
    raise SystemExit(main())
