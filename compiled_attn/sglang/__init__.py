"""compiled-attn's SGLang integration: the attention backend, its plugin entry point, the CPU fix-ups for
running SGLang on a CPU-only machine, and ``testing`` (SGLang's attention path driven without a model).

Importing this package imports nothing else: SGLang loads ``compiled_attn.sglang.plugin`` in every process.
"""
