"""Where each row's tree goes this step: the PyTorch reference (the contract of `tree_placement_triton.py`).

A decode step verifies an n-node tree per row right after the row's committed
tokens, whose count lives on the device (`DecodeStep.row_base`), so that a step
launched before the previous one is read back still lands right. From it come
the tree tokens' positions (RoPE), their KV slots (through the block table) and
the row's KV length after the step. As PyTorch ops that is about ten small
kernels in every captured step, plain ones included; the Triton kernel is one.

Contract, for batch row i (state row r = rows[i], b = row_base[r]) and node j < n:
    base[i]          = b
    positions[i, j]  = min(b + depths[j], last_position)
    slots[i, j]      = tables[i, (b + j) // block_size] * block_size + (b + j) % block_size,
                       or scratch_slot where r == padding_row
    kv_lens[i]       = b + n
A logical block past the table's width reads its last column (the caller allocates enough).
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton


def row_slots(tables: torch.Tensor, starts: torch.Tensor, count: int, block_size: int) -> torch.Tensor:
    """Physical slots [B, count] long of each row's token slots [starts, starts + count): tables [B, W]
    int32 block tables, starts [B] long. Row i equals BlockManager.slot_mapping for its sequence."""
    positions = starts[:, None] + torch.arange(count, device=starts.device)  # [B, count]
    logical = (positions // block_size).clamp(max=tables.shape[1] - 1)
    return tables.gather(1, logical).long() * block_size + positions % block_size


def place_tree(row_base: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, depths: torch.Tensor,
               block_size: int, padding_row: int, scratch_slot: int, last_position: int,
               slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """row_base [R] long, rows [B] long, tables [B, W] int32, depths [n] long; writes slots [B * n] and
    kv_lens [B] (long, in place: the step's static buffers) -> (base [B], positions [B * n]) long.
    The Triton kernel on a GPU, else the reference."""
    if use_triton(row_base):
        from medusa.kernels.tree_placement_triton import place_tree_triton

        return place_tree_triton(row_base, rows, tables, depths, block_size, padding_row, scratch_slot,
                                 last_position, slots, kv_lens)
    return place_tree_reference(row_base, rows, tables, depths, block_size, padding_row, scratch_slot,
                                last_position, slots, kv_lens)


def place_tree_reference(row_base: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, depths: torch.Tensor,
                         block_size: int, padding_row: int, scratch_slot: int, last_position: int,
                         slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's contract in PyTorch ops (the CPU path); same arguments as `place_tree`."""
    n = depths.shape[0]
    base = row_base[rows]  # [B]
    found = row_slots(tables, base, n, block_size)  # [B, n]
    slots.copy_(found.masked_fill((rows == padding_row)[:, None], scratch_slot).flatten())
    kv_lens.copy_(base + n)
    positions = (base[:, None] + depths[None]).flatten().clamp(max=last_position)
    return base, positions
