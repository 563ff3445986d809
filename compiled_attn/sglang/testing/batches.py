"""Hand-made SGLang ``ForwardBatch``es and one layer run the way ``ModelRunner`` drives it.

Layout conventions, as in SGLang:
  * ``req_to_token``: ``[max_num_reqs + 1, max_context_len]`` int32; row 0 is the padding row.
  * KV pool rows: ``size + page_size``; slot 0 (page 0) is the padding slot.
  * q: ``[num_tokens, num_heads * head_dim]``; k: ``[num_tokens, num_kv_heads * head_dim]``;
    v: ``[num_tokens, num_kv_heads * v_head_dim]`` (flattened, as models pass them;
    ``RadixAttention.forward`` views k/v as 3-D, the backend views q).
  * output: ``[num_tokens, num_heads * v_head_dim]``.
  * MLA absorbed (``MLATokenToKVPool``): one KV "head" of ``kv_lora_rank + qk_rope_head_dim``
    (576); the pool stores only k, and the value buffer is ``k[..., :kv_lora_rank]``, so v
    must equal ``k[..., :kv_lora_rank]`` (the builders make it so).
  * sliding window ``W`` (``RadixAttention.sliding_window_size``): a query at position i sees
    keys at positions ``i - W .. i`` (W + 1 keys; SGLang passes HF's ``sliding_window - 1``).
    ``-1``, None and also ``0`` mean no window (``RadixAttention`` stores
    ``sliding_window_size or -1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .geometry import AttnGeometry, make_layer, make_torch_native_backend
from .runtime import import_sglang, parallel_scope

# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------


@dataclass
class LayerData:
    """One layer's inputs for a batch, plus what is already cached for each request."""

    q: torch.Tensor  # [num_tokens, H * D]
    k: torch.Tensor  # [num_tokens, Hkv * D]   (new tokens, written by the forward)
    v: torch.Tensor  # [num_tokens, Hkv * Dv]
    prefix_k: list[torch.Tensor]  # per request [prefix_len, Hkv, D], already in the pool
    prefix_v: list[torch.Tensor]  # per request [prefix_len, Hkv, Dv]


@dataclass
class BatchData:
    forward_batch: object  # sglang ForwardBatch
    mode: str  # "extend" | "decode"
    geometry: AttnGeometry
    req_to_token: torch.Tensor  # the pool's table itself [max_num_reqs + 1, max_context_len] int32
    req_pool_indices: torch.Tensor  # [bs] int64 (padded rows, if any, are 0)
    seq_lens: torch.Tensor  # [bs] int64 (prefix + new tokens)
    extend_prefix_lens: torch.Tensor  # [bs] int32 (decode: seq_lens - 1)
    extend_seq_lens: torch.Tensor  # [bs] int32 (decode: ones)
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    layers: dict[int, LayerData] = field(default_factory=dict)
    num_real_reqs: int = 0  # rows before any padding
    num_real_tokens: int = 0

    # The first layer's tensors, for single-layer use.
    @property
    def _first(self) -> LayerData:
        return self.layers[min(self.layers)]

    @property
    def q(self):
        return self._first.q

    @property
    def k(self):
        return self._first.k

    @property
    def v(self):
        return self._first.v

    @property
    def prefix_k(self):
        return self._first.prefix_k

    @property
    def prefix_v(self):
        return self._first.prefix_v

    def plain(self) -> dict:
        """The plain tensors, by name, to feed our own functions (first layer)."""
        return dict(
            q=self.q, k=self.k, v=self.v, req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            extend_prefix_lens=self.extend_prefix_lens, extend_seq_lens=self.extend_seq_lens,
            out_cache_loc=self.out_cache_loc, positions=self.positions,
        )


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


def _new_kv(geom: AttnGeometry, n: int, dtype, gen):
    """k [n, Hkv, D], v [n, Hkv, Dv]; for absorbed MLA v is k's latent part."""
    k = _rand((n, geom.num_kv_heads, geom.head_dim), dtype, gen)
    if geom.mla:
        v = k[..., : geom.kv_lora_rank].clone()
    else:
        v = _rand((n, geom.num_kv_heads, geom.v_head_dim), dtype, gen)
    return k, v


