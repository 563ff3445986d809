"""Reference decoders with seeded random weights, for the benchmark and the end-to-end tests.

``build_model(get_config("llama-3-8b", layers=2))``; presets in ``PRESETS`` (``config.py``). Each model's
``decode`` / ``extend`` take an attention callable chosen by the backend (``compiled_attn.bench.backends``).
"""
from __future__ import annotations

import torch

from .config import ATTN_PRESETS, PRESETS, AttnShape, ModelConfig, attention_shape, get_attention_shape, get_config
from .deepseek import DeepSeekMLA
from .layers import AttnFn, DecoderBase, WeightInit
from .llama import Llama

__all__ = ["ATTN_PRESETS", "PRESETS", "AttnFn", "AttnShape", "DecoderBase", "DeepSeekMLA", "Llama", "ModelConfig",
           "attention_shape", "build_model", "get_attention_shape", "get_config"]

_MODELS = {"llama": Llama, "deepseek": DeepSeekMLA}


def build_model(cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DecoderBase:
    """The model of ``cfg.kind`` with seeded random weights, on ``device`` in ``dtype``, grad off."""
    model = _MODELS[cfg.kind](cfg, WeightInit(seed))
    model = model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)
