"""SGLang's hybrid sliding-window memory in the harness: a model runner over ``SWAKVPool`` (the window layers' K/V in
a smaller pool of their own, reached through the pool's full-to-window slot mapping), as SGLang builds it for
gpt-oss.

``make_swa_model_runner`` builds the stand-in with an ``SWAKVPool`` (window layers: those given a window) and the
mapping SGLang's ``SWATokenToKVPoolAllocator`` registers (``size + page_size`` zeros, then the -1 sentinel). Its
``swa_memory`` (``SwaMemory``) is the harness's own allocator for the window pool: the batch builders pair every
full-pool slot they hand out with a window-pool slot (pages with pages, offset for offset, as SGLang's allocators
page in step), write K/V through the pool's ``set_kv_buffer`` with the translated location, and ``free_below``
frees a request's positions below a window as SGLang does (the mapping entry back to 0, the padding slot).
``poison`` then fills with NaN every window-pool slot no request's kept positions own and every full-pool slot no
request owns, so a read of anything freed, foreign or untranslated shows in the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...bench.pools import SlotAllocator
from .geometry import AttnGeometry, make_model_runner


class SwaMemory:
    """The window pool's slots: allocation paired with the full pool's, freeing below a window, poisoning."""

    def __init__(self, pool, size_swa: int, page_size: int, seed: int):
        self.pool, self.page_size = pool, page_size
        # slot 0 (page 0) is the padding slot, never handed out, as in SGLang
        self.allocator = SlotAllocator((size_swa // page_size if page_size > 1 else size_swa) + 1, seed=seed)
        mapping = torch.zeros(pool.size + page_size + 1, dtype=torch.int64)
        mapping[-1] = -1  # SGLang's sentinel (a last_loc of -1 reads it)
        pool.register_mapping(mapping)

    @property
    def mapping(self) -> torch.Tensor:
        return self.pool.full_to_swa_index_mapping

    def pair(self, full_slots: Sequence[int]) -> None:
        """Give each full-pool slot a window-pool slot: token by token, or (paged) page by page at the same offset."""
        full = torch.as_tensor(list(full_slots), dtype=torch.int64)
        if full.numel() == 0:
            return
        ps = self.page_size
        if ps == 1:
            self.mapping[full] = self.allocator.alloc(full.numel()).to(torch.int64)
            return
        pages = torch.unique(full // ps)
        swa_pages = self.allocator.alloc(pages.numel()).to(torch.int64)
        for page, swa_page in zip(pages.tolist(), swa_pages.tolist(), strict=True):
            self.mapping[page * ps:(page + 1) * ps] = swa_page * ps + torch.arange(ps)

    def translate(self, loc: torch.Tensor) -> torch.Tensor:
        return self.mapping[loc.to(torch.int64).cpu()].to(loc.device)

    def free_below(self, req_to_token: torch.Tensor, row: int, start: int) -> None:
        """Free positions ``[0, start)`` of request row ``row`` from the window pool (paged: the whole pages below
        ``start``'s page, as SGLang's page-aligned eviction): their mapping entries back to 0, their window-pool
        slots (pages) back to the allocator, for later batches."""
        if self.page_size > 1:
            start -= start % self.page_size
        if start <= 0:
            return
        full = req_to_token[row, :start].to(torch.int64).cpu()
        swa = self.mapping[full]
        swa = swa[swa > 0]  # not freed before
        self.mapping[full] = 0
        self.allocator.free(torch.unique(swa // self.page_size) if self.page_size > 1 else swa)

    def poison(self, req_to_token: torch.Tensor, rows: Sequence[int], lens: Sequence[int]) -> None:
        """NaN into every window-pool slot that the kept positions of the requests (rows, their lengths in
        positions) do not own, and into every full-pool slot they do not own (slot 0 included)."""
        owned_full = torch.cat([req_to_token[r, :n].to(torch.int64).cpu() for r, n in zip(rows, lens, strict=True)])
        owned_swa = self.mapping[owned_full]
        owned_swa = owned_swa[owned_swa > 0]
        for sub, owned in ((self.pool.swa_kv_pool, owned_swa), (self.pool.full_kv_pool, owned_full)):
            for i in range(sub.layer_num):
                for buf in (sub.get_key_buffer(i), sub.get_value_buffer(i)):
                    keep = torch.zeros(buf.shape[0], dtype=torch.bool)
                    keep[owned] = True
                    buf[~keep.to(buf.device)] = float("nan")


def make_swa_model_runner(geom: AttnGeometry, windows: Sequence[int | None], *, swa_pool_size: int | None = None,
                          **kwargs):
    """``make_model_runner`` (same keyword arguments) over SGLang's ``SWAKVPool``: layer ``i`` is a window layer,
    its K/V in the window pool (``swa_pool_size`` tokens, default a quarter of ``pool_size``), when ``windows[i]``
    is a window (the layers' ``sliding_window_size``, ``make_layer(geom, i, windows[i])``), a full layer for None.
    The runner's ``swa_memory`` (``SwaMemory``) pairs the batch builders' slots; ``windows`` is kept on it."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    assert not geom.mla, "SWAKVPool over MHA pools (SGLang's default for hybrid sliding-window models)"
    mr = make_model_runner(geom, num_layers=len(windows), **kwargs)
    old = mr.token_to_kv_pool
    size, page = mr.max_total_num_tokens, mr.page_size
    swa_size = swa_pool_size or max(page, size // 4 // page * page)
    pool = SWAKVPool(
        size=size, size_swa=swa_size, page_size=page, dtype=old.dtype, head_num=geom.num_kv_heads,
        head_dim=geom.head_dim, swa_attention_layer_ids=[i for i, w in enumerate(windows) if w is not None],
        full_attention_layer_ids=[i for i, w in enumerate(windows) if w is None], device=mr.device,
        v_head_dim=geom.v_head_dim)
    mr.token_to_kv_pool = pool
    mr.swa_memory = SwaMemory(pool, swa_size, page, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=mr.generator)))
    mr.windows = list(windows)
    mr.model_config.is_hybrid_swa = True
    return mr
