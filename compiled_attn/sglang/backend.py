"""SGLang 0.5.23 attention backend ``compiled_attn``: our static-shape functions behind SGLang's ``AttentionBackend``.

A drop-in for SGLang's ``torch_native`` backend (same inputs, same outputs, same KV-pool writes) that batches
requests instead of looping over them and can be graph-captured, so SGLang's decode graph runners (CUDA graphs;
on CPU, ``CPUGraphRunner``'s ``torch.compile`` of the model) work with it. Selected by
``--attention-backend compiled_attn`` once the plugin (``compiled_attn.sglang.plugin``) is loaded.

Per forward, ``init_forward_metadata`` records the batch; the host-side plan (``plan_decode`` / ``plan_extend``)
and the per-step index (``build_decode_index`` / ``build_extend_tile_index``) are built once per *layer configuration*
``(sliding window, cross-attention, causal)`` on its first layer and shared by every later layer of that forward.

Hybrid sliding-window memory (``SWAKVPool``): a window layer is a configuration of its own, its slots translated
through the pool's ``full_to_swa_index_mapping`` as its index is built (``decode.translate_slots``; its K/V written
at the translated ``out_cache_loc``). Graphs: one block capacity per batch size (``graph_block_capacity``); prefill
graphs: ``breakable`` served by eager extend, ``full`` refused. docs/design.md ("The SGLang backend") says how each
works and why.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .. import (
    FP8_DTYPES,
    KV_DTYPES,
    ExtendTileIndex,
    allow_data_dependent_sizes,
    choose_extend_form,
    extend_tiles,
    native_available,
    scale_value,
    tile_index,
    v_is_prefix_of_k,
)
from ..decode import DecodeIndex, SlotMap, build_decode_index, decode_blocks
from ..plan import (
    DEFAULT_BLOCK_SIZE,
    DecodeInputs,
    aligned_kv_lo,
    decode_kv_range,
    gather_unit,
    plan_decode,
    plan_extend,
)
from .backend_util import (
    GRAPH_KV_TOKENS_ENV,
    CompileWatch,
    GraphState,
    SwaPool,
    capturing_prefill_graph,
    check_decode_capacity,
    check_full_slots,
    check_kwargs,
    check_mode,
    extend_over_given_kv,
    graph_block_capacity,
    layer_logit_cap,
    layer_window,
    swa_pool_of,
)
from .speculative import VERIFY_KEY, forward_target_verify, verify_state
from .speculative_graphs import verify_in_graph, verify_out_graph, verify_refill_after_draft

SEQ_LEN_FILL_VALUE = 1  # padded graph rows: request row 0, one key (slot 0), finite output that is dropped

# (sliding window or None, is cross-attention), and True for a window layer of a hybrid sliding-window pool (its slots
# translated); extend adds causal (and its index key, the CPU flash form and the translation)
DecodeKey = tuple  # (int | None, bool) or (int | None, bool, True)
ExtendKey = tuple[int | None, bool, bool]


@dataclass
class _ForwardState:
    """What one forward's layers share: the batch and the indices built so far, per layer configuration."""

    forward_batch: object
    static: bool  # decode metadata from the graph buffers (pure tensor code, capacity-shaped)
    # static decode whose indices the forward's own layers build (CPUGraphRunner's compiled model): its first
    # attention layer starts ``decode`` and ``swa_loc`` afresh (``CompiledAttnBackend._start_graph_forward``)
    built_in_forward: bool = False
    decode: dict[DecodeKey, DecodeIndex] = field(default_factory=dict)
    extend: dict[tuple, ExtendTileIndex] = field(default_factory=dict)  # ExtendKey + (CPU flash form,)
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # static: rows, lens, enc
    swa_loc: torch.Tensor | None = None  # out_cache_loc translated to the window layers' pool (hybrid SWA pool)


