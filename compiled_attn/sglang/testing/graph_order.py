"""SGLang's decode CUDA-graph runner, replayed on an attention backend without a model: the same backend calls in
the same order, over the same static buffers, so a test or a benchmark sees what a server's decode graphs see.

The order, as SGLang 0.5.23 makes the calls (``sglang/srt/model_executor/``):

1. ``runner/decode_cuda_graph_runner.py`` ``DecodeCudaGraphRunner.__init__`` (lines 423-437):
   ``attn_backend.init_cuda_graph_state(max_bs, max_num_token)`` (decode: ``max_num_token = max_bs``, one token per
   request), then ``seq_len_fill_value = attn_backend.get_cuda_graph_seq_len_fill_value()``.
2. ``_capture`` (lines 1253-1291): the static ``seq_lens`` buffers filled with that value, ``req_pool_indices`` and
   ``out_cache_loc`` zeroed (``reset_index_buffers``); ``_capture_one_stream`` (line 1318) takes the batch sizes
   largest first, all on one capture stream (``graph_capture``, ``distributed/parallel_state.py``).
3. ``capture_one_shape`` (lines 1368-1504): ``capture_prepare`` (lines 1083-1247) makes a ``ForwardBatch`` over the
   static buffers' ``[:bs]`` slices; ``attn_backend.init_forward_metadata_out_graph(fb, in_capture=True)``
   (line 1400); ``run_once`` = ``init_forward_metadata_in_graph(fb)`` (``_run_in_graph_metadata_prep``, lines
   636-653) then the model's forward, whose attention layers reach ``forward_decode`` through
   ``RadixAttention.forward`` -> ``AttentionBackend.forward``. ``runner_backend/full_cuda_graph_backend.py``
   ``capture_one`` (lines 137-208) runs ``run_once`` twice eagerly (synchronizing before each), then once inside
   ``torch.cuda.graph(graph, pool, stream)``; the tensors that call returns are the graph's outputs.
4. Per step, ``execute`` (line 1981) -> ``load_batch`` (lines 1521-1726): the batch is padded to the smallest
   captured size; ``buffer_registry.fill_from`` copies its rows into the static buffers and resets their tails
   (``cuda_graph_buffer_registry.py`` lines 598-676: ``seq_lens`` / ``seq_lens_cpu`` to the fill value,
   ``req_pool_indices`` / ``out_cache_loc`` / ``positions`` to 0); ``_init_replay_attn_metadata_from_view``
   (lines 1773-1812) calls ``attn_backend.init_forward_metadata_out_graph(build_replay_fb_view(...))`` (in_capture
   False; the view: ``build_replay_fb_view``, lines 170-243); then ``backend.replay``: ``graph.replay()`` and the
   captured outputs (``full_cuda_graph_backend.py`` lines 225-231).

Not replicated: the metadata glue graph (speculative draft/verify workers only), two-batch overlap, pdmux, LoRA, DP.

Where SGLang imports, the replica uses its pools, ``RadixAttention`` layers, ``ForwardBatch`` and ``ForwardMode``
(through ``testing.make_model_runner``). Where it does not (a bare GPU machine), stand-ins with the attributes the
backend reads take their place, and ``load_backend_class`` loads ``backend.py`` over stand-ins of the three SGLang
names it imports. ``capture=False`` makes the same calls without a graph (the CPU twin): the capture's ``run_once``
is a plain call, and each replay runs ``run_once`` again on the capture-time batch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .graph_world import (
    DecodeBatch,
    StandinForwardMode,
    StandinKVPool,
    StandinLayer,
    World,
    forward_batch_over,
    kv_bytes_read,
    layer_call,
    load_backend_class,
    make_batch,
    make_world,
    plain_forward_batch,
)
from .runtime import parallel_scope

__all__ = ["DecodeBatch", "DecodeGraphReplica", "Forward", "StandinForwardMode", "StandinKVPool", "StandinLayer",
           "World", "default_capture_bs", "drive_decode_graph", "kv_bytes_read", "layer_call", "load_backend_class",
           "make_batch", "make_world", "plain_forward_batch"]


Forward = Callable[[World, object, object, torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


@dataclass
class _StaticInputs:
    """The runner's static input buffers (``DecodeInputBuffers``), [max_bs] each, plus per layer the activations a
    model would compute in the graph from ``input_ids`` (q [max_bs, Hq * D], k [max_bs, Hkv * D], v [max_bs,
    Hkv * Dv]): here they are inputs, filled per replay."""

    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]


def default_capture_bs(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 8 (32 ..) up to the first size >= ``max_bs``: SGLang's small-bucket pattern."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, 16]
    while sizes[-1] < max_bs:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < max_bs] + [next(s for s in sizes if s >= max_bs)]


class DecodeGraphReplica:
    """SGLang's decode CUDA-graph runner's calls on ``backend`` (module docstring), over ``world``.

    capture_bs: the captured batch sizes; capture: record CUDA graphs (needs the world on CUDA) or, False, make
    the same calls without graphs (the capture's step and each replay's run plainly); forward: how a layer runs
    (default ``layer_call``; a benchmark passes a compiled one); warmups: eager runs before each capture
    (SGLang's ``FullCudaGraphBackend`` makes 2).

    ``__init__`` makes the runner's constructor calls; ``capture_all`` captures; ``replay(batch)`` runs one step.
    ``load`` and ``launch`` are ``replay``'s two halves, for timing the graph alone.
    """

    def __init__(self, backend, world: World, capture_bs: Sequence[int], *, capture: bool,
                 forward: Forward | None = None, warmups: int = 2):
        sizes = sorted({int(b) for b in capture_bs})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture_bs must name at least one batch size >= 1, got {list(capture_bs)}")
        if capture and world.device.type != "cuda":
            raise ValueError(f"capture=True records CUDA graphs; the world is on {world.device} (capture=False makes "
                             f"the same calls without a graph)")
        if warmups < 0:
            raise ValueError(f"warmups must be >= 0, got {warmups}")
        self.backend, self.world, self.capture_bs, self.capture = backend, world, sizes, capture
        self.forward = forward or layer_call
        self.warmups = warmups
        self.max_bs = sizes[-1]
        # DecodeCudaGraphRunner.__init__: decode captures one token per request, so max_num_token = max_bs
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.fill_value = int(backend.get_cuda_graph_seq_len_fill_value())
        self.buffers = self._allocate()
        self.batches: dict[int, object] = {}  # bs -> the capture-time ForwardBatch over the buffers' slices
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.stream = torch.cuda.Stream(world.device) if capture else None
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def _allocate(self) -> _StaticInputs:
        w, g, n, dev = self.world, self.world.geometry, self.max_bs, self.world.device

        def idx():
            return torch.zeros(n, dtype=torch.int64, device=dev)

        def act(width):
            return [torch.zeros(n, width, dtype=w.dtype, device=dev) for _ in w.layers]

        return _StaticInputs(idx(), idx(), idx(), torch.zeros(n, dtype=torch.int64), idx(), idx(),
                             act(g.num_heads * g.head_dim), act(g.num_kv_heads * g.head_dim),
                             act(g.num_kv_heads * g.v_head_dim))

    # ------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        """``_capture``: seq_lens buffers at the fill value, index buffers zeroed, then each size, largest first."""
        b = self.buffers
        b.seq_lens.fill_(self.fill_value)
        b.seq_lens_cpu.fill_(self.fill_value)
        for t in (b.req_pool_indices, b.out_cache_loc, b.positions):
            t.zero_()
        if self.capture:
            self.stream.wait_stream(torch.cuda.current_stream(self.world.device))
        with torch.cuda.stream(self.stream) if self.capture else contextlib.nullcontext():
            for bs in reversed(self.capture_bs):
                self._capture_one(bs)
        if self.capture:
            torch.cuda.current_stream(self.world.device).wait_stream(self.stream)

    def _capture_one(self, bs: int) -> None:
        """``capture_one_shape`` + ``FullCudaGraphBackend.capture_one`` for one batch size."""
        b = self.buffers
        fb = forward_batch_over(self.world, bs=bs, input_ids=b.input_ids[:bs], req_pool_indices=b.req_pool_indices[:bs],
                            seq_lens=b.seq_lens[:bs], seq_lens_cpu=b.seq_lens_cpu[:bs],
                            out_cache_loc=b.out_cache_loc[:bs], positions=b.positions[:bs],
                            seq_lens_sum=int(b.seq_lens_cpu[:bs].sum()))
        self.batches[bs] = fb
        with self.world.scope(self.backend, fb):
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        for _ in range(self.warmups):
            if self.capture:
                torch.cuda.synchronize(self.world.device)
            self._run_once(bs)
        if not self.capture:  # the capture's call, made plainly
            self._run_once(bs)
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, stream=self.stream):
            out = self._run_once(bs)
        self.graphs[bs], self.outputs[bs] = graph, out

    def _run_once(self, bs: int) -> list[torch.Tensor]:
        """``run_once``: the in-graph metadata, then every layer on the static activations. [bs, Hq * Dv] each."""
        b, fb = self.buffers, self.batches[bs]
        with self.world.scope(self.backend, fb):
            self.backend.init_forward_metadata_in_graph(fb)
            return [self.forward(self.world, self.backend, layer, b.q[i][:bs], b.k[i][:bs], b.v[i][:bs], fb)
                    for i, layer in enumerate(self.world.layers)]

    # ------------------------------------------------------------------ replay

    def bucket(self, raw_bs: int) -> int:
        """The captured size a batch of ``raw_bs`` rows is padded to (``_pad_to_bucket``)."""
        for bs in self.capture_bs:
            if bs >= raw_bs:
                return bs
        raise ValueError(f"batch size {raw_bs} exceeds the largest captured batch size {self.max_bs}")

    def load(self, batch: DecodeBatch) -> int:
        """``load_batch``: ``fill_from`` (rows copied, tails reset) and ``init_forward_metadata_out_graph`` on the
        replay view. Returns the padded batch size."""
        if not self.batches:
            raise RuntimeError("capture_all() must run before a replay")
        raw, b = batch.batch_size, self.buffers
        bs = self.bucket(raw)
        b.req_pool_indices[:raw].copy_(batch.req_pool_indices)
        b.seq_lens[:raw].copy_(batch.seq_lens)
        b.seq_lens_cpu[:raw].copy_(batch.seq_lens_cpu)
        b.out_cache_loc[:raw].copy_(batch.out_cache_loc)
        b.positions[:raw].copy_(batch.positions)
        b.seq_lens[raw:bs].fill_(self.fill_value)
        b.seq_lens_cpu[raw:bs].fill_(self.fill_value)
        for t in (b.req_pool_indices, b.out_cache_loc, b.positions):
            t[raw:bs].zero_()
        # the padded rows' activations are left as they are: SGLang's model computes them from input_ids whose
        # padded tail is not reset either; their outputs are dropped and their K/V go to the padding slot 0
        for i in range(len(self.world.layers)):
            b.q[i][:raw].copy_(batch.q[i])
            b.k[i][:raw].copy_(batch.k[i])
            b.v[i][:raw].copy_(batch.v[i])
        view = self._replay_view(batch, bs)
        # outside any ForwardContext, as in SGLang (load_batch runs before the replay's forward)
        with contextlib.nullcontext() if self.world.standin else parallel_scope():
            self.backend.init_forward_metadata_out_graph(view)
        return bs

    def _replay_view(self, batch: DecodeBatch, bs: int) -> SimpleNamespace:
        """``build_replay_fb_view``: the static buffers' ``[:bs]`` slices, the batch's own ``out_cache_loc``."""
        b, raw = self.buffers, batch.batch_size
        mode = self.world.forward_mode.DECODE
        return SimpleNamespace(
            batch_size=bs, forward_mode=mode, actual_forward_mode=mode, input_ids=b.input_ids[:bs],
            positions=b.positions[:bs], req_pool_indices=b.req_pool_indices[:bs], seq_lens=b.seq_lens[:bs],
            seq_lens_sum=int(batch.seq_lens_cpu.sum()) + (bs - raw) * self.fill_value,
            seq_lens_cpu=b.seq_lens_cpu[:bs], max_seq_len_host=int(batch.seq_lens_cpu.max()), num_padding=bs - raw,
            encoder_lens=None, out_cache_loc=batch.out_cache_loc, spec_info=None, lora_ids=None)

    def launch(self, bs: int) -> list[torch.Tensor]:
        """``backend.replay``: the graph of ``bs`` (or, without graphs, its step again). [bs, Hq * Dv] per layer,
        the graph's own output tensors (overwritten by the next replay)."""
        if self.capture:
            self.graphs[bs].replay()
            return self.outputs[bs]
        return self._run_once(bs)

    def replay(self, batch: DecodeBatch) -> list[torch.Tensor]:
        """One decode step of ``batch``: per layer its real rows' outputs [raw_bs, Hq * Dv] (copies)."""
        bs = self.load(batch)
        return [o[: batch.batch_size].clone() for o in self.launch(bs)]


def drive_decode_graph(backend, world: World, batches: Sequence[DecodeBatch], *, capture: bool,
                       capture_bs: Sequence[int] | None = None, forward: Forward | None = None
                       ) -> list[list[torch.Tensor]]:
    """Capture (``capture_bs``, default ``default_capture_bs`` of the largest batch) and replay ``batches`` in
    order; returns per batch the per-layer outputs [raw_bs, Hq * Dv]. Each replay writes its batch's new K/V, so
    batches read what earlier ones wrote where they share slots (``make_batch``'s default placement shares none)."""
    if not batches:
        raise ValueError("batches must hold at least one DecodeBatch")
    sizes = capture_bs if capture_bs is not None else default_capture_bs(max(b.batch_size for b in batches))
    replica = DecodeGraphReplica(backend, world, sizes, capture=capture, forward=forward)
    replica.capture_all()
    return [replica.replay(b) for b in batches]
