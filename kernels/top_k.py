"""The k largest entries of wide rows (a vocabulary's logits): the contract of `top_k_triton.py`.

A Medusa step reduces over the vocabulary twice: the targets (argmax) of every
tree node's logits, and the heads' top tokens for the next tree. On an H200 torch
runs the first as one reduction kernel of 12 us for 12 rows of 49,152 logits, the
second as a multi-block radix select of ~10 kernels, 36 us for the heads' 4 rows
(top 10); together a twentieth of a batch-1 tree step. The Triton version is two
launches, each chunk of a row giving its k best, then each row its k best among
those: 3.2 and 9.2 us for the same inputs (RESULTS.md, session 17).

Contract: x [..., V] float (finite or -inf) -> indices [..., k] long of the k
largest entries, largest first; equal values by lowest index first (a stable
descending sort), so k = 1 is exactly `x.argmax(-1)`.
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton

MAX_K = 32  # each selection round is two block reductions: larger k take torch.topk


def top_k_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """The contract on any device (a full stable sort: for tests, not speed)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., V] -> [..., k] indices: the Triton kernels on a GPU (k <= MAX_K); elsewhere torch's argmax
    (k = 1, the same result) or topk (the same set; the order of exact ties unspecified)."""
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"top_k_indices: k must be in 1..{x.shape[-1]} for rows of {x.shape[-1]}, got {k}")
    if use_triton(x) and x.numel() and k <= MAX_K:
        from medusa.kernels.top_k_triton import top_k_triton

        return top_k_triton(x, k)
    return x.argmax(-1, keepdim=True) if k == 1 else x.topk(k, dim=-1).indices
