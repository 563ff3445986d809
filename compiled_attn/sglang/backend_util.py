"""Helpers of the SGLang backend (``backend.py``): the decode graphs' block capacity and static buffers, and the
host-side reading of a layer's and a batch's settings."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import choose_extend_form, extend_tiles, tile_index
from ..decode import SlotMap, translate_slots
from ..plan import cdiv, decode_kv_bounds, gather_unit, normalize_window, plan_extend, total_blocks_needed
from ..validate import check_slots
from .cpu_compile import graphs_compiled

#: the environment variable that bounds the KV tokens a captured graph computes over (``backend.py``'s docstring)
GRAPH_KV_TOKENS_ENV = "COMPILED_ATTN_GRAPH_KV_TOKENS"


def graph_block_capacity(bs: int, *, max_context_len: int, kv_tokens: int, block_size: int,
                         page_size: int = 1) -> int:
    """KV blocks a decode graph of ``bs`` rows computes over (see the module docstring). With pages a request's
    first block may start up to ``gather_unit - 1`` positions early (a window's start rounded down to its run):
    one more block per row at most."""
    unit = gather_unit(page_size, block_size)
    per_row = 1 if unit == 1 else 2
    return max(1, min(bs * cdiv(max_context_len + unit - 1, block_size), cdiv(kv_tokens, block_size) + per_row * bs))


def graph_batch_size(forward_batch, max_bs: int) -> int:
    """The batch size of a graph's batch (``forward_batch`` may be SGLang's runner view), refused past the graph
    buffers' ``max_bs``."""
    bs = getattr(forward_batch, "batch_size", None) or forward_batch.seq_lens.shape[0]
    if bs > max_bs:
        raise ValueError(f"compiled_attn: batch size {bs} exceeds the graph buffers' max_bs={max_bs}")
    return bs


def check_graph_blocks(batch: Callable[[], str], needed: int, capacity: int, block_size: int, kv_tokens: int
                       ) -> None:
    """A batch needing more KV blocks than the captured graph of its size computes over is refused (a replay would
    drop the rest): the message names the batch (``batch()``: what it is and holds; called only for the message,
    so a step that fits pays no host reads for it) and the setting to raise."""
    if needed > capacity:
        raise ValueError(
            f"compiled_attn: this {batch()} needs {needed} KV blocks of {block_size}, more than the {capacity} a graph "
            f"of this batch size was captured with (requests sharing a cached prefix count it once each). Raise "
            f"{GRAPH_KV_TOKENS_ENV} (now {kv_tokens} tokens) or lower --cuda-graph-max-bs")


def check_decode_capacity(forward_batch, keys, *, max_bs: int, width: int, capacity: Callable[[int], int],
                          block_size: int, page_size: int, kv_tokens: int) -> None:
    """A decode batch against the captured graph of its size, for each layer configuration ``(window, cross, ...)``
    of ``keys``: every request ends within the table (``width`` positions) and the batch's KV blocks fit the graph's
    ``capacity(bs)`` (``check_graph_blocks``). Host ints, each ``[bs]`` read once (``*_cpu`` copies where held)."""
    bs = graph_batch_size(forward_batch, max_bs)
    lens = host_int64(getattr(forward_batch, "seq_lens_cpu", None), forward_batch.seq_lens).tolist()
    enc = getattr(forward_batch, "encoder_lens", None)
    enc = [0] * len(lens) if enc is None else host_int64(getattr(forward_batch, "encoder_lens_cpu", None), enc).tolist()
    end = max((n + e for n, e in zip(lens, enc, strict=True)), default=0)
    if end > width:
        raise ValueError(f"compiled_attn: a request reaches position {end}, beyond the req_to_token width {width} "
                         f"(max_context_len)")
    cap = capacity(bs)
    for window, cross, *_ in keys:
        lo, hi = decode_kv_bounds(lens, enc, window, cross)
        check_graph_blocks(lambda lo=lo, hi=hi: f"decode batch (bs={bs}, {sum(hi) - sum(lo)} KV tokens)",
                           total_blocks_needed(lo, hi, block_size, page_size), cap, block_size, kv_tokens)


def layer_window(layer) -> int | None:
    return normalize_window(getattr(layer, "sliding_window_size", -1))


def layer_logit_cap(layer) -> float | None:
    cap = getattr(layer, "logit_cap", 0.0) or 0.0
    if cap <= 0:
        return None
    method = getattr(layer, "logit_capping_method", "tanh")
    if method != "tanh":
        raise NotImplementedError(f"compiled_attn: logit_capping_method={method!r} is not supported (only 'tanh')")
    return float(cap)


