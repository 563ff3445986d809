"""Reference decoders with seeded random weights, for the benchmark and the end-to-end tests.

``build_model(get_config("llama-3-8b", layers=2))``; presets in ``PRESETS``. Each model's ``decode`` / ``extend``
take an attention callable chosen by the backend (``compiled_attn.models.backends``).
"""
from .common import PRESETS, AttnFn, ModelConfig, build_model, get_config
from .deepseek import DeepSeekMLA
from .llama import Llama

__all__ = ["PRESETS", "AttnFn", "DeepSeekMLA", "Llama", "ModelConfig", "build_model", "get_config"]
