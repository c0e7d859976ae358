"""The attention interface between the model and whoever owns the KV cache.

The model computes q, k, v and RoPE; an `AttentionBackend` stores k/v where its
cache wants them and attends. That keeps the model free of cache layouts: the
stateless causal backend below serves tests and training, the batch-1 cache in
`medusa.decoding.kv_cache` serves tree decoding, and the paged engine plugs in
the same way.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [..., T, Hq, D], k/v [..., T, Hkv, D] for this step's tokens -> [..., T, Hq, D]."""
        ...


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [..., T, Hq, D]; k, v [..., S, Hkv, D]; mask broadcastable to [..., Hq, T, S]
    (True = may attend). Returns [..., T, Hq, D].
    """
    out = F.scaled_dot_product_attention(
        q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3),
        attn_mask=mask, is_causal=causal, enable_gqa=q.shape[-2] != k.shape[-2],
    )
    return out.transpose(-2, -3)


def sliding_window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., T, S] True where the key lies inside the query's window (Mistral)."""
    return (q_positions.unsqueeze(-1) - k_positions.unsqueeze(-2)) < window


class CausalAttention:
    """Stateless backend: every call sees the whole sequence, causally masked.

    Used to check logits against transformers and to train heads, where no cache
    is needed. `positions` is only needed with a sliding window.
    """

    def __init__(self, sliding_window: int | None = None, positions: torch.Tensor | None = None) -> None:
        self.sliding_window = sliding_window
        self.positions = positions

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sliding_window is None or self.positions is None:
            return attend(q, k, v, causal=True)
        pos = self.positions
        mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)) & sliding_window_mask(pos, pos, self.sliding_window)
        return attend(q, k, v, mask=mask.unsqueeze(-3))
