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


# On a CPU, SDPA's grouped-query path (`enable_gqa`) with a mask is erratic and often slow where few queries meet
# many keys; with each KV head's query heads folded into the query length it is steady. 2 cores, torch 2.13, the
# default model's 9/3 heads of 64, per call, folded against SDPA's grouped path: one query at 512 keys 192-202 us
# against 435-2090; 16 at 512 545-603 against 657-2775; 16 at 2048 1.4-1.7 against 3.5-8.3 ms; 48 at 2048 4.4
# against 4.7 ms. But 64 queries lost (2.6 against 2.0 ms at 512 keys) and so did short contexts (16 at 128 keys
# 279 against 243 us). Eagerly, a decode step of the engine at 2048 cached tokens took 146 -> 95 ms, the batch-1
# decoder's 16-node tree 235 -> 152 ms. A causal call keeps SDPA's path (its flash kernel).
CPU_FOLD_MAX_QUERIES = 48
CPU_FOLD_MIN_KEYS = 384


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [..., T, Hq, D]; k, v [..., S, Hkv, D]; mask broadcastable to [..., Hq, T, S]
    (True = may attend). Returns [..., T, Hq, D].
    """
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads != kv_heads and q.device.type == "cpu" and not causal and q.shape[-3] <= CPU_FOLD_MAX_QUERIES \
            and k.shape[-3] >= CPU_FOLD_MIN_KEYS:
        return _attend_folded(q, k, v, mask, scale, heads // kv_heads)
    out = F.scaled_dot_product_attention(
        q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads,
    )
    return out.transpose(-2, -3)


def _attend_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None, group: int) -> torch.Tensor:
    """`attend` on a CPU: each KV head's `group` query heads folded into the query length, q [..., Hkv, G*T, D]
    against k/v [..., Hkv, S, D]."""
    *lead, t, heads, d = q.shape
    folded = q.transpose(-2, -3).reshape(*lead, heads // group, group * t, d)  # head kv*G + g -> rows g*T + t
    if mask is not None:
        mask = _fold_mask(mask, heads, group)
    out = F.scaled_dot_product_attention(folded, k.transpose(-2, -3), v.transpose(-2, -3), attn_mask=mask,
                                         scale=scale)
    return out.reshape(*lead, heads, t, d).transpose(-2, -3)


def _fold_mask(mask: torch.Tensor, heads: int, group: int) -> torch.Tensor:
    """A mask broadcastable to [..., Hq, T, S] -> one for the folded queries [..., Hkv, G*T, S]: a mask per
    query head is regrouped, one shared by the heads is repeated G times along the queries."""
    t, s = mask.shape[-2:]
    if mask.dim() >= 3 and mask.shape[-3] == heads:
        return mask.reshape(*mask.shape[:-3], heads // group, group * t, s)
    return mask.repeat(*([1] * (mask.dim() - 2)), group, 1)


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
