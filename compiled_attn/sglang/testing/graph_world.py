"""What the decode-graph replica (``graph_order``) runs on: a KV pool, layers and batches, SGLang's own where it
imports and stand-ins with the attributes the backend reads where it does not (a bare GPU machine), and the backend
class loaded over stand-ins of the SGLang names ``backend.py`` imports."""
from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .geometry import AttnGeometry
from .runtime import import_sglang, parallel_scope, sglang_available

_BACKEND_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "backend.py")
_STANDIN_BACKEND_MODULE = "compiled_attn.sglang._backend_over_standins"


# --------------------------------------------------------------------------------------------- stand-ins for SGLang


class StandinForwardMode(enum.IntEnum):
    """The ``ForwardMode`` members and predicates the backend and the replica use."""

    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3
    IDLE = 4

    def is_decode(self) -> bool:
        return self is StandinForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is StandinForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self is StandinForwardMode.TARGET_VERIFY

    def is_extend(self) -> bool:
        return self in (StandinForwardMode.EXTEND, StandinForwardMode.TARGET_VERIFY)


class _StandinAttentionBackend:
    """``AttentionBackend`` (``layers/attention/base_attn_backend.py``): its ``forward`` dispatch by mode."""

    def __init__(self):
        pass

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


class _StandinAttentionType(enum.Enum):
    """``AttentionType`` (``layers/radix_attention.py``)."""

    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


@dataclass
class _StandinKVWriteLoc:
    """``KVWriteLoc`` (``mem_cache/memory_pool.py``): where ``set_kv_buffer`` writes."""

    loc: torch.Tensor
    swa_loc: torch.Tensor | None = None
    full_loc: torch.Tensor | None = None
    physical: bool = False


def _standin_modules() -> dict[str, types.ModuleType]:
    """The three SGLang modules ``backend.py`` imports names from, holding stand-ins of those names."""
    names = {
        "sglang.srt.layers.attention.base_attn_backend": {"AttentionBackend": _StandinAttentionBackend},
        "sglang.srt.layers.radix_attention": {"AttentionType": _StandinAttentionType},
        "sglang.srt.mem_cache.memory_pool": {"KVWriteLoc": _StandinKVWriteLoc},
    }
    modules = {}
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        modules[name] = module
    return modules


def load_backend_class(standin: bool | None = None) -> type:
    """``CompiledAttnBackend``: SGLang's (``compiled_attn.sglang.backend``) where SGLang imports, else (or with
    ``standin=True``) ``backend.py`` loaded as a module of its own over stand-ins of the SGLang names it imports.

    Why a separate module: ``backend.py`` imports SGLang at module level, and a bare GPU machine has no SGLang. The
    stand-ins sit in ``sys.modules`` only while that module executes; the real entries (if any) are put back, so
    nothing else in the process sees them, and ``compiled_attn.sglang.backend`` is left alone."""
    if standin is None:
        standin = not sglang_available()
    if not standin:
        from ..backend import CompiledAttnBackend

        return CompiledAttnBackend
    loaded = sys.modules.get(_STANDIN_BACKEND_MODULE)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(_STANDIN_BACKEND_MODULE, _BACKEND_FILE)
        loaded = importlib.util.module_from_spec(spec)
        saved = {name: sys.modules.get(name) for name in _standin_modules()}
        sys.modules.update(_standin_modules())
        try:
            sys.modules[_STANDIN_BACKEND_MODULE] = loaded
            spec.loader.exec_module(loaded)
        except BaseException:
            sys.modules.pop(_STANDIN_BACKEND_MODULE, None)
            raise
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return loaded.CompiledAttnBackend


