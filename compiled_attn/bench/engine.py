"""A minimal serving runner: KV pools, the request table, one batch admitted (prefill), N greedy decode steps.

    engine = Engine(model, make_backend("compiled", GraphConfig(...)), max_batch=32, max_context=264)
    first = engine.admit([256] * 8, seed=1)      # prefill; warm-up already happened in the constructor
    out = engine.decode(8)                       # greedy, per-step latencies
    engine.release()

Host bookkeeping (slot allocation, table rows) is the same for every backend and inside each step's timing, as
it is in a server. Latencies are ``time.perf_counter`` deltas, with ``torch.cuda.synchronize`` on CUDA.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from profiling import range as prange

from .backends import DecodeBatch, ExtendBatch
from .models import DecoderBase
from .pools import ReqToTokenTable, SlotAllocator


@dataclass
class PrefillResult:
    tokens: torch.Tensor  # [bs] int64, greedy token after each prompt
    latency_s: float
    num_tokens: int
    logits: torch.Tensor | None = None  # [bs, vocab] float32 (when keep_logits)
    bucket: str = "eager"  # the backend's prefill bucket ("eager" for the uncompiled backends)


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [bs, steps] int64
    latencies_s: list[float]
    buckets: list[str]
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [bs, vocab] (when keep_logits)


class Engine:
    """Owns the KV pool(s), ``req_to_token`` and the slot allocator for one model and one backend.

    model: a ``DecoderBase`` (its dtype and device are the engine's); backend: from ``make_backend``.
    max_batch: most requests admitted at once; max_context: most tokens per request (prompt + output).
    The backend's ``setup`` (the compiled backend's warm-up: compile, and capture on CUDA, of every bucket) runs
    here, before the first request; ``setup_info`` holds its timings.
    """

    def __init__(self, model: DecoderBase, backend, *, max_batch: int, max_context: int, seed: int = 0):
        if max_batch < 1 or max_context < 1:
            raise ValueError(f"max_batch and max_context must be >= 1, got {max_batch}, {max_context}")
        if max_context > model.cfg.max_context:
            raise ValueError(f"max_context={max_context} exceeds the model's context limit {model.cfg.max_context}")
        param = model.lm_head
        self.model, self.backend = model, backend
        self.device, self.dtype = param.device, param.dtype
        self.max_batch, self.max_context = max_batch, max_context
        num_slots = max_batch * max_context + 1  # slot 0 reserved for padded rows
        self.pools = model.make_pool(num_slots, self.dtype, self.device)
        self.table = ReqToTokenTable(max_batch + 1, max_context, self.device)
        # scattered free list, as a long-running server's: the K/V gathers are random, not sequential reads
        self.allocator = SlotAllocator(num_slots, self.device, seed=seed)
        self.persistent = {"req_to_token": self.table.req_to_token, **model.caches_of(self.pools)}
        self._rows: torch.Tensor | None = None
        self._row_ids: list[int] = []
        self._slots: list[torch.Tensor] = []
        self._lens: list[int] = []
        self._tokens: torch.Tensor | None = None
        with torch.no_grad():
            self.setup_info = backend.setup(model, self.persistent, self.device, max_context) or {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def admit(self, prompt_lens: list[int], *, seed: int = 0, keep_logits: bool = False) -> PrefillResult:
        """Allocate rows and slots for a batch of random prompts (token ids seeded by ``seed``) and prefill."""
        if self._rows is not None:
            raise RuntimeError("a batch is already admitted; call release() first")
        bs = len(prompt_lens)
        if not 1 <= bs <= self.max_batch:
            raise ValueError(f"batch of {bs} requests; this engine takes 1..{self.max_batch}")
        if min(prompt_lens) < 1 or max(prompt_lens) >= self.max_context:
            raise ValueError(f"prompt lengths must lie in [1, {self.max_context}) (max_context leaves room for "
                             f"output), got {min(prompt_lens)}..{max(prompt_lens)}")
        dev, total = self.device, sum(prompt_lens)
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(self.model.cfg.vocab, (total,), generator=gen).to(dev)
        positions = torch.cat([torch.arange(n) for n in prompt_lens]).to(dev)
        lens = torch.tensor(prompt_lens, dtype=torch.int64, device=dev)
        logits_idx = torch.cumsum(lens, 0) - 1
        bucket = self.backend.prefill_bucket_of(list(prompt_lens))
        self._sync()
        t0 = time.perf_counter()
        with prange("prefill_step", bs=bs, bucket=bucket):
            self._row_ids = [self.table.alloc_row() for _ in prompt_lens]
            slots = self.allocator.alloc(total)
            self._slots = [slots]
            for row, part in zip(self._row_ids, slots.split(prompt_lens), strict=False):
                self.table.assign(row, 0, part)
            self._rows = torch.tensor(self._row_ids, dtype=torch.int64, device=dev)
            batch = ExtendBatch(self._rows, lens, torch.zeros_like(lens), lens, slots)
            logits = self.backend.prefill(self.model, self.persistent, batch, tokens, positions, slots, logits_idx)
            self._tokens = logits.argmax(-1)
        self._sync()
        latency = time.perf_counter() - t0
        self._lens = list(prompt_lens)
        return PrefillResult(self._tokens.clone(), latency, total, logits if keep_logits else None, bucket)

    @property
    def rows(self) -> torch.Tensor | None:
        """[bs] int64 request rows of the admitted batch (None when none is admitted)."""
        return self._rows

    @property
    def seq_lens(self) -> list[int]:
        """Tokens per admitted request so far (prompt + decoded)."""
        return list(self._lens)

    def next_decode_batch(self) -> DecodeBatch:
        """Host bookkeeping of one decode step: allocate each request's new slot, append it to ``req_to_token``
        at position ``seq_len``, and return the step's ``DecodeBatch`` (inputs: the last greedy tokens)."""
        if self._rows is None:
            raise RuntimeError("no batch admitted")
        if max(self._lens) >= self.max_context:
            raise ValueError(f"a request reached max_context={self.max_context}")
        dev = self.device
        positions = torch.tensor(self._lens, dtype=torch.int64, device=dev)
        loc = self.allocator.alloc(len(self._lens))
        self._slots.append(loc)
        self.table.req_to_token[self._rows, positions] = loc.to(torch.int32)
        self._lens = [n + 1 for n in self._lens]
        return DecodeBatch(self._rows, positions + 1, self._tokens, positions, loc, list(self._lens))

    @torch.no_grad()
    def decode(self, steps: int, *, keep_logits: bool = False) -> DecodeResult:
        """``steps`` greedy steps; each appends its new token's slot to ``req_to_token`` before running."""
        if self._rows is None:
            raise RuntimeError("decode() before admit()")
        if max(self._lens) + steps > self.max_context:
            raise ValueError(f"{steps} steps would pass max_context={self.max_context} "
                             f"(longest request has {max(self._lens)} tokens)")
        bs = len(self._lens)
        out, latencies, buckets, all_logits = [], [], [], []
        for _ in range(steps):
            self._sync()
            t0 = time.perf_counter()
            bucket = self.backend.bucket_of([n + 1 for n in self._lens])
            with prange("decode_step", bs=bs, bucket=bucket):
                batch = self.next_decode_batch()
                logits, tokens = self.backend.decode(self.model, self.persistent, batch)
                self._tokens = tokens.clone()  # graph outputs are overwritten by the next replay
            self._sync()
            latencies.append(time.perf_counter() - t0)
            buckets.append(bucket)
            out.append(self._tokens)
            if keep_logits:
                all_logits.append(logits.clone())
        tokens = torch.stack(out, 1) if out else torch.zeros(bs, 0, dtype=torch.int64, device=self.device)
        return DecodeResult(tokens, latencies, buckets, all_logits)

    def release(self) -> None:
        """Free the admitted batch's rows and slots."""
        for row in self._row_ids:
            self.table.free_row(row)
        for slots in self._slots:
            self.allocator.free(slots)
        self._rows, self._row_ids, self._slots, self._lens, self._tokens = None, [], [], [], None
