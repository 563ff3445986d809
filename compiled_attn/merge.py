"""The log-sum-exp merge of partial softmaxes (split-KV blocks; two normalised partials of the same rows: extend
spans, verify prefix chunks), and attention sinks joining a merged row's denominator."""
from __future__ import annotations

import torch


def merge_partials(m: torch.Tensor, lsum: torch.Tensor, o: torch.Tensor, block_req: torch.Tensor, num_rows: int,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge per-block partial softmaxes into one output per row (``decode.merge_blocks`` is this as an op).

    m, lsum: [nblk, Hkv, group] block max and sum of exp; o: [nblk, Hkv, group, Dv] block's unnormalised output;
    block_req: [nblk] row of each block, ``num_rows`` for unused blocks; sinks: [Hkv, group] float32 logits that
    join every row's denominator, or None -> [num_rows, Hkv, group, Dv] float32.
    """
    rows = num_rows + 1  # the extra row collects unused blocks
    # ATen's fast row-wise index_add needs contiguous operands (else it takes an element-wise scatter path); a
    # half-precision kernel's block outputs are merged in float32
    m, lsum, o = m.contiguous(), lsum.contiguous(), o.float().contiguous()
    lowest = torch.finfo(torch.float32).min
    m_req = torch.full((rows, *m.shape[1:]), lowest, device=m.device, dtype=m.dtype)
    m_req = m_req.scatter_reduce(0, block_req.view(-1, *[1] * (m.dim() - 1)).expand_as(m), m, reduce="amax")
    if sinks is not None:  # the sink is one more term of the row's max, so no exp() below can overflow
        m_req = torch.maximum(m_req, sinks)
    w = torch.exp(m - m_req.index_select(0, block_req))
    acc = o.new_zeros((rows, *o.shape[1:])).index_add_(0, block_req, (o * w[..., None]).contiguous())
    den = lsum.new_zeros((rows, *lsum.shape[1:])).index_add_(0, block_req, lsum * w)
    if sinks is not None:
        den = den + torch.exp(sinks - m_req)
    return acc[:num_rows] / den[:num_rows, ..., None].clamp_min(torch.finfo(torch.float32).tiny)


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """A normalised output ``o: [..., Dv]`` with its rows' log-sum-exp ``lse: [...]`` after the sinks (broadcast
    against ``lse``) join the denominator: ``o * e^lse / (e^lse + e^sink) = o * sigmoid(lse - sink)``, float32."""
    o = o.float()
    if sinks is None:
        return o
    return o * torch.sigmoid(lse - sinks)[..., None]


def merge_two(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two normalised partial softmaxes of the same rows -> one (log-sum-exp rule); a row with no key on either
    side has lse -inf and stays zero. o: [..., L, D]; lse: [..., L]. One pass over the outputs (``lerp``): on a
    shared 2-core machine every large elementwise op is a parallel region that can stall on a descheduled thread,
    so the weights are computed on the small ``lse`` tensors. ``out``: where the merged o is written (any strides,
    o_a's shape), else a new tensor."""
    m = torch.maximum(lse_a, lse_b).clamp_min(torch.finfo(torch.float32).min)  # finite: no inf - inf
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    den = w_a + w_b
    o = torch.lerp(o_a, o_b, (w_b / den.clamp_min(torch.finfo(torch.float32).tiny))[..., None], out=out)
    return o, m + torch.log(den)


def merge_normalised(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised partial softmaxes of the same rows, ``(o [..., R, D], lse [..., R])`` each, -> one, float32."""
    if len(parts) == 1:
        return parts[0][0].float(), parts[0][1]
    o = torch.stack([p[0].float() for p in parts])
    lse = torch.stack([p[1] for p in parts])
    total = torch.logsumexp(lse, 0)
    return (o * torch.exp(lse - total)[..., None]).sum(0), total


def merge_normalised_rows(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, num_rows: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised partial softmaxes, each of one output row (``rows``: [P] int64), merged per row in one pass.

    o: [P, ...R, D] (any float dtype); lse: [P, ...R] float32 -> (o [num_rows, ...R, D] float32, lse [num_rows,
    ...R]); a row with no partial gets zeros and the float32 minimum as its lse."""
    lowest = torch.finfo(torch.float32).min
    m = torch.full((num_rows, *lse.shape[1:]), lowest, dtype=torch.float32, device=lse.device)
    m = m.scatter_reduce(0, rows.view(-1, *[1] * (lse.dim() - 1)).expand_as(lse), lse, reduce="amax")
    w = torch.exp(lse - m.index_select(0, rows))
    den = torch.zeros_like(m).index_add_(0, rows, w)
    acc = o.new_zeros((num_rows, *o.shape[1:]), dtype=torch.float32).index_add_(0, rows, o.float() * w[..., None])
    den = den.clamp_min(torch.finfo(torch.float32).tiny)
    return acc / den[..., None], (m + torch.log(den)).clamp_min(lowest)
