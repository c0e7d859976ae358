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


# On a CPU, SDPA spends more in dispatch than in arithmetic when few queries attend (a decode or a tree
# verification step): there `attend` runs an explicit product, softmax and product, each KV head's query heads
# folded into the query length. 2 cores, torch 2.13, float32, the default model's 9/3 heads of 64, a tree mask,
# per call (session 48, `benchmarks/cpu_attention.py`), the previous path (SDPA; its query heads folded past 384
# keys) against explicit: one query at 256 keys 227 -> 124 us, at 2048 872 -> 485; 16 queries at 256 551 -> 407;
# 17 at 1024 1860 -> 1432; 64 at 512 2937 -> 2420 (faster at every shape tried, 1-64 queries over 16-2048 keys;
# SDPA's grouped path without the fold took 1.7-6.5 ms at 512-2048 keys for one query). bfloat16
# stays on SDPA (explicit bf16 products were 1.3-8x slower on this AVX2 CPU), and so do causal calls (prompt
# forwards: SDPA's flash kernel) and more queries.
CPU_EXPLICIT_MAX_QUERIES = 64
_EXPLICIT_DTYPES = (torch.float32, torch.float64)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q [..., T, Hq, D]; k, v [..., S, Hkv, D]; mask broadcastable to [..., Hq, T, S]
    (True = may attend). Returns [..., T, Hq, D].
    """
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if q.device.type == "cpu" and not causal and q.shape[-3] <= CPU_EXPLICIT_MAX_QUERIES \
            and q.dtype in _EXPLICIT_DTYPES:
        return _attend_explicit(q, k, v, mask, scale, heads // kv_heads)
    out = F.scaled_dot_product_attention(
        q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads,
    )
    return out.transpose(-2, -3)


def _attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None, group: int) -> torch.Tensor:
    """`attend` on a CPU as matmul, softmax, matmul: each KV head's `group` query heads folded into the query
    length, q [..., Hkv, G*T, D] against k/v [..., Hkv, S, D]. A query whose mask hides every key gets the
    mean of the values (SDPA: zeros); no caller asks for one, since every query sees at least itself."""
    *lead, t, heads, d = q.shape
    kv_heads = heads // group
    matmul = torch.matmul if lead else torch.bmm  # bmm: a few us less a call, 3-D only
    folded = q.transpose(-2, -3).reshape(*lead, kv_heads, group * t, d)  # head kv*G + g -> rows g*T + t
    scores = matmul(folded, k.transpose(-2, -3).transpose(-1, -2))  # [..., Hkv, G*T, S]
    scores.mul_(scale if scale is not None else d ** -0.5)
    if mask is not None:  # a finite fill: a row that sees nothing stays finite
        scores.view(*scores.shape[:-2], group, t, -1).masked_fill_(~_split_heads(mask, kv_heads, group),
                                                                    torch.finfo(scores.dtype).min)
    out = matmul(scores.softmax(-1), v.transpose(-2, -3))  # [..., Hkv, G*T, D]
    return out.reshape(*lead, heads, t, d).transpose(-2, -3)


def _split_heads(mask: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """A mask broadcastable to [..., Hq, T, S] -> one broadcastable to [..., Hkv, G, T, S] (no copy)."""
    if mask.dim() >= 3 and mask.shape[-3] == kv_heads * group:
        return mask.view(*mask.shape[:-3], kv_heads, group, *mask.shape[-2:])
    return mask.unsqueeze(-3)


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
