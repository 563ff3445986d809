"""Plain float64 attention reference for the tests: per request, dense, masks spelled out. No cleverness."""
from __future__ import annotations

import torch

#: the forms of ``decode.decode_blocks`` and ``verify.verify_blocks`` as keyword arguments: the choice (the C++
#: kernel where it is built) and the portable matmul form (any device, a CPU without the kernel)
DECODE_FORMS = {"auto": {}, "matmul": {"form": "matmul"}}


def reference_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, prefix_lens, ext_lens, *, scale=None,
                        causal=True, sliding_window=None, logit_cap=None, encoder_lens=None, is_cross_attn=False,
                        sinks=None):
    """q: [num_tokens, Hq, Dqk] packed per request; returns [num_tokens, Hq, Dv] float64. sinks: [Hq] logits, one
    more softmax column per head whose value is zero (gpt-oss attention sinks)."""
    hq, dqk = q.shape[1], q.shape[2]
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    scale = dqk ** -0.5 if scale is None else scale
    outs, offset = [], 0
    for i in range(len(seq_lens)):
        n, seq, prefix = int(ext_lens[i]), int(seq_lens[i]), int(prefix_lens[i])
        enc = int(encoder_lens[i]) if encoder_lens is not None else 0
        qi = q[offset:offset + n].double()
        offset += n
        if is_cross_attn:
            key_pos = list(range(0, enc))
        else:
            key_pos = list(range(enc, enc + seq))
        slots = req_to_token[int(rows[i]), key_pos].long() if key_pos else torch.zeros(0, dtype=torch.long)
        k = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)  # [Lk, Hq, D]
        v = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if logit_cap is not None:
            s = logit_cap * torch.tanh(s / logit_cap)
        mask = torch.ones(n, len(key_pos), dtype=torch.bool)
        for a in range(n):
            qpos = prefix + a
            for b in range(len(key_pos)):
                if is_cross_attn:
                    continue
                if causal and b > qpos:
                    mask[a, b] = False
                if sliding_window is not None and b < qpos - sliding_window:
                    mask[a, b] = False
        s = s.masked_fill(~mask[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(hq, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no key gets zeros
        if sinks is not None:
            p = p[..., :-1]  # the sink's weight goes to no value
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs) if outs else torch.zeros(0, hq, dv, dtype=torch.float64)


def reference_verify(q, k_cache, v_cache, table, rows, prefix, k, masks, scale, logit_cap=None, *, k_scale=1.0,
                     v_scale=1.0, sinks=None):
    """float64, request by request: its k queries over positions [0, prefix + k) of its row; the prefix all
    visible, draft key j visible to query i where masks[b, i, j]. q: [bs * k, Hq, D] -> [bs * k, Hq, Dv].
    A float8 cache stores value / scale: K is read back times k_scale, V times v_scale."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = []
    for b in range(len(prefix)):
        p = int(prefix[b])
        slots = table[int(rows[b]), : p + k].long()
        kk = k_cache[slots].double().repeat_interleave(hq // hkv, 1) * k_scale
        vv = v_cache[slots].double().repeat_interleave(hq // hkv, 1) * v_scale
        s = torch.einsum("qhd,khd->hqk", q[b * k:(b + 1) * k].double(), kk) * scale
        if logit_cap is not None:
            s = logit_cap * torch.tanh(s / logit_cap)
        vis = torch.ones(k, p + k, dtype=torch.bool)
        vis[:, p:] = masks[b]
        s = s.masked_fill(~vis[None], float("-inf"))
        if sinks is not None:  # one more softmax column per head, of value zero
            s = torch.cat([s, sinks.double()[:, None, None].expand(hq, k, 1)], -1)
        p_ = torch.softmax(s, -1).nan_to_num(0.0)
        out.append(torch.einsum("hqk,khd->qhd", p_[..., :p + k], vv))
    return torch.cat(out)


def spy_calls(monkeypatch, owner, name: str) -> list:
    """``owner.name`` (a module's function) replaced through ``monkeypatch`` by a wrapper that records each call's
    positional arguments, then calls it; returns the list they are recorded in."""
    calls, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def in_place_op():
    """The op a compiled CPU decode's (and verify's) graph calls to read K/V in place where the C++ kernel is built
    (``native_decode_blocks``: the whole decode, or verify's prefix and draft block)."""
    return torch.ops.compiled_attn.native_decode_blocks.default


def scaled_queries(q, num_kv_heads, scale):
    """q [bs, Hq, D] (any float dtype) -> [bs, Hkv, Hq // Hkv, D] float32, scaled, grouped by KV head: the query rows
    the C++ kernel computes (``.flatten(1, 2)`` gives them back as the merged op's q, one token a row)."""
    bs, hq, d = q.shape
    return q.reshape(bs, num_kv_heads, hq // num_kv_heads, d).float().mul(scale)


def keys_attention(q, keys, k_cache, v_cache, *, k_scale=1.0, v_scale=1.0, logit_cap=0.0):
    """Each query row's softmax attention over keys of its own, in float64: q [R, Hq, D] (a score is q . K times
    k_scale, soft-capped where logit_cap), keys: R int64 tensors of KV slots -> [R, Hq, Dv]; zeros for a row with no
    key. With one block's valid slots as a row's keys it is what the C++ kernel's merged op gives a row that owns that
    block alone."""
    group = q.shape[1] // k_cache.shape[1]
    outs = []
    for qr, slots in zip(q, keys, strict=True):
        k = k_cache[slots].double().repeat_interleave(group, 1) * k_scale  # [n, Hq, D]
        v = v_cache[slots].double().repeat_interleave(group, 1) * v_scale
        s = torch.einsum("hd,nhd->hn", qr.double(), k)
        if logit_cap:
            s = logit_cap * torch.tanh(s / logit_cap)
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))  # no key: an empty sum, zeros
    return torch.stack(outs)