def write_kv(model_runner, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Put K/V for tokens at slots ``loc`` into the pool, through the pool's own writer (a hybrid sliding-window
    pool's with the translated location too, as SGLang's backends hand it)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    layer = make_layer(model_runner.geometry, layer_id)
    device = torch.device(model_runner.device)
    loc = loc.to(device)
    swa = getattr(model_runner, "swa_memory", None)
    where = KVWriteLoc(loc, swa.translate(loc)) if swa is not None else loc
    with parallel_scope():
        model_runner.token_to_kv_pool.set_kv_buffer(layer, where, k.to(device), v.to(device))


def read_kv(model_runner, layer_id: int, loc: torch.Tensor):
    """(k, v) stored at slots ``loc``: [n, Hkv, D], [n, Hkv, Dv] (a window layer of a hybrid sliding-window pool:
    at the translated slots)."""
    pool = model_runner.token_to_kv_pool
    swa = getattr(model_runner, "swa_memory", None)
    if swa is not None and pool.layers_mapping[layer_id][1]:
        loc = swa.translate(loc)
    return pool.get_key_buffer(layer_id)[loc], pool.get_value_buffer(layer_id)[loc]


def _alloc_slots(model_runner, n: int) -> list[int]:
    """``n`` KV slots for one request: scattered slots, or (paged pool) scattered whole pages, position ``p`` at
    offset ``p % page_size`` of its page, as SGLang's paged allocator lays them out. A hybrid sliding-window pool
    (``swa.make_swa_model_runner``) pairs each with a window-pool slot."""
    page = model_runner.page_size
    if page == 1:
        slots = model_runner.slot_allocator.alloc(n).tolist()
    else:
        pages = model_runner.page_allocator.alloc(-(-n // page))
        slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:n].tolist()
    swa = getattr(model_runner, "swa_memory", None)
    if swa is not None:
        swa.pair(slots)
    return slots


def _build(
    model_runner,
    mode: str,
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    layer_ids: Sequence[int],
    dtype: torch.dtype | None,
    pad_to_bs: int | None,
    seq_len_fill_value: int,
):
    sg = import_sglang()
    geom: AttnGeometry = model_runner.geometry
    gen = model_runner.generator
    dtype = dtype or model_runner.dtype
    bs = len(new_lens)
    assert len(prefix_lens) == bs
    seq_lens_l = [p + n for p, n in zip(prefix_lens, new_lens, strict=False)]
    assert max(seq_lens_l) <= model_runner.req_to_token_pool.max_context_len

    rows = model_runner.req_allocator.alloc(bs).tolist()
    req_to_token = model_runner.req_to_token_pool.req_to_token
    out_cache_loc_l: list[int] = []
    prefix_locs = []
    for i in range(bs):
        slots = _alloc_slots(model_runner, seq_lens_l[i])
        req_to_token[rows[i], : seq_lens_l[i]] = torch.tensor(slots, dtype=torch.int32)
        prefix_locs.append(torch.tensor(slots[: prefix_lens[i]], dtype=torch.int64))
        out_cache_loc_l += slots[prefix_lens[i] :]

    num_tokens = sum(new_lens)
    layers = {}
    for lid in layer_ids:
        q = _rand((num_tokens, geom.num_heads * geom.head_dim), dtype, gen)
        k, v = _new_kv(geom, num_tokens, dtype, gen)
        pks, pvs = [], []
        for i in range(bs):
            pk, pv = _new_kv(geom, prefix_lens[i], dtype, gen)
            if prefix_lens[i]:
                write_kv(model_runner, lid, prefix_locs[i], pk, pv)
            pks.append(pk)
            pvs.append(pv)
        layers[lid] = LayerData(q=q, k=k.reshape(num_tokens, -1), v=v.reshape(num_tokens, -1),
                                prefix_k=pks, prefix_v=pvs)

    positions = torch.cat(
        [torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(prefix_lens, new_lens, strict=False)]
    )
    req_pool_indices = torch.tensor(rows, dtype=torch.int64)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int64)
    out_cache_loc = torch.tensor(out_cache_loc_l, dtype=torch.int64)
    extend_prefix_lens = torch.tensor(list(prefix_lens), dtype=torch.int32)
    extend_seq_lens = torch.tensor(list(new_lens), dtype=torch.int32)

    num_real_tokens = num_tokens
    if pad_to_bs is not None and pad_to_bs > bs:
        # CUDA/CPU-graph style padding: padded rows use request row 0 and slot 0.
        assert mode == "decode", "padding is modelled for decode batches only"
        pad = pad_to_bs - bs
        req_pool_indices = torch.cat([req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
        seq_lens = torch.cat([seq_lens, torch.full((pad,), seq_len_fill_value, dtype=torch.int64)])
        out_cache_loc = torch.cat([out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
        positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int64)])
        pad_prefix = torch.full((pad,), seq_len_fill_value - 1, dtype=torch.int32)
        extend_prefix_lens = torch.cat([extend_prefix_lens, pad_prefix])
        extend_seq_lens = torch.cat([extend_seq_lens, torch.ones(pad, dtype=torch.int32)])
        for ld in layers.values():
            ld.q = torch.cat([ld.q, ld.q.new_zeros(pad, ld.q.shape[1])])
            ld.k = torch.cat([ld.k, ld.k.new_zeros(pad, ld.k.shape[1])])
            ld.v = torch.cat([ld.v, ld.v.new_zeros(pad, ld.v.shape[1])])
        bs, num_tokens = pad_to_bs, num_tokens + pad

    device = torch.device(model_runner.device)
    if device.type != "cpu":
        seq_lens_cpu = seq_lens
        req_pool_indices, seq_lens, out_cache_loc, positions, extend_prefix_lens, extend_seq_lens = (
            t.to(device) for t in (req_pool_indices, seq_lens, out_cache_loc, positions,
                                   extend_prefix_lens, extend_seq_lens))
        for ld in layers.values():
            ld.q, ld.k, ld.v = ld.q.to(device), ld.k.to(device), ld.v.to(device)
    else:
        seq_lens_cpu = seq_lens.clone()

    fb_kwargs = dict(
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens_cpu,
        positions=positions,
    )
    if mode == "extend":
        fb = sg.ForwardBatch(
            forward_mode=sg.ForwardMode.EXTEND,
            extend_prefix_lens=extend_prefix_lens,
            extend_seq_lens=extend_seq_lens,
            extend_prefix_lens_cpu=extend_prefix_lens.tolist(),
            extend_seq_lens_cpu=extend_seq_lens.tolist(),
            extend_num_tokens=num_tokens,
            extend_start_loc=torch.cumsum(extend_seq_lens, 0, dtype=torch.int32) - extend_seq_lens,
            max_seq_len_host=int(seq_lens_cpu.max()),
            **fb_kwargs,
        )
    else:
        fb = sg.ForwardBatch(forward_mode=sg.ForwardMode.DECODE,
                             max_seq_len_host=int(seq_lens_cpu.max()), **fb_kwargs)

    return BatchData(
        forward_batch=fb, mode=mode, geometry=geom, req_to_token=req_to_token,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        extend_prefix_lens=extend_prefix_lens, extend_seq_lens=extend_seq_lens,
        out_cache_loc=out_cache_loc, positions=positions, layers=layers,
        num_real_reqs=len(new_lens), num_real_tokens=num_real_tokens,
    )


def make_extend_batch(
    model_runner,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int] | None = None,
    *,
    layer_ids: Sequence[int] = (0,),
    dtype: torch.dtype | None = None,
) -> BatchData:
    """An EXTEND batch. With ``prefix_lens`` (chunked prefill / radix-cache hit) the
    prefix tokens' K/V are already in the pool, in every layer of ``layer_ids``.

    Request rows and KV slots are scattered and out of order (never row 0 / slot 0).
    """
    prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * len(extend_lens)
    return _build(model_runner, "extend", prefix_lens, list(extend_lens), layer_ids, dtype, None, 1)


