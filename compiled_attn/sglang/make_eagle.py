"""A seeded random-weight EAGLE draft head for a ``make_model`` Llama checkpoint (no download).

    python -m compiled_attn.sglang.make_eagle --target DIR OUT_DIR [--seed N]

``make_eagle(target_dir, out_dir, seed=0)`` writes ``config.json`` and ``model.safetensors`` in the layout SGLang
0.5.23 loads as ``LlamaForCausalLMEagle`` (``sglang/srt/models/llama_eagle.py``, ``--speculative-algorithm EAGLE
--speculative-draft-model-path OUT_DIR``): the target's Llama config with one decoder layer, and the weights

- ``fc.weight`` ``[H, 2H]`` + ``fc.bias`` ``[H]``: the projection of ``[token embedding, target hidden state]``;
- ``layers.0.*``: one Llama decoder layer without ``input_layernorm`` (EAGLE skips it in layer 0; SGLang deletes it);
- ``embed_tokens.weight``: a copy of the target's (what released EAGLE heads carry).

No ``lm_head`` and no final norm: SGLang's EAGLE worker shares the target's embedding and LM head with the draft
(``set_embed_and_head``). Names have no ``model.`` prefix (``LlamaForCausalLMEagle.load_weights`` adds it). The
tokenizer files are copied too, so the directory is complete on its own.

Random weights draft tokens the target rarely agrees with (accept length near 1); the head exists so that SGLang's
whole EAGLE path (draft extend, draft decode, tree build, target verify) runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
STD = 0.2  # the tiny presets' weight scale (make_model._FIXED_STD)


def eagle_config(target: dict) -> dict:
    """The draft head's config from the target's ``config.json`` (a Llama): same sizes, one layer."""
    if target.get("model_type") != "llama":
        raise ValueError(f"make_eagle: the target must be a Llama checkpoint, got model_type "
                         f"{target.get('model_type')!r}")
    cfg = {k: v for k, v in target.items() if not k.startswith("_")}
    cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1, tie_word_embeddings=False)
    return cfg


def eagle_weights(cfg: dict, embed, seed: int = 0) -> dict:
    """The head's tensors (float32, seeded normal ``STD`` matrices, unit norm weights, zero fc bias)."""
    import torch

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    shapes = {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (heads * d, h),
        "layers.0.self_attn.k_proj.weight": (kv_heads * d, h),
        "layers.0.self_attn.v_proj.weight": (kv_heads * d, h),
        "layers.0.self_attn.o_proj.weight": (h, heads * d),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=gen) * STD for name, shape in shapes.items()}
    out["fc.bias"] = torch.zeros(h)
    out["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    out["embed_tokens.weight"] = embed.to(torch.float32).clone()
    return {k: v.contiguous() for k, v in out.items()}


def make_eagle(target_dir: str, out_dir: str, seed: int = 0) -> str:
    """Write the EAGLE head for the Llama checkpoint in ``target_dir`` to ``out_dir`` (created); returns it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = eagle_config(json.load(f))
    with safe_open(os.path.join(target_dir, "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    if tuple(embed.shape) != (cfg["vocab_size"], cfg["hidden_size"]):
        raise ValueError(f"make_eagle: the target's embedding is {tuple(embed.shape)}, its config says "
                         f"{(cfg['vocab_size'], cfg['hidden_size'])}")
    os.makedirs(out_dir, exist_ok=True)
    save_file(eagle_weights(cfg, embed, seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in _COPIED:
        if os.path.exists(os.path.join(target_dir, name)):
            shutil.copyfile(os.path.join(target_dir, name), os.path.join(out_dir, name))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compiled_attn.sglang.make_eagle",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True,
                   help="the Llama checkpoint (compiled-attn make-model --preset tiny-llama DIR)")
    p.add_argument("out_dir", help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print(make_eagle(args.target, args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
