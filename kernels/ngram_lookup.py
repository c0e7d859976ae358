"""Prompt lookup on the device: the PyTorch reference (the contract of `ngram_lookup_triton.py`).

The host's `NgramIndex` (decoding/prompt_lookup.py) needs every sequence's
tokens on the host before a step can be launched. Kept on the device, as one
history row per decode state row, the same proposals come from one kernel
inside the captured step, so a step with lookup nodes no longer waits for the
previous step's tokens (the groundwork for overlapping speculative steps).

Contract, row by row, equal to `NgramIndex(history[r, :lengths[r]]).propose(length)`:
for n in sizes, longest first, the latest position p in [n, len) whose n tokens
before it equal the last n tokens; the proposal is history[p + (j mod (len - p))]
for j < length (copied on, periodically past the end). Without any match, the last
token repeated (0 for an empty row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medusa.decoding.prompt_lookup import NGRAM_SIZES
from medusa.kernels.dispatch import use_triton


def ngram_lookup(history: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """Proposals [B, length] for history rows `rows` [B]: the Triton kernel on a GPU (it reads the rows in
    place), else the reference on a copy of them."""
    if use_triton(history):
        from medusa.kernels.ngram_lookup_triton import ngram_lookup_triton

        return ngram_lookup_triton(history, lengths, length, rows=rows)
    return ngram_lookup_reference(history[rows], lengths[rows], length)


def ngram_lookup_reference(history: torch.Tensor, lengths: torch.Tensor, length: int,
                           sizes: tuple[int, ...] = NGRAM_SIZES) -> torch.Tensor:
    """history [R, L] long (row r's tokens in [:lengths[r]]), lengths [R] long -> proposals [R, length] long.

    Fixed shapes and no host synchronisation, so it can run inside a CUDA graph.
    """
    rows, width = history.shape
    positions = torch.arange(width, device=history.device)  # candidate follower positions p
    lengths_col = lengths[:, None]  # [R, 1]
    best = torch.full((rows,), -1, dtype=torch.long, device=history.device)
    for n in sorted(set(sizes), reverse=True):
        padded = F.pad(history, (n, 0))  # [R, n + L]: padded[:, p + k] = history[:, p - n + k]
        suffix_at = (lengths_col - n + torch.arange(n, device=history.device)).clamp(min=0)  # [R, n]
        suffix = history.gather(1, suffix_at)  # [R, n] the last n tokens
        match = (positions >= n) & (positions < lengths_col) & (lengths_col > n)  # [R, L]
        for k in range(n):
            match &= padded[:, k:k + width] == suffix[:, k:k + 1]
        latest = torch.where(match, positions, -1).amax(1)  # [R] -1: no occurrence of this n-gram
        best = torch.where(best < 0, latest, best)
    found = best >= 0
    start = torch.where(found, best, 0)[:, None]  # [R, 1]
    period = torch.where(found, lengths - best, 1)[:, None]
    steps = torch.arange(length, device=history.device)[None]  # [1, length]
    copied = history.gather(1, (start + steps % period).clamp(max=width - 1))  # [R, length]
    last = history.gather(1, (lengths_col - 1).clamp(min=0))  # [R, 1]
    last = torch.where(lengths_col > 0, last, 0)
    return torch.where(found[:, None], copied, last.expand(-1, length))
