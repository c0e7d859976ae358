"""Merge a Medusa-2 LoRA adapter into the base model's weights at load time.

Medusa-2 trains a LoRA on the base together with the heads; the heads only
work with the adapted base. `medusa-train` saves the adapter beside the heads
(`adapter.safetensors` with our module names + `adapter_config.json`), and
loading folds it into the weights once: W += (alpha / r) * B @ A, so decoding
pays nothing for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from medusa.heads import MedusaHeads
from medusa.model import DecoderModel

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter.safetensors", "adapter_config.json"


def has_adapter(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_WEIGHTS).is_file()


@torch.no_grad()
def merge_lora(model: DecoderModel, folder: str | Path) -> int:
    """Fold the adapter in `folder` into `model`; returns how many layers changed."""
    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    scale = config["lora_alpha"] / config["r"]
    state = load_file(str(folder / ADAPTER_WEIGHTS))
    merged = 0
    for key, lora_a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module_name = key.removesuffix(".lora_A.weight")
        lora_b = state.get(f"{module_name}.lora_B.weight")
        if lora_b is None:
            raise ValueError(f"{folder / ADAPTER_WEIGHTS}: {key} has no matching lora_B")
        try:
            weight = model.get_submodule(module_name).weight  # [out, in]
        except AttributeError:
            raise ValueError(f"{folder / ADAPTER_WEIGHTS}: no layer {module_name!r} in the base model") from None
        delta = scale * (lora_b.float() @ lora_a.float())  # [out, r] @ [r, in]
        if delta.shape != weight.shape:
            raise ValueError(f"adapter for {module_name}: shape {tuple(delta.shape)} != weight {tuple(weight.shape)}")
        weight.add_(delta.to(weight.device, weight.dtype))
        merged += 1
    return merged


def heads_for_base(base: DecoderModel, folder: str | Path, dtype: torch.dtype | None = None,
                   device: str | torch.device | None = None) -> tuple[MedusaHeads, bool]:
    """(the heads of `folder`, whether an adapter was merged): Medusa-2 heads first fold their LoRA into `base`,
    since they only work with the adapted base."""
    merged = has_adapter(folder)
    if merged:
        merge_lora(base, folder)
    heads = MedusaHeads.from_pretrained(folder, lm_head_weight=base.lm_head.weight, dtype=dtype, device=device)
    return heads, merged
