"""``compiled_attn.sglang.make_model``: seeded random-weight checkpoints that transformers loads (fast, no SGLang)."""

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from compiled_attn.sglang.make_model import PRESETS, main, make_model, prompt_of


def _tensors(d):
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v2", "tiny-gemma2", "tiny-llama-g4"])
def test_loads_in_transformers(preset, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = make_model(preset, str(tmp_path / preset))
    names = set(os.listdir(d))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == PRESETS[preset]["model_type"]
    assert config.vocab_size == PRESETS[preset]["vocab_size"]
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    if preset == "tiny-deepseek-v2":  # keys SGLang reads from config.json directly
        assert raw["rope_scaling"]["type"] == "yarn" and raw["moe_layer_freq"] == 1
    if preset == "tiny-gemma2":  # SGLang reads hidden_act; layer 0 is the sliding-window one
        assert raw["hidden_act"] == "gelu_pytorch_tanh" and raw["sliding_window"] == 16
        assert config.layer_types == ["sliding_attention", "full_attention"]
    tok = AutoTokenizer.from_pretrained(d)
    ids = [7, 8, 200]
    assert tok(prompt_of(ids), add_special_tokens=False)["input_ids"] == [i + 4 for i in ids]  # 4 special tokens
    assert tok.decode([11, 12]) == "w7 w8"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[4, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # random weights large enough that tokens differ


def test_deterministic_per_seed(tmp_path):
    a = _tensors(make_model("tiny-llama", str(tmp_path / "a"), seed=1))
    b = _tensors(make_model("tiny-llama", str(tmp_path / "b"), seed=1))
    c = _tensors(make_model("tiny-llama", str(tmp_path / "c"), seed=2))
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a if a[k].dim() >= 2)


def test_cli_and_errors(tmp_path, capsys):
    assert main(["--preset", "tiny-llama", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert os.path.exists(tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        make_model("nope", str(tmp_path / "x"))
    with pytest.raises(SystemExit):
        main(["--preset", "nope", str(tmp_path / "y")])


def test_large_presets_keep_the_real_attention_shapes():
    llama, ds = PRESETS["llama-3-8b-2l"], PRESETS["deepseek-v2-lite-2l"]
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]) == (32, 8, 128)
    assert (ds["kv_lora_rank"], ds["qk_nope_head_dim"], ds["qk_rope_head_dim"], ds["v_head_dim"]) == (512, 128, 64, 128)
    assert llama["num_hidden_layers"] == ds["num_hidden_layers"] == 2
