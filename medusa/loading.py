"""Load a base model from a Hugging Face checkpoint folder or a GGUF file.

Weights stream in one tensor at a time (`DecoderModel.load_weights`), so a
sharded checkpoint never needs two copies in memory and quantised formats can
later be loaded without dequantising.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from medusa.config import ModelConfig
from medusa.model import DecoderModel


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A device name or torch.device (None: a GPU if torch sees one, else the CPU); ValueError naming the
    device where torch cannot parse it or has no such device here."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA GPU(s) here")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU (exact, and bf16 matmuls are slow there), bfloat16 on a GPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_base_model(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> DecoderModel:
    """A checkpoint folder (config.json + safetensors) or a .gguf file -> DecoderModel in eval mode."""
    path = Path(path)
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if path.suffix == ".gguf":
        from medusa.gguf_loader import iter_gguf_tensors, read_gguf_config

        if not path.is_file():
            raise FileNotFoundError(f"no such .gguf file: {path}")

        hf_config = read_gguf_config(path)
        tensors = iter_gguf_tensors(path, hf_config)
    elif path.is_dir():
        hf_config = _read_json(path / "config.json")
        tensors = iter_safetensors(path)
    else:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")
    config = ModelConfig.from_hf_dict(hf_config)
    model = empty_model(config, dtype, device)
    model.load_weights(tensors)
    return model.eval().requires_grad_(False)


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """Allocate without random init (meta device), then recompute the RoPE tables."""
    with torch.device("meta"), _default_dtype(dtype):
        model = DecoderModel(config)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.reset()
    return model


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from model.safetensors or the shards its index lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    return json.loads(path.read_text())


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
