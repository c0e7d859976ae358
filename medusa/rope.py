"""Rotary position embeddings (non-interleaved halves, as HF checkpoints expect).

Positions are explicit per token, so tree nodes get `prefix_len + depth` and
siblings share a position: nothing here assumes positions are consecutive.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from medusa.config import RopeConfig
from medusa.kernels.dispatch import use_triton
from medusa.kernels.fused_ops import rotary_reference


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep short wavelengths, divide long ones by `factor`, blend in between."""
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset()

    def _apply(self, fn, recurse: bool = True):
        # model.to(bf16) would round the tables too; keep them float32 (the kernels require it)
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32 and self.cos.device.type != "meta":
            self.reset()
        return self

    def reset(self) -> None:
        """(Re)compute the tables in float32 on the module's device, e.g. after to_empty()."""
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv_freq = inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, num_heads, D]; k [T, num_kv_heads, D] -> rotated (q, k)."""
        # No bounds check here: it would sync the host every step; callers
        # validate prompt + max_new_tokens against the context up front.
        if use_triton(q):
            from medusa.kernels.fused_ops_triton import rotary_triton

            return rotary_triton(positions, q, k, self.cos, self.sin)
        return rotary_reference(positions, q, k, self.cos, self.sin)
