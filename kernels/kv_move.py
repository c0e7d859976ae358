"""The accepted tree tokens' KV moves: the PyTorch reference (the contract of `kv_move_triton.py`).

After a decode step's verdict, each row's accepted path moves down to the step's
first slots (`tree_accept.accept`, `batch_verify.compaction_slots`). As PyTorch ops
that is four index kernels in every decode step (~15 us on an H200); the Triton
kernel is one launch.

Contract: k, v [L, S, Hkv, D] (contiguous, one dtype) and src, dst [B * M] int64 slots,
row b's moves being its M = `moves_per_row` consecutive entries; in place, for every
layer l and move i:
    k[l, dst[i]] = old k[l, src[i]], v[l, dst[i]] = old v[l, src[i]]
"old": every move reads before any move writes ("gathering first"), so a dst may be
another move's src. The reference gathers all moves first; the kernel gathers each row
first, which is the same as long as no row reads a slot that another row writes. The
decode step's moves keep that: rows' slots are disjoint, except padding rows, whose
moves all copy one shared scratch slot onto itself. `moves_per_row=None` makes all
moves one row (any overlap is then safe).
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton

# Moves per row up to which the kernel holds a row's source rows in registers; past it the reference serves.
MAX_MOVES_PER_ROW = 1024


def move_kv(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
            moves_per_row: int | None = None) -> None:
    """KV rows src -> dst [B * M] in every layer of k, v [L, S, Hkv, D], in place; M = moves_per_row
    (None: all moves are one row). The Triton kernel on a GPU, else the reference."""
    moves_per_row = check_moves(k, v, src, dst, moves_per_row)
    if src.numel() == 0:
        return
    if use_triton(k) and moves_per_row <= MAX_MOVES_PER_ROW:
        from medusa.kernels.kv_move_triton import move_kv_triton

        return move_kv_triton(k, v, src, dst, moves_per_row)
    return move_kv_reference(k, v, src, dst, moves_per_row)


def move_kv_reference(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                      moves_per_row: int | None = None) -> None:
    """The module's contract in PyTorch ops (the CPU path): gathers every move before writing any,
    so it holds for any overlap, whatever `moves_per_row`."""
    k[:, dst] = k[:, src]
    v[:, dst] = v[:, src]


def check_moves(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                moves_per_row: int | None) -> int:
    """Raises ValueError naming what does not fit the contract; -> moves per row (None: the length)."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"move_kv: k and v must be [L, S, Hkv, D] of one shape, dtype and device, got "
                         f"{tuple(k.shape)} {k.dtype} on {k.device} and {tuple(v.shape)} {v.dtype} on {v.device}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"move_kv: k and v must be contiguous, got strides {k.stride()} and {v.stride()}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.dtype != torch.long or t.device != k.device:
            raise ValueError(f"move_kv: {name} must be 1-D torch.int64 on {k.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    n = src.shape[0]
    if dst.shape[0] != n:
        raise ValueError(f"move_kv: src and dst must have one length, got {n} and {dst.shape[0]}")
    if moves_per_row is None:
        return max(n, 1)
    if moves_per_row < 1 or n % moves_per_row:
        raise ValueError(f"move_kv: {n} moves are not rows of moves_per_row={moves_per_row}")
    return moves_per_row