class CompiledAttnBackend(AttentionBackend):
    """SGLang attention backend over ``compiled_attn``'s batched decode/extend functions.

    Supports MHA, GQA/MQA, ``qk_head_dim != v_head_dim`` (MLA "normal" 192/128 on an MHA pool, and on an MLA
    pool with ``save_kv_cache=False``, attending over the batch's own K/V), absorbed MLA over
    ``MLATokenToKVPool`` (576/512, V read as a view of K), sliding window, ``ENCODER_ONLY`` (non-causal),
    cross-attention (``encoder_lens`` / ``encoder_out_cache_loc``), tanh logit soft-capping
    (``RadixAttention.logit_cap``; SGLang's ``torch_native`` ignores it) and hybrid sliding-window memory
    (``SWAKVPool``: the window layers' K/V in a pool of their own, read through its slot mapping; module docstring).
    Pool variants it cannot read are refused here, with the server flag that avoids them (``swa_pool_of``).
    """

    def __init__(self, model_runner, *, block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.swa: SwaPool | None = swa_pool_of(self.token_to_kv_pool)  # hybrid sliding-window memory, or None
        self.block_size = block_size
        # SGLang's --page-size: the decode blocks start at its pages' boundaries (gather_unit)
        self.page_size = int(getattr(self.token_to_kv_pool, "page_size", 1) or 1)
        kv_dtype = getattr(self.token_to_kv_pool, "dtype", None)
        if isinstance(kv_dtype, torch.dtype) and kv_dtype not in KV_DTYPES:
            raise ValueError(f"compiled_attn: KV cache dtype {kv_dtype} (--kv-cache-dtype) is not supported; it "
                             f"reads {', '.join(str(d).replace('torch.', '') for d in KV_DTYPES)}")
        self.fp8_kv = kv_dtype in FP8_DTYPES
        self._scales: dict[int, tuple[float | None, float | None]] = {}  # layer id -> (k_scale, v_scale)
        self.forward_metadata: _ForwardState | None = None
        self.decode_keys: dict[DecodeKey, None] = {(None, False): None}  # layer configurations seen (ordered set)
        self.graph: GraphState | None = None
        self.first_layer_id: int | None = None  # the lowest layer id an eager graph forward has run (its first layer)
        self._warned_fallback = False
        self.compiles_after_start_up = CompileWatch()
        pool = self.token_to_kv_pool
        layer0 = getattr(pool, "start_layer", 0) or 0
        try:  # MLA's latent pool: V is a view of K's first columns, so one gather serves both (host check, once)
            self.v_shares_k = v_is_prefix_of_k(pool.get_key_buffer(layer0), pool.get_value_buffer(layer0))
        except Exception:
            self.v_shares_k = False
        if self.device.type == "cpu":
            native_available()  # the C++ decode kernel built (or loaded) at start-up, not at the first request

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    @property
    def max_context_len(self) -> int:
        """The positions a request row holds: the ``req_to_token`` width (the model's context length plus the few
        slots SGLang's pool adds). SGLang's EAGLE workers size a FULL_MASK tree mask they allocate from it
        (``bs * max_context_len`` cached tokens at most: ``speculative/eagle_worker_common.py``)."""
        return self.req_to_token.shape[1]

    def support_triton(self):
        return False

    # ------------------------------------------------------------------ metadata (eager)

    def init_forward_metadata(self, forward_batch):
        self.compiles_after_start_up.check(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        check_mode(mode)
        if mode.is_decode() and self._fits_graph(forward_batch):
            # graph-shaped metadata: what CPUGraphRunner's compiled forward was traced with (no recompile); the
            # index is built by the first attention layer, inside that compiled forward
            self.init_forward_metadata_in_graph(forward_batch, build_index=False)
            return
        self.forward_metadata = _ForwardState(forward_batch, static=False)

    def _fits_graph(self, forward_batch) -> bool:
        g = self.graph
        if g is None or forward_batch.batch_size > g.max_bs:
            return False
        try:
            self._check_capacity(forward_batch)
        except ValueError as e:
            if not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(f"{e}; running this batch with exact-size metadata (a compiled step recompiles)",
                              stacklevel=2)
            return False
        return True

    def _state_for(self, forward_batch, *, decode: bool) -> _ForwardState:
        state = self.forward_metadata
        # graph (static) metadata serves whatever batch object the graph runner passes; eager metadata is per batch
        stale = state is None or (state.static and not decode)
        if stale or (not state.static and state.forward_batch is not forward_batch):
            state = self.forward_metadata = _ForwardState(forward_batch, static=False)
        return state

    # ------------------------------------------------------------------ graph hooks

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Allocate the static metadata buffers for decode graphs of up to ``max_bs`` rows."""
        env = os.environ.get(GRAPH_KV_TOKENS_ENV, "").strip()
        if env and not (env.isdigit() and int(env) > 0):
            raise ValueError(f"{GRAPH_KV_TOKENS_ENV} must be a positive number of KV tokens, got {env!r}")
        kv_tokens = int(env) if env else int(getattr(self.token_to_kv_pool, "size", 0) or self.req_to_token.numel())
        nblk = self.graph_block_capacity(max_bs, kv_tokens)

        def z():
            return torch.zeros(max_bs, dtype=torch.int64, device=self.device)

        self.graph = GraphState(max_bs, kv_tokens, z(), z(), z(), torch.arange(nblk, device=self.device),
                                 torch.arange(self.block_size, device=self.device))

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int):
        """CPUGraphRunner's hook, called before it compiles the model (without ``fullgraph``): the static buffers, and
        dynamo set to trace the compiled decode's data-dependent block count rather than break the graph there."""
        allow_data_dependent_sizes()
        self.init_cuda_graph_state(max_bs, max_num_tokens)

    def graph_block_capacity(self, bs: int, kv_tokens: int | None = None) -> int:
        kv_tokens = kv_tokens if kv_tokens is not None else self.graph.kv_tokens
        return graph_block_capacity(bs, max_context_len=self.max_context_len, kv_tokens=kv_tokens,
                                    block_size=self.block_size, page_size=self.page_size)

    def get_cuda_graph_seq_len_fill_value(self):
        return SEQ_LEN_FILL_VALUE

    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host-side checks before a decode or TARGET_VERIFY graph's capture or replay (``forward_batch`` may be a
        view)."""
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is not None and mode.is_target_verify():
            return verify_out_graph(self, forward_batch, in_capture)
        if mode is not None and not mode.is_decode():
            # only SGLang's full prefill graph calls this on an extend batch (breakable prefill graphs run attention
            # eagerly, through init_forward_metadata): it would record attention, which plans extend on the host
            raise NotImplementedError(
                f"compiled_attn: the full prefill CUDA graph (--cuda-graph-backend-prefill full) is not supported: it "
                f"records the attention of {getattr(mode, 'name', mode)} batches, which this backend plans on the "
                f"host. Pass --cuda-graph-backend-prefill breakable (the CUDA default: attention runs eagerly between "
                f"the captured pieces) or --cuda-graph-backend-prefill disabled")
        if self.graph is None:
            raise RuntimeError("compiled_attn: init_cuda_graph_state must be called before graph metadata")
        self._check_capacity(forward_batch)

    def _check_capacity(self, forward_batch) -> None:
        g = self.graph
        check_decode_capacity(forward_batch, self.decode_keys, max_bs=g.max_bs, width=self.max_context_len,
                              capacity=self.graph_block_capacity, block_size=self.block_size,
                              page_size=self.page_size, kv_tokens=g.kv_tokens)

    def init_forward_metadata_in_graph(self, forward_batch, build_index: bool = True):
        """Graph-recordable: copy the batch's rows/ranges into the static buffers and build the block index of
        every known layer configuration (pure tensor code, fixed shapes per batch size). ``build_index=False``
        (CPUGraphRunner, whose compiled forward runs after this eager call) leaves that to the first layer of each
        configuration, so it is traced into the compiled forward instead of running as ~25 eager ops per step."""
        if self.graph is None:
            raise RuntimeError("compiled_attn: init_cuda_graph_state must be called before graph metadata")
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is not None and mode.is_target_verify():
            state = self.forward_metadata = _ForwardState(forward_batch, static=True)
            state.extend[VERIFY_KEY] = verify_in_graph(self, forward_batch)
            return
        state = _ForwardState(forward_batch, static=True, built_in_forward=not build_index,
                              inputs=(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                      getattr(forward_batch, "encoder_lens", None)))
        self.forward_metadata = state
        for key in self.decode_keys if build_index else ():
            state.decode[key] = self._static_decode_index(state, key)

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs: int | None):
        """SGLang's overlap-plan-stream hook (``SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1``), called after a TARGET_VERIFY
        step's metadata was prepared on the plan stream and before its forward: the tree masks copied again into a
        graph's static buffer (``speculative_graphs.verify_refill_after_draft``); eager verify needs nothing."""
        verify_refill_after_draft(self, spec_info, cuda_graph_bs)

    def init_forward_metadata_capture_cpu_graph(self, bs, num_tokens, req_pool_indices, seq_lens, out_cache_loc,
                                                encoder_lens, forward_mode, spec_info):
        """CPUGraphRunner's capture hook (it replays through ``init_forward_metadata``)."""
        if spec_info is not None:
            raise NotImplementedError("compiled_attn: speculative decoding is not supported yet")
        fb = SimpleNamespace(batch_size=bs, forward_mode=forward_mode, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens, seq_lens_cpu=None, encoder_lens=encoder_lens,
                             out_cache_loc=out_cache_loc)
        self.init_forward_metadata_out_graph(fb, in_capture=True)
        self.init_forward_metadata_in_graph(fb, build_index=False)

    def _static_decode_index(self, state: _ForwardState, key: DecodeKey) -> DecodeIndex:
        g = self.graph
        rows, lens, enc = state.inputs
        bs = lens.shape[0]
        lens = lens.to(torch.int64)
        base = enc.to(torch.int64) if enc is not None else torch.zeros_like(lens)
        window, cross = key[:2]
        lo, hi = decode_kv_range(lens, base, window, cross)
        g.req_rows[:bs].copy_(rows)
        g.kv_lo[:bs].copy_(lo)
        g.kv_hi[:bs].copy_(hi)
        inputs = DecodeInputs(g.req_rows[:bs], g.kv_lo[:bs], g.kv_hi[:bs], g.block_ids[: self.graph_block_capacity(bs)],
                              g.block_offsets)
        # pure tensor code: recorded into a CUDA graph, or handed to CPUGraphRunner's compiled forward
        return build_decode_index(self.req_to_token, inputs, self.page_size, host_form=False,
                                  slot_map=self._slot_map(key))

    # ------------------------------------------------------------------ hybrid sliding-window pool

    def is_window_pool_layer(self, layer) -> bool:
        """The layer keeps its K/V in the window layers' pool of a hybrid sliding-window pool (slots translated)."""
        return self.swa is not None and self.swa.is_window_layer(layer)

    def _slot_map(self, key: tuple) -> SlotMap | None:
        """The slot translation of a layer configuration (its key's third element: a window-pool layer), or None."""
        return self.swa.slot_map if len(key) > 2 and key[2] else None

    def _layer_key(self, window: int | None, cross: bool, layer) -> tuple:
        return (window, cross, True) if self.is_window_pool_layer(layer) else (window, cross)

    def check_full_slots(self, rows, lo, hi) -> None:
        """Over a hybrid sliding-window pool: the plans' table checks, against the full pool (``check_full_slots``)."""
        check_full_slots(self.req_to_token, rows, lo, hi, self.swa.full_slots)

    # ------------------------------------------------------------------ forward

    def _layer_scales(self, layer) -> tuple[float | None, float | None]:
        """The layer's float8 dequantisation scales as Python floats (read once per layer; None: 1)."""
        if not self.fp8_kv:
            return None, None
        scales = self._scales.get(layer.layer_id)
        if scales is None:
            scales = self._scales[layer.layer_id] = tuple(
                scale_value(getattr(layer, f"{n}_scale_float", None) or getattr(layer, f"{n}_scale", None))
                for n in ("k", "v"))
        return scales

    def _write_kv(self, layer, forward_batch, k, v, save_kv_cache, state=None):
        if save_kv_cache and k is not None and v is not None:
            loc = forward_batch.encoder_out_cache_loc if layer.is_cross_attention else forward_batch.out_cache_loc
            k_scale, v_scale = self._layer_scales(layer)
            # a float8 cache stores value / scale (the readers multiply it back); divided here, not in place
            k = k if k_scale is None else k / k_scale
            v = v if v_scale is None else v / v_scale
            # a hybrid sliding-window pool writes a window layer at its own slots (SWAKVPool.set_kv_buffer asserts
            # they are given), the others at loc; cross-attention never goes to the window pool
            swa_loc = self.swa.write_loc(loc, state) if self.is_window_pool_layer(layer) else None
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, swa_loc), k, v)

    def _prologue(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs, state=None):
        """Shared by decode and extend: check extras, write the new K/V, view q, fetch this layer's caches."""
        check_kwargs(kwargs)
        self._write_kv(layer, forward_batch, k, v, save_kv_cache, state)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        return q3, k_cache, v_cache, bool(layer.is_cross_attention)

    def _start_graph_forward(self, state: _ForwardState, layer) -> None:
        """A static forward whose layers build the indices (``built_in_forward``): its first layer sets the
        per-forward indices and translated slots to empty, by assignment, never reading what an earlier run left.
        Why: SGLang's CPU capture runs the model eagerly once, then compiled twice, on one metadata object, while each
        replay starts from fresh metadata; a compiled forward that read those dicts would be traced with them full,
        guard on it, and compile the whole model again at each captured size's first real decode. Which layer is
        first is learnt from the eager runs (the capture's eager forward precedes every compiled one)."""
        if not torch.compiler.is_compiling() and (self.first_layer_id is None or layer.layer_id < self.first_layer_id):
            self.first_layer_id = layer.layer_id
        if layer.layer_id == self.first_layer_id:
            state.decode = {}
            state.swa_loc = None

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        state = self._state_for(forward_batch, decode=True)
        if state.built_in_forward:
            self._start_graph_forward(state, layer)
        q3, k_cache, v_cache, cross = self._prologue(q, k, v, layer, forward_batch, save_kv_cache, kwargs, state)
        key = self._layer_key(None if cross else layer_window(layer), cross, layer)
        index = state.decode.get(key)
        if index is None:
            if key not in self.decode_keys:
                self.decode_keys[key] = None  # later forwards (and graph captures) build it up front
            index = state.decode[key] = (self._static_decode_index(state, key) if state.static else
                                         self._eager_decode_index(q3, k_cache, v_cache, forward_batch, key))
        k_scale, v_scale = self._layer_scales(layer)
        o = decode_blocks(q3, k_cache, v_cache, index, layer.scaling, layer_logit_cap(layer),
                          v_shares_k=self.v_shares_k, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _eager_decode_index(self, q3, k_cache, v_cache, forward_batch, key: DecodeKey) -> DecodeIndex:
        """The host plan of this forward's batch for a layer configuration (checks included) and its index, built for
        the page size the plan records."""
        meta = plan_decode(q3, k_cache, v_cache, self.req_to_token, forward_batch.req_pool_indices,
                           forward_batch.seq_lens, sliding_window=key[0], encoder_lens=forward_batch.encoder_lens,
                           is_cross_attn=key[1], block_size=self.block_size, page_size=self.page_size,
                           check_slots=self.swa is None)
        i = meta.inputs
        if self.swa is not None:  # the plan's table checks, against the full pool (check_full_slots)
            start = aligned_kv_lo(i.kv_lo, gather_unit(meta.page_size, meta.block_size))
            check_full_slots(self.req_to_token, i.req_rows, start, i.kv_hi, self.swa.full_slots)
        return build_decode_index(self.req_to_token, i, meta.page_size, slot_map=self._slot_map(key))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kwargs):
        if capturing_prefill_graph():
            # a breakable prefill graph's capture: the dummy batch's output is never read (each replay runs attention
            # again, eagerly, on the step's batch) and its request rows hold no pages; nothing to plan or write
            return q.new_zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        verify = forward_batch.forward_mode.is_target_verify()
        state = verify_state(self, forward_batch) if verify else self._state_for(forward_batch, decode=False)
        q3, k_cache, v_cache, cross = self._prologue(q, k, v, layer, forward_batch, save_kv_cache, kwargs, state)
        if verify:  # k draft tokens per request (speculative.py)
            return forward_target_verify(self, q3, k_cache, v_cache, layer, forward_batch, sinks)
        causal = not (cross or getattr(layer, "attn_type", None) == AttentionType.ENCODER_ONLY)
        key = (layer_window(layer) if causal else None, cross, causal)
        fb = forward_batch
        if k_cache.shape[1:] != (layer.tp_k_head_num, layer.qk_head_dim):
            # the layer's K doesn't live in this pool (DeepSeek's MHA prefill over the MLA latent pool, called with
            # save_kv_cache=False): attend over the batch's own K/V
            return extend_over_given_kv(q3, k, v, layer, fb, key, sinks)
        cap = layer_logit_cap(layer)
        form = choose_extend_form(q3, k_cache, v_cache, cap).form
        swa = self.is_window_pool_layer(layer)
        index = state.extend.get((*key, form, swa))
        if index is None:
            meta = plan_extend(q3, k_cache, v_cache, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               fb.extend_prefix_lens, fb.extend_seq_lens, causal=causal, sliding_window=key[0],
                               encoder_lens=fb.encoder_lens, is_cross_attn=cross, page_size=self.page_size,
                               check_slots=self.swa is None)
            i = meta.inputs
            if self.swa is not None:
                self.check_full_slots(i.req_rows, i.kv_lo, i.kv_lo + i.kv_len)
            index = state.extend[(*key, form, swa)] = tile_index(self.req_to_token, meta, form,
                                                                 slot_map=self.swa.slot_map if swa else None)
        k_scale, v_scale = self._layer_scales(layer)
        o = extend_tiles(q3, k_cache, v_cache, index, layer.scaling, cap, form=form, k_scale=k_scale,
                         v_scale=v_scale, sinks=sinks)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
