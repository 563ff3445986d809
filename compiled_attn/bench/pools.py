"""KV pools and the request-to-token table of this project's own models (``bench/models``) and engine loop, in
SGLang's token-granular layout (``kv``): a served SGLang engine brings its own.

Slot 0 and request row 0 are reserved: padded batch rows of a captured graph point there, so a padded row reads
finite, harmless data and never touches a live request's cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAD_SLOT = 0


class SlotAllocator:
    """Free list of KV slots ``[1, num_slots)``; slot 0 stays reserved as the padding target.

    Host-side bookkeeping (as SGLang's token_to_kv_pool allocator); never called inside a compiled step.
    """

    def __init__(self, num_slots: int, device: torch.device | str = "cpu", *, seed: int | None = None):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        free = torch.arange(1, num_slots, dtype=torch.int64)
        if seed is not None:  # scattered slots, as a long-running server's free list looks
            free = free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(seed))]
        self._free = free

    @property
    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor:
        """Return ``n`` free slots as ``[n]`` int64 on the pool's device."""
        if n > self.available:
            raise ValueError(f"cannot allocate {n} KV slots: only {self.available} of {self.num_slots - 1} free")
        out, self._free = self._free[:n], self._free[n:]
        return out.to(self.device)

    def free(self, slots: torch.Tensor) -> None:
        self._free = torch.cat([self._free, slots.detach().to("cpu", torch.int64).flatten()])


class ReqToTokenTable:
    """The request-to-token table ``req_to_token: [max_reqs, max_context_len]`` int32, with a row allocator.

    Row 0 is reserved for padded batch rows; its entries stay ``PAD_SLOT``.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"):
        if max_reqs < 2:
            raise ValueError(f"max_reqs must be >= 2 (row 0 is reserved), got {max_reqs}")
        if max_context_len < 1:
            raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, 0, -1))

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise ValueError(f"no free request rows (max_reqs={self.req_to_token.shape[0]}, row 0 reserved)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    def assign(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Map positions ``[start, start + len(slots))`` of request ``row`` to ``slots``."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"position {end} exceeds max_context_len={self.max_context_len}")
        self.req_to_token[row, start:end] = slots.to(self.req_to_token.device, torch.int32)


@dataclass
class MHAKVPool:
    """Per-layer K and V caches ``[num_slots, num_kv_heads, head_dim | v_head_dim]``."""

    num_slots: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    k_buffers: list[torch.Tensor] = field(init=False)
    v_buffers: list[torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.v_head_dim = self.v_head_dim or self.head_dim
        kshape = (self.num_slots, self.num_kv_heads, self.head_dim)
        vshape = (self.num_slots, self.num_kv_heads, self.v_head_dim)
        self.k_buffers = [torch.zeros(kshape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_buffers = [torch.zeros(vshape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]


@dataclass
class MLAKVPool:
    """Per-layer latent cache ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``; V is a view of its head."""

    num_slots: int
    num_layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    kv_buffers: list[torch.Tensor] = field(init=False)

    def __post_init__(self):
        shape = (self.num_slots, 1, self.kv_lora_rank + self.qk_rope_head_dim)
        self.kv_buffers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(k_cache [S, 1, 576], v_cache [S, 1, 512])``; ``v_cache`` is a view sharing storage."""
        kv = self.kv_buffers[layer]
        return kv, kv[..., : self.kv_lora_rank]
