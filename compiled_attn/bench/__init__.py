"""compiled-attn's benchmark tooling: the ``compiled-attn`` command line, the benchmarks, a minimal serving
engine with reference models, the per-request loop baseline, and random paged batches shared with the tests."""