@dataclass
class GraphState:
    """Static buffers shared by every captured batch size (allocated by ``init_cuda_graph_state``)."""

    max_bs: int
    kv_tokens: int
    req_rows: torch.Tensor  # [max_bs] int64
    kv_lo: torch.Tensor  # [max_bs] int64
    kv_hi: torch.Tensor  # [max_bs] int64
    block_ids: torch.Tensor  # [capacity(max_bs)] int64 arange; a graph of bs rows reads [:capacity(bs)]
    block_offsets: torch.Tensor  # [block_size] int64 arange
    # TARGET_VERIFY graphs' buffers per draft token count k (``speculative_graphs.VerifyGraphState``), made at capture
    verify: dict = field(default_factory=dict)


class CompileWatch:
    """Counts the graphs ``torch.compile`` makes in this process after start-up (from the first real batch on:
    SGLang's graph captures run before it) and warns at the forward after each one that compiled, naming it: a
    compile while serving is the first-request spike the captured graphs exist to remove. ``count``: the graphs
    compiled while serving (0 when every captured size serves its first batch without a compile)."""

    def __init__(self):
        self.count = 0
        self._at_start: int | None = None
        self._last = ""  # the previous forward, as the warning names it

    def check(self, forward_batch) -> None:
        """Called once per forward, before it runs (host side, outside any compiled region)."""
        total = graphs_compiled()
        if self._at_start is None:
            self._at_start = total
        elif total - self._at_start > self.count:
            new, self.count = total - self._at_start - self.count, total - self._at_start
            warnings.warn(f"compiled_attn: torch.compile made {new} graph(s) while serving the {self._last} "
                          f"({self.count} since start-up): it waited for a compile", stacklevel=3)
        mode = getattr(forward_batch.forward_mode, "name", forward_batch.forward_mode)
        self._last = f"{mode} batch of {getattr(forward_batch, 'batch_size', '?')}"


def capturing_prefill_graph() -> bool:
    """True while SGLang's prefill graph runner captures: ``prefill_cuda_graph_runner.py``'s ``_capture`` sets
    ``get_flags().dp.capturing_prefill_graph`` around its warmups and captures, all on ``capture_prepare``'s dummy
    batches. False where SGLang's runtime is not importable."""
    try:
        from sglang.srt.runtime_context import get_flags
        return bool(get_flags().dp.capturing_prefill_graph)
    except (ImportError, AttributeError, RuntimeError):
        return False


def host_int64(cpu_copy, tensor) -> torch.Tensor:
    t = cpu_copy if cpu_copy is not None else tensor
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    return t.detach().to("cpu", torch.int64)


def check_mode(mode) -> None:
    name = getattr(mode, "name", str(mode))
    if name == "DLLM_EXTEND":  # TARGET_VERIFY and DRAFT_EXTEND_V2 (speculative decoding): speculative.py
        raise NotImplementedError(f"compiled_attn: forward mode {name} (dLLM) is not supported yet")


def check_kwargs(kwargs) -> None:
    extra = sorted(name for name, value in kwargs.items() if value is not None)
    if extra:
        raise NotImplementedError(f"compiled_attn: attention arguments {extra} are not supported")


# ------------------------------------------------------------------ hybrid sliding-window pools


@dataclass
class SwaPool:
    """SGLang's hybrid sliding-window pool (``SWAKVPool``): the window layers keep their K/V in a pool of their own
    (``swa_kv_pool``, ``num_slots`` rows), reached through ``full_to_swa_index_mapping`` (a full-pool slot, what
    ``req_to_token`` holds, to its slot there; 0 for a token freed from the window, a -1 sentinel at its end).
    Which layers: ``layers_mapping`` (layer id -> (index in its pool, is a window layer))."""

    pool: object
    num_slots: int

    def is_window_layer(self, layer) -> bool:
        """The layer's K/V lives in the window layers' pool (cross-attention never does: SGLang writes it full)."""
        if getattr(layer, "is_cross_attention", False):
            return False
        return bool(self.pool.layers_mapping.get(layer.layer_id, (0, False))[1])

    @property
    def slot_map(self) -> SlotMap:
        """The full-to-window slot translation (read at each use: SGLang registers it after building the pool, and
        keeps the same tensor, updated in place, for the server's life)."""
        table = getattr(self.pool, "full_to_swa_index_mapping", None)
        if table is None:
            raise RuntimeError("compiled_attn: the SWAKVPool has no full_to_swa_index_mapping registered (SGLang's "
                               "SWATokenToKVPoolAllocator registers it when it is built)")
        return SlotMap(table, self.num_slots)

    def write_loc(self, loc: torch.Tensor, state=None) -> torch.Tensor:
        """``loc`` (full-pool slots) translated to the window layers' pool: once per forward where the forward's
        ``state`` is given (kept as ``state.swa_loc``; in graphs the first layer's write sets it), else each call."""
        if state is None:
            return translate_slots(loc.to(torch.int64), self.slot_map)
        if state.swa_loc is None:
            state.swa_loc = translate_slots(loc.to(torch.int64), self.slot_map)
        return state.swa_loc

    @property
    def full_slots(self) -> int:
        """The slots ``req_to_token`` entries index: the mapping's entries but its sentinel."""
        return self.slot_map.table.shape[0] - 1


