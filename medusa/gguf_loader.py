"""Read llama.cpp GGUF checkpoints into the library's canonical Hugging Face Llama layout.

- `read_gguf_config(path)`: an HF-style `config.json` dict from the GGUF metadata.
- `iter_gguf_tensors(path, config)`: HF-named float32 tensors, one at a time (peak memory
  is one tensor; a quantised loader can later hook in here).
- `convert_gguf_to_hf(gguf_path, out_dir)`: a complete HF folder (config, safetensors,
  tokenizer), published atomically and stamped with `medusa_source.json`.

Architectures: `llama` (also Mistral and SmolLM2 files, which llama.cpp writes as
`llama`) and `qwen2`. The subtle step: llama.cpp's converter permutes the rows of every
`llama` q/k projection (weights and biases) from HF's rotary layout (per head: first half
of the dims, then the second half) to interleaved pairs; we undo it. `qwen2` uses
llama.cpp's NeoX rope, which is HF's layout, so its rows are stored unpermuted.

`gguf` is imported lazily: a host with a prepared cache never needs the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SOURCE_RECORD = "medusa_source.json"
# Bump when the converted output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 1

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed by read_gguf_config (llama3 rope scaling), not a model parameter.
_METADATA_TENSORS = {"rope_freqs.weight"}


def _reader(path: str | os.PathLike):
    from gguf import GGUFReader

    return GGUFReader(path, "r")


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06; keep the short decimal.
    return float(str(np.float32(value)))


def read_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """HF-style config dict (the keys of a Llama/Qwen2 `config.json`) from GGUF metadata."""
    return _config_from_reader(_reader(path))


def _config_from_reader(reader) -> dict[str, Any]:
    # Opening a reader parses all metadata (about 3 s for a 49k-token vocab): share it.
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length") or meta("rope.dimension_count") or hidden // heads)
    rope_theta = _f32(meta("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch, tensors, head_dim, rope_theta),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": _vocab_size(reader, arch, tensors),
        "tie_word_embeddings": "output.weight" not in tensors,
        # Qwen2 always has q/k/v biases; Llama has them only in some fine-tunes.
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def _vocab_size(reader, arch: str, tensors: dict) -> int:
    size = _field(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    if "token_embd.weight" in tensors:  # GGUF shape is [hidden, vocab], innermost first
        return int(tensors["token_embd.weight"].shape[1])
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _rope_scaling(reader, arch: str, tensors: dict, head_dim: int, theta: float) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` keys, or llama3 from a `rope_freqs` tensor."""
    def meta(key: str) -> Any:
        return _field(reader, f"{arch}.rope.{key}")

    kind, factor = meta("scaling.type"), meta("scaling.factor")
    if kind is None and meta("scale_linear"):  # pre-2024 files spell linear scaling this way
        kind, factor = "linear", meta("scale_linear")
    if kind in (None, "none"):
        if "rope_freqs.weight" not in tensors:
            return None
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)  # [head_dim/2]
        return _llama3_scaling(factors, head_dim, theta)
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    optional = {"scaling.original_context_length": "original_max_position_embeddings",
                "scaling.yarn_beta_fast": "beta_fast", "scaling.yarn_beta_slow": "beta_slow"}
    for key, hf_key in optional.items():
        if meta(key) is not None:
            scaling[hf_key] = int(meta(key)) if hf_key.startswith("original") else _f32(meta(key))
    return scaling


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in `rope_freqs` for llama3 scaling. [head_dim/2]"""
    # smooth <= 0 (long wavelengths) gives `factor`, smooth >= 1 (short ones) gives 1.
    smooth = np.clip((original * inv_freq / (2 * math.pi) - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _llama3_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover HF llama3 rope parameters from llama.cpp's precomputed `rope_freqs` divisors.

    llama.cpp writes no llama3 metadata keys, only this tensor. The formula depends on
    (original, low, high) only through their ratios, so low = 1 loses nothing; two points
    on the ramp (1 < divisor < factor) then give original and high by least squares.
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim/2]
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    low, high, original = 1.0, 4.0, 8192.0  # Llama 3.x values: used when the ramp is too short to fit
    ramp = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if ramp.sum() >= 2:
        # smooth = (original * x - 1) / (high - 1), x = 1 / wavelength; linear in (original, high - 1).
        smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
        lhs = np.stack([inv_freq[ramp] / (2 * math.pi), -smooth], axis=1)
        (original, high_minus_1), *_ = np.linalg.lstsq(lhs, np.ones(int(ramp.sum())), rcond=None)
        original, high = float(round(original)), round(float(high_minus_1) + 1, 4)
    if not np.allclose(_llama3_factors(inv_freq, factor, low, high, original), factors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; cannot convert")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(original)}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _dequantize(tensor) -> torch.Tensor:
    """Any GGML type -> float32 tensor in HF orientation ([out, in] for linear weights)."""
    from gguf.quants import dequantize

    # GGUF lists dims innermost first ([in, out]); reversed it is torch's row-major [out, in].
    shape = tuple(int(n) for n in reversed(tensor.shape))
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only memory map
        array = array.copy()
    return torch.from_numpy(array)


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. weight: [num_heads * head_dim, ...] or bias.

    llama.cpp reorders each head's rows from (first half, second half) to interleaved
    pairs: viewed as [heads, 2, head_dim/2] it swaps the last two axes. Swapping back
    the view [heads, head_dim/2, 2] restores HF's layout.
    """
    rest = weight.shape[1:]
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: str | os.PathLike, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every parameter in the GGUF, one at a time."""
    return _tensors_from_reader(_reader(path), config)


def _tensors_from_reader(reader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = config["model_type"] == "llama"  # qwen2 (NeoX rope) is stored in HF order
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name in _METADATA_TENSORS:
            continue
        name = _hf_name(tensor.name)
        weight = _dequantize(tensor)
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            weight = _unpermute_rotary_rows(weight, heads[proj])
        yield name, weight


def source_record(gguf_path: str | os.PathLike) -> dict[str, Any]:
    """What identifies a GGUF cheaply: name, size, and a hash of its first and last MiB."""
    path = Path(gguf_path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        digest.update(f.read(1 << 20))
    return {"gguf_file": path.name, "size": size, "sha256_head_tail": digest.hexdigest(),
            "converter_version": CONVERTER_VERSION}


def is_converted(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> bool:
    """True when out_dir is a finished conversion of this very GGUF by this converter."""
    record = Path(out_dir) / SOURCE_RECORD
    try:
        return json.loads(record.read_text()) == source_record(gguf_path)
    except (OSError, ValueError):
        return False


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write an HF folder (config.json, model.safetensors, tokenizer) for a GGUF checkpoint.

    Built in a temporary sibling folder and renamed into place, so out_dir is either
    absent, the old conversion, or complete. An existing up-to-date conversion (say, a
    concurrent process finished first) is kept as is.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        reader = _reader(gguf_path)
        config = _config_from_reader(reader)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_weights(reader, config, tmp / "model.safetensors")
        del reader  # release the memory map before the tokenizer maps the file again
        _write_tokenizer(gguf_path, config, tmp)
        # Written last: its presence marks a complete folder.
        (tmp / SOURCE_RECORD).write_text(json.dumps(source_record(gguf_path), indent=2) + "\n")
        _make_shareable(tmp)
        _publish(tmp, out_dir, gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_weights(reader, config: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = dict(_tensors_from_reader(reader, config))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(gguf_path: Path, config: dict[str, Any], out_dir: Path) -> None:
    # transformers rebuilds a fast tokenizer (and the chat template) from GGUF metadata.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(str(out_dir))


def _make_shareable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only modes; a shared cache must be readable.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _publish(tmp: Path, out_dir: Path, gguf_path: Path) -> None:
    """Atomically move tmp to out_dir, replacing only an empty folder or a stale conversion."""
    error: OSError | None = None
    for _ in range(5):
        try:
            os.replace(tmp, out_dir)  # atomic; fails when out_dir exists and is not empty
            return
        except OSError as err:
            error = err
            if not out_dir.exists():  # moved away by a concurrent process meanwhile: retry
                continue
        if is_converted(gguf_path, out_dir):
            return  # an identical conversion won the race: keep it, readers may be using it
        if not (out_dir / SOURCE_RECORD).exists():
            raise FileExistsError(f"{out_dir} exists and is not a medusa GGUF conversion")
        # Stale: rename it away first so nobody sees a half-deleted folder.
        trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex}")
        try:
            os.replace(out_dir, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise RuntimeError(f"could not publish the conversion to {out_dir}") from error
