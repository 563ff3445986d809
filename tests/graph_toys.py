"""The toy step, buffers and runner shared by the GraphRunner tests (``test_graphs_runner*.py``).

The toy step reads a persistent ``cache [S, D]`` through a static slot table, masks by ``seq_lens`` and
returns ``(out [bs, D], lse [bs])``: the shape of a decode step without the attention specifics.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from graphs import BucketPolicy, BufferSpec, GraphRunner, StaticBuffers

D = 8
NUM_SLOTS = 64
POLICY = BucketPolicy((1, 2, 4, 8, 16), (16, 32))


def toy_step(inputs: dict[str, torch.Tensor], persistent: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [bs, D] f32, slots [bs, kv] i64 (rows of cache), seq_lens [bs] i64; cache [S, D] f32.

    Returns out [bs, D] (softmax-weighted cache rows over the first seq_lens slots) and lse [bs].
    """
    q, slots, lens = inputs["q"], inputs["slots"], inputs["seq_lens"]
    k = persistent["cache"][slots]  # [bs, kv, D]
    scores = (k * q[:, None, :]).sum(-1)  # [bs, kv]
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    out = (torch.softmax(scores, -1)[..., None] * k).sum(1)
    return out, torch.logsumexp(scores, -1)


def make_buffers_on(device):
    def make_buffers(key: tuple[int, int]) -> StaticBuffers:
        bs, kv = key
        specs = {
            "q": BufferSpec((bs, D), torch.float32, fill=0.0),
            "slots": BufferSpec((bs, kv), torch.int64, fill=0),  # padded rows read the dummy slot 0
            "seq_lens": BufferSpec((bs,), torch.int64, fill=1),  # one token: cheap and finite
        }
        return StaticBuffers(specs, device)

    return make_buffers


def real_batch(n: int, max_len: int, device="cpu", gen=None) -> dict[str, torch.Tensor]:
    """n requests of 1..max_len tokens, slots padded to kv_bucket(max_len) columns (never slot 0)."""
    kv = POLICY.kv_bucket(max_len)
    lens = torch.randint(1, max_len + 1, (n,), generator=gen)
    lens[0] = max_len
    return {
        "q": torch.randn(n, D, generator=gen).to(device),
        "slots": torch.randint(1, NUM_SLOTS, (n, kv), generator=gen).to(device),
        "seq_lens": lens.to(device),
    }


def inductor(fn):
    return torch.compile(fn, fullgraph=True, backend="inductor")


KEYS = POLICY.keys()


def make_runner(device="cpu", *, compile_fn=inductor, keys=KEYS, **kwargs) -> GraphRunner:
    return GraphRunner(
        toy_step,
        make_buffers=make_buffers_on(device),
        keys=keys,
        device=device,
        use_cuda_graph=torch.device(device).type == "cuda",
        compile_fn=compile_fn,
        progress=False,
        **kwargs,
    )


def assert_outputs_match(got, real, persistent, n):
    want = toy_step(real, persistent)
    for g, w in zip(got, want, strict=False):
        assert g.shape[0] >= n
        torch.testing.assert_close(g[:n], w, rtol=1e-5, atol=1e-5)


def key_for(real):
    return POLICY.key(real["q"].shape[0], real["slots"].shape[1])


def compile_count() -> tuple[int, int]:
    # torch 2.13 has no counters["recompiles"] (and counters["frames"] stays empty on this path): every dynamo
    # compile adds one to stats/unique_graphs and one aot_autograd/total.
    return counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