class StandinKVPool:
    """``MHATokenToKVPool`` / ``MLATokenToKVPool``: per layer K and V buffers ``[size + page_size, Hkv, D|Dv]``
    (slot 0 the padding slot); absorbed MLA keeps one latent buffer ``[rows, 1, 576]`` and V is its first
    ``kv_lora_rank`` columns (a view), as SGLang's MLA pool does."""

    def __init__(self, geom: AttnGeometry, *, size: int, num_layers: int, dtype: torch.dtype,
                 device: torch.device, page_size: int = 1):
        rows = size + page_size
        self.size, self.page_size, self.dtype, self.start_layer, self.mla = size, page_size, dtype, 0, geom.mla
        self.k_buffer = [torch.zeros(rows, geom.num_kv_heads, geom.head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)]
        if geom.mla:
            self.v_buffer = [k[..., : geom.kv_lora_rank] for k in self.k_buffer]
        else:
            self.v_buffer = [torch.zeros(rows, geom.num_kv_heads, geom.v_head_dim, dtype=dtype, device=device)
                             for _ in range(num_layers)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, layer, loc, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """cache_k: [n, Hkv, D], cache_v: [n, Hkv, Dv] at slots ``loc`` ([n], or a ``KVWriteLoc``); MLA stores K
        only (V is its view)."""
        loc = getattr(loc, "loc", loc)
        lid = layer.layer_id - self.start_layer
        self.k_buffer[lid][loc] = cache_k.to(self.dtype)
        if not self.mla:
            self.v_buffer[lid][loc] = cache_v.to(self.dtype)


@dataclass(eq=False)
class StandinLayer:
    """The ``RadixAttention`` attributes the backend reads (one tensor-parallel rank)."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    tp_v_head_num: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    attn_type: object = None


# --------------------------------------------------------------------------------------------- world and batches


@dataclass
class World:
    """A model-runner's worth of state for the backend: pools, the request table, the layers.

    runner: what ``CompiledAttnBackend(model_runner)`` reads (``device``, ``req_to_token_pool``,
    ``token_to_kv_pool``); layers: one per pool layer (``RadixAttention`` or ``StandinLayer``); standin: whether
    the SGLang types are stand-ins; next_row / next_slot: where ``make_batch`` places the next batch by default.
    """

    geometry: AttnGeometry
    runner: object
    layers: list
    standin: bool
    dtype: torch.dtype
    next_row: int = 1
    next_slot: int = 1

    @property
    def device(self) -> torch.device:
        return torch.device(self.runner.device)

    @property
    def req_to_token(self) -> torch.Tensor:
        """[max_num_reqs + 1, max_context_len] int32; row 0 the padding row."""
        return self.runner.req_to_token_pool.req_to_token

    @property
    def pool(self):
        return self.runner.token_to_kv_pool

    @property
    def forward_mode(self):
        return StandinForwardMode if self.standin else import_sglang().ForwardMode

    def scope(self, backend, forward_batch):
        """What SGLang has open around a forward: the ``ForwardContext`` that ``RadixAttention`` finds its backend
        in, and single-rank parallel names (SGLang's MLA pool reads them). Nothing for stand-ins."""
        if self.standin:
            return contextlib.nullcontext()
        sg = import_sglang()
        stack = contextlib.ExitStack()
        stack.enter_context(parallel_scope())
        stack.enter_context(sg.forward_context(sg.ForwardContext(attn_backend=backend), forward_batch=forward_batch))
        return stack


def make_world(geom: AttnGeometry, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               num_layers: int = 1, max_num_reqs: int = 16, max_context_len: int = 256, pool_size: int = 2048,
               standin: bool | None = None, seed: int = 0) -> World:
    """A world whose pools hold random K/V in every slot (so any slot a batch names holds finite keys).

    standin: None uses SGLang where it imports, True the stand-ins, False SGLang (ImportError without it).
    pool_size: KV slots, besides the padding slot 0; max_context_len: the request table's width (the graph's
    capacity follows it and the pool's size, see ``backend.py``)."""
    for name, value in (("num_layers", num_layers), ("max_num_reqs", max_num_reqs),
                        ("max_context_len", max_context_len), ("pool_size", pool_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = torch.device(device)
    if standin is None:
        standin = not sglang_available()
    if standin:
        runner = SimpleNamespace(
            device=str(device),
            req_to_token_pool=SimpleNamespace(
                req_to_token=torch.zeros(max_num_reqs + 1, max_context_len, dtype=torch.int32, device=device),
                size=max_num_reqs, max_context_len=max_context_len),
            token_to_kv_pool=StandinKVPool(geom, size=pool_size, num_layers=num_layers, dtype=dtype, device=device))
        layers = [StandinLayer(i, geom.num_heads, geom.num_kv_heads, geom.num_kv_heads, geom.head_dim,
                               geom.v_head_dim, geom.sm_scale) for i in range(num_layers)]
    else:
        from .geometry import make_layer, make_model_runner

        runner = make_model_runner(geom, dtype=dtype, num_layers=num_layers, max_num_reqs=max_num_reqs,
                                   max_context_len=max_context_len, pool_size=pool_size, device=str(device),
                                   seed=seed)
        layers = [make_layer(geom, i) for i in range(num_layers)]
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(num_layers):
        runner.token_to_kv_pool.get_key_buffer(i).normal_(generator=gen)
        if not geom.mla:  # MLA's V is a view of K
            runner.token_to_kv_pool.get_value_buffer(i).normal_(generator=gen)
    return World(geom, runner, layers, standin, dtype)


@dataclass
class DecodeBatch:
    """One decode step's real rows (no padding). Request i sits in request-table row ``req_pool_indices[i]`` with
    ``seq_lens[i]`` keys, the last of them this step's token, whose K/V the step writes at ``out_cache_loc[i]``.

    req_pool_indices, seq_lens, out_cache_loc, positions: [n] int64 on the world's device; seq_lens_cpu: [n] int64;
    q[l]: [n, Hq * D]; k[l]: [n, Hkv * D]; v[l]: [n, Hkv * Dv] per layer l (flattened, as models pass them);
    slots: [sum(seq_lens)] int64, every slot the batch's requests read (host)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slots: torch.Tensor = field(repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_cpu.shape[0])


def make_batch(world: World, seq_lens: Sequence[int], *, gen: torch.Generator | None = None,
               first_row: int | None = None, first_slot: int | None = None, slot_run: int = 1) -> DecodeBatch:
    """A decode batch of ``len(seq_lens)`` requests over rows ``first_row ..`` and slots
    ``first_slot .. first_slot + sum(seq_lens) - 1`` of the pool (default: after the previous batch's, so batches
    made one after another never share a row or a slot). The slots are handed out in runs of ``slot_run``
    consecutive slots in random order (1: every key in a slot of its own, as a fragmented pool has them).
    The keys before each request's last are whatever the pool holds; q and the new K/V are random (``gen``, host)."""
    lens = [int(n) for n in seq_lens]
    geom, table = world.geometry, world.req_to_token
    if not lens or min(lens) < 1 or max(lens) > table.shape[1]:
        raise ValueError(f"seq_lens must be 1 .. {table.shape[1]} (the request table's width) each, and not empty; "
                         f"got {lens}")
    if not isinstance(slot_run, int) or slot_run < 1:
        raise ValueError(f"slot_run must be a positive int, got {slot_run!r}")
    row0 = world.next_row if first_row is None else first_row
    slot0 = world.next_slot if first_slot is None else first_slot
    n, tokens = len(lens), sum(lens)
    if row0 < 1 or row0 + n > table.shape[0]:
        raise ValueError(f"first_row: rows {row0} .. {row0 + n - 1} do not fit the request table's rows 1 .. "
                         f"{table.shape[0] - 1}")
    slot_rows = world.pool.get_key_buffer(0).shape[0]
    if slot0 < 1 or slot0 + tokens > slot_rows:
        raise ValueError(f"first_slot: slots {slot0} .. {slot0 + tokens - 1} do not fit the pool's slots 1 .. "
                         f"{slot_rows - 1}")
    gen = gen if gen is not None else torch.Generator().manual_seed(row0 * 7919 + slot0)
    runs = torch.randperm(-(-tokens // slot_run), generator=gen)
    order = (runs[:, None] * slot_run + torch.arange(slot_run)).reshape(-1)
    slots = order[order < tokens] + slot0
    rows = torch.randperm(n, generator=gen) + row0
    starts = torch.tensor([0] + lens).cumsum(0)
    for i in range(n):
        table[int(rows[i]), : lens[i]] = slots[starts[i]: starts[i + 1]].to(table.device, torch.int32)
    last = slots[starts[1:] - 1]
    q, k, v = [], [], []
    for _ in world.layers:
        q.append(torch.randn(n, geom.num_heads * geom.head_dim, generator=gen))
        kl = torch.randn(n, geom.num_kv_heads, geom.head_dim, generator=gen)
        vl = kl[..., : geom.kv_lora_rank] if geom.mla else torch.randn(n, geom.num_kv_heads, geom.v_head_dim,
                                                                       generator=gen)
        k.append(kl.reshape(n, -1))
        v.append(vl.reshape(n, -1))
    if first_row is None:
        world.next_row = row0 + n
    if first_slot is None:
        world.next_slot = slot0 + tokens
    dev, dt = world.device, world.dtype
    lens_t = torch.tensor(lens, dtype=torch.int64)
    return DecodeBatch(rows.to(dev), lens_t.to(dev), lens_t, last.to(dev), (lens_t - 1).to(dev),
                       [t.to(dev, dt) for t in q], [t.to(dev, dt) for t in k], [t.to(dev, dt) for t in v], slots)


def kv_bytes_read(world: World, batch: DecodeBatch) -> int:
    """Bytes of K/V a decode of ``batch`` must read once per layer (every key's K and V row; MLA's latent row once)."""
    k = world.pool.get_key_buffer(0)
    row = k[0].numel() * k.element_size()
    if not world.geometry.mla:
        v = world.pool.get_value_buffer(0)
        row += v[0].numel() * v.element_size()
    return int(batch.slots.numel()) * row * len(world.layers)


def forward_batch_over(world: World, *, bs: int, input_ids, req_pool_indices, seq_lens, seq_lens_cpu, out_cache_loc,
                   positions, seq_lens_sum: int):
    """A DECODE ``ForwardBatch`` (SGLang's, or a namespace with the fields the backend reads)."""
    fields = dict(batch_size=bs, input_ids=input_ids, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                  seq_lens_cpu=seq_lens_cpu, out_cache_loc=out_cache_loc, positions=positions,
                  seq_lens_sum=seq_lens_sum)
    if world.standin:
        return SimpleNamespace(forward_mode=StandinForwardMode.DECODE, encoder_lens=None, encoder_lens_cpu=None,
                               encoder_out_cache_loc=None, spec_info=None, **fields)
    sg = import_sglang()
    return sg.ForwardBatch(forward_mode=sg.ForwardMode.DECODE, max_seq_len_host=int(seq_lens_cpu.max()), **fields)


def plain_forward_batch(world: World, batch: DecodeBatch):
    """The batch as SGLang's eager path (no graph) hands it to ``init_forward_metadata``: its own rows, unpadded."""
    return forward_batch_over(world, bs=batch.batch_size, input_ids=torch.zeros_like(batch.out_cache_loc),
                          req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                          seq_lens_cpu=batch.seq_lens_cpu, out_cache_loc=batch.out_cache_loc,
                          positions=batch.positions, seq_lens_sum=int(batch.seq_lens_cpu.sum()))


def layer_call(world: World, backend, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch
               ) -> torch.Tensor:
    """One attention layer as a model calls it: ``RadixAttention.forward`` (which views k/v as
    ``[n, Hkv, D|Dv]`` and calls the context's backend's ``forward``); for stand-ins, the same views and
    ``backend.forward``. q: [n, Hq * D]; returns [n, Hq * Dv]."""
    if not world.standin:
        return layer(q, k, v, forward_batch)
    k3 = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v3 = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
    return backend.forward(q, k3, v3, layer, forward_batch, True)


# --------------------------------------------------------------------------------------------- the runner's replica
