"""A contiguous KV cache for one sequence: the batch-1 reference path.

Tree tokens are written after the committed prefix; after verification the
accepted nodes' k/v are moved down into consecutive slots and the rest is
simply overwritten by the next step. The paged engine replaces this with block
tables but keeps the same begin -> forward -> commit life cycle.
"""

from __future__ import annotations

import torch

from medusa.attention import attend, sliding_window_mask
from medusa.config import ModelConfig


class ContiguousKVCache:
    """KV for one sequence, token-major: k, v [num_layers, max_len, Hkv, D]."""

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.sliding_window = config.sliding_window
        self.length = 0  # committed tokens
        self._step_len = 0
        self._mask: torch.Tensor | None = None  # [T, length + T]

    def begin(self, positions: torch.Tensor, step_mask: torch.Tensor) -> None:
        """Prepare a forward of T tokens written after the committed prefix.

        positions [T]; step_mask [T, T] bool: which of this step's tokens each
        one sees (causal for a prompt chunk, ancestors for a tree). Every token
        also sees the whole committed prefix.
        """
        num_tokens = positions.shape[0]
        if self.length + num_tokens > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} tokens is full ({self.length} used, {num_tokens} more asked)")
        prefix = torch.ones(num_tokens, self.length, dtype=torch.bool, device=step_mask.device)
        mask = torch.cat([prefix, step_mask], dim=1)  # [T, length + T]
        if self.sliding_window is not None:
            k_positions = torch.cat([torch.arange(self.length, device=positions.device), positions])
            mask &= sliding_window_mask(positions, k_positions, self.sliding_window)
        self._step_len, self._mask = num_tokens, mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], attending to prefix + visible step tokens."""
        end = self.length + self._step_len
        self.k[layer, self.length:end] = k
        self.v[layer, self.length:end] = v
        return attend(q, self.k[layer, :end], self.v[layer, :end], mask=self._mask)

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the step tokens at indices `accepted` [n] (ascending), moved to consecutive slots."""
        n = accepted.shape[0]
        src = self.length + accepted
        dst = slice(self.length, self.length + n)
        # index_select copies first, so overlapping source and destination are safe
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.length += n
        self._step_len, self._mask = 0, None