def swa_pool_of(pool) -> SwaPool | None:
    """``SwaPool`` of SGLang's hybrid sliding-window pool, None for any other pool; a variant this backend cannot
    serve is refused (``NotImplementedError``, one line naming the server flag that avoids it)."""
    names = [c.__name__ for c in type(pool).__mro__]
    if "BaseSWAKVPool" not in names and "SWAKVPool" not in names:
        return None
    name = names[0]
    if "UnifiedSWAKVPool" in names:
        raise NotImplementedError(f"compiled_attn: {name} (full and window layers' K/V in one shared buffer) is not "
                                  f"supported; start the server without --enable-unified-memory")
    problem = None
    window_pool = getattr(pool, "swa_kv_pool", None)
    if name != "SWAKVPool":
        problem = "a pool other than SWAKVPool"
    elif getattr(pool, "swa_req_ring_size", None) is not None or getattr(pool, "request_window", None) is not None:
        problem = "window K/V in per-request rings, without a full-to-window slot mapping"
    elif getattr(pool, "swa_uses_full_indices", False):
        problem = "window K/V indexed by full-pool slots"
    elif window_pool is None or type(window_pool).__name__ != "MHATokenToKVPool" or not hasattr(pool, "layers_mapping"):
        problem = "window layers' K/V not in an MHA pool"
    if problem is not None:
        raise NotImplementedError(f"compiled_attn: this hybrid sliding-window KV pool ({name}: {problem}) is not "
                                  f"supported; start the server with --disable-hybrid-swa-memory (one pool, the "
                                  f"window layers masked to their window)")
    rows = min(window_pool.get_key_buffer(0).shape[0], window_pool.get_value_buffer(0).shape[0]) \
        if pool.swa_layer_nums > 0 else int(pool.size_swa) + int(pool.page_size)
    return SwaPool(pool, int(rows))


def check_full_slots(req_to_token: torch.Tensor, rows, lo, hi, num_slots: int) -> None:
    """The host check a plan makes of the table entries a batch reads (``validate.check_slots``; rows, lo, hi: [bs],
    read on the host), against the full pool's ``num_slots``: over a hybrid sliding-window pool the plans skip
    theirs, which count the rows of the caches they are handed (a window layer's, reached through the slot map, are
    fewer)."""
    rows, lo, hi = (host_int64(None, t) for t in (rows, lo, hi))
    check_slots(req_to_token, rows, lo, hi, num_slots)


def extend_over_given_kv(q3, k, v, layer, fb, key, sinks=None):
    """A layer whose K does not live in the pool (DeepSeek's MHA prefill over the MLA latent pool, called with
    ``save_kv_cache=False``): extend over the batch's own K/V, packed as q3 [num_tokens, Hq, Dqk]; key: the layer's
    (window, cross, causal). -> [num_tokens, Hq * Dv]."""
    if k is None or v is None or key[1]:
        raise NotImplementedError(f"compiled_attn: layer {layer.layer_id}'s K shape "
                                  f"({layer.tp_k_head_num}, {layer.qk_head_dim}) does not match the KV pool")
    prefix = host_int64(getattr(fb, "extend_prefix_lens_cpu", None), fb.extend_prefix_lens)
    if prefix.numel() and int(prefix.max()) > 0:
        raise NotImplementedError("compiled_attn: extend with a cached prefix over K/V that is not in the pool "
                                  "(MLA chunked-prefix MHA) is not supported yet")
    lens = host_int64(getattr(fb, "extend_seq_lens_cpu", None), fb.extend_seq_lens)
    bs, width = lens.shape[0], max(int(lens.max()), 1) if lens.numel() else 1
    starts = torch.cumsum(lens, 0) - lens
    # a request-to-token table over the batch's packed tokens: request b's position j is token starts[b] + j
    table = (starts[:, None] + torch.arange(width)[None, :]).clamp_max(max(q3.shape[0] - 1, 0))
    table, lens_dev = table.to(torch.int32).to(q3.device), lens.to(q3.device)
    k3 = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v3 = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
    meta = plan_extend(q3, k3, v3, table, torch.arange(bs, device=q3.device), lens_dev, torch.zeros_like(lens_dev),
                       lens_dev, causal=key[2], sliding_window=key[0])
    cap = layer_logit_cap(layer)
    form = choose_extend_form(q3, k3, v3, cap).form
    o = extend_tiles(q3, k3, v3, tile_index(table, meta, form), layer.scaling, cap, form=form,
                     sinks=sinks)
    return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