def make_decode_batch(
    model_runner,
    seq_lens: Sequence[int],
    *,
    layer_ids: Sequence[int] = (0,),
    dtype: torch.dtype | None = None,
    pad_to_bs: int | None = None,
    seq_len_fill_value: int = 1,
) -> BatchData:
    """A DECODE batch: request i has ``seq_lens[i] - 1`` tokens cached, 1 new token.

    ``pad_to_bs`` appends graph-style padding rows (req row 0, slot 0, seq_len
    ``seq_len_fill_value``, zero q/k/v), as SGLang's graph runners do.
    """
    assert all(s >= 1 for s in seq_lens)
    return _build(model_runner, "decode", [s - 1 for s in seq_lens], [1] * len(seq_lens),
                  layer_ids, dtype, pad_to_bs, seq_len_fill_value)


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def run_sglang_layer(backend, layer, forward_batch, q, k, v, *, save_kv_cache: bool = True,
                     init_metadata: bool = True, **layer_kwargs):
    """One ``RadixAttention.forward`` through ``backend``, as ``ModelRunner`` drives it.

    ``ModelRunner`` calls ``attn_backend.init_forward_metadata(forward_batch)`` once per
    forward (before the first layer) and publishes a ``ForwardContext`` whose backend
    ``RadixAttention.forward`` looks up (``get_attn_backend()``); the layer then calls
    ``backend.forward`` -> ``forward_extend`` / ``forward_decode`` by ``forward_mode``.
    Pass ``init_metadata=False`` for the second and later layers of one forward; ``layer_kwargs`` go to the layer
    call as a model passes them (e.g. gpt-oss's ``sinks=``).

    Returns ``(output [num_tokens, H * Dv], backend.token_to_kv_pool)``.
    """
    sg = import_sglang()
    with parallel_scope():
        if init_metadata:
            backend.init_forward_metadata(forward_batch)
        with sg.forward_context(sg.ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            out = layer(q, k, v, forward_batch, save_kv_cache=save_kv_cache, **layer_kwargs)
    return out, backend.token_to_kv_pool


def run_sglang(model_runner, batch: BatchData, *, layer_id: int = 0, sliding_window_size: int = -1,
               backend=None):
    """Convenience: build the backend and layer, run ``batch``'s layer ``layer_id``."""
    backend = backend if backend is not None else make_torch_native_backend(model_runner)
    layer = make_layer(model_runner.geometry, layer_id, sliding_window_size)
    ld = batch.layers[layer_id]
    return run_sglang_layer(backend, layer, batch.forward_batch, ld.q, ld.k, ld.v)


def request_kv(batch: BatchData, i: int, layer_id: int = 0):
    """Full K/V of request i (prefix then new tokens): [seq_len, Hkv, D], [seq_len, Hkv, Dv]."""
    g = batch.geometry
    ld = batch.layers[layer_id]
    start = int(batch.extend_seq_lens[:i].sum())
    n = int(batch.extend_seq_lens[i])
    k_new = ld.k[start : start + n].view(n, g.num_kv_heads, g.head_dim)
    v_new = ld.v[start : start + n].view(n, g.num_kv_heads, g.v_head_dim)
    return (torch.cat([ld.prefix_k[i].to(k_new.device), k_new]),
            torch.cat([ld.prefix_v[i].to(v_new.device), v_new]))


def request_q(batch: BatchData, i: int, layer_id: int = 0):
    """Queries of request i: [n_new, H, D]."""
    g = batch.geometry
    start = int(batch.extend_seq_lens[:i].sum())
    n = int(batch.extend_seq_lens[i])
    return batch.layers[layer_id].q[start : start + n].view(n, g.num_heads, g.head_dim)


def default_tolerance(dtype: torch.dtype):
    """(atol, rtol) for comparing an attention output against a float64 reference."""
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (2e-2, 2e-2)}.get(dtype, (1e-6, 1e-6))
