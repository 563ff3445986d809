"""Shapes of the reference models: ``ModelConfig`` and the one preset table (models and attention shapes).

Vocabularies are reduced on purpose (4096 for the real-shape presets): the weights are random, and a full
lm_head (32000 x 4096) would cost more per decode step than the rest of a 2-layer step, hiding the backends'
difference behind one GEMM that all of them share.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of one reference model. ``kind`` is ``"llama"`` (MHA/GQA) or ``"deepseek"`` (MLA).

    intermediate: SwiGLU width; used only when ``mlp`` is True (the benchmark leaves it off by default: the MLP
    is the same dense GEMMs in every backend).
    max_context: the context limit (the bench refuses ``input_len + output_len`` beyond it).
    MLA fields (deepseek only): kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim.
    """

    name: str
    kind: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_layers: int = 2
    mlp: bool = False
    max_context: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # Llama-3-8B attention/MLP shapes; vocab 4096 instead of 128256 (see the module doc).
    "llama-3-8b": ModelConfig("llama-3-8b", "llama", hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate=14336, vocab=4096, max_context=8192, rope_theta=500000.0),
    "tiny-llama": ModelConfig("tiny-llama", "llama", hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate=128, vocab=256, max_context=1024),
    # DeepSeek-V2-Lite attention shapes (no q-LoRA); its first layer's dense MLP width; vocab 4096.
    "deepseek-v2-lite": ModelConfig("deepseek-v2-lite", "deepseek", hidden=2048, num_heads=16, num_kv_heads=1,
                                    head_dim=192, intermediate=10944, vocab=4096, max_context=8192,
                                    kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128),
    "tiny-deepseek": ModelConfig("tiny-deepseek", "deepseek", hidden=64, num_heads=4, num_kv_heads=1,
                                 head_dim=24, intermediate=128, vocab=256, max_context=1024,
                                 kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16),
}


def get_config(name: str, *, layers: int | None = None, mlp: bool | None = None) -> ModelConfig:
    """A preset by name, with the layer count and MLP switch overridden when given."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        cfg = cfg.replace(num_layers=layers)
    if mlp is not None:
        cfg = cfg.replace(mlp=mlp)
    return cfg



@dataclass(frozen=True)
class AttnShape:
    """One attention layer's shape as a benchmark sees it: ``hq`` query heads over ``hkv`` KV heads, head dims
    ``dqk`` / ``dv``; ``mla``: absorbed MLA (one latent cache, V = its first ``dv`` columns)."""

    hq: int
    hkv: int
    dqk: int
    dv: int
    mla: bool = False


def attention_shape(cfg: ModelConfig) -> AttnShape:
    """The decode attention of a model preset: MHA/GQA as configured; MLA absorbed over the latent cache."""
    if cfg.kind == "deepseek":
        return AttnShape(cfg.num_heads, 1, cfg.kv_lora_rank + cfg.qk_rope_dim, cfg.kv_lora_rank, mla=True)
    return AttnShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)


#: the attention-only benchmarks' shape names, each the decode attention of a model preset
ATTN_PRESETS: dict[str, str] = {"mha": "llama-3-8b", "mla": "deepseek-v2-lite", "tiny-mha": "tiny-llama",
                                "tiny-mla": "tiny-deepseek"}


def get_attention_shape(name: str) -> AttnShape:
    """``"mha"``, ``"mla"``, ``"tiny-mha"``, ``"tiny-mla"`` (``ATTN_PRESETS``) or a model preset's name."""
    if name in ATTN_PRESETS:
        name = ATTN_PRESETS[name]
    return attention_shape(get_config(name))
