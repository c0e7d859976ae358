"""Tree placement in one Triton launch: one program per batch row.

Same contract as `place_tree_reference` in `tree_placement.py`: from the row's
committed length on the device, its tree tokens' positions and KV slots and
its KV length after the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _place_tree_kernel(row_base_ptr, rows_ptr, tables_ptr, depths_ptr, slots_ptr, kv_lens_ptr, base_ptr, pos_ptr,
                       n, width, stride_t, block_size, padding_row, scratch_slot, last_position,
                       NODES: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i)
    b = tl.load(row_base_ptr + row)
    tl.store(base_ptr + i, b)
    tl.store(kv_lens_ptr + i, b + n)
    j = tl.arange(0, NODES).to(tl.int64)
    node = j < n
    at = b + j  # the step's token slots, node j at the row's (b + j)-th slot
    logical = tl.minimum(at // block_size, width - 1)
    block = tl.load(tables_ptr + i * stride_t + logical, mask=node, other=0).to(tl.int64)
    slot = block * block_size + at % block_size
    slot = tl.where(row == padding_row, scratch_slot, slot)
    tl.store(slots_ptr + i * n + j, slot, mask=node)
    depth = tl.load(depths_ptr + j, mask=node, other=0)
    tl.store(pos_ptr + i * n + j, tl.minimum(b + depth, last_position), mask=node)


def place_tree_triton(row_base: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, depths: torch.Tensor,
                      block_size: int, padding_row: int, scratch_slot: int, last_position: int,
                      slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `place_tree` in tree_placement.py; checks shapes, dtypes and devices, then one launch."""
    b, n = rows.shape[0], depths.shape[0]
    device = row_base.device
    expected = {"row_base": (row_base, torch.long, row_base.dim() == 1),
                "rows": (rows, torch.long, rows.dim() == 1),
                "tables": (tables, torch.int32, tables.dim() == 2 and tables.shape[0] == b and tables.stride(1) == 1),
                "depths": (depths, torch.long, depths.dim() == 1 and n >= 1),
                "slots": (slots, torch.long, slots.shape == (b * n,) and slots.is_contiguous()),
                "kv_lens": (kv_lens, torch.long, kv_lens.shape == (b,) and kv_lens.is_contiguous())}
    for name, (tensor, dtype, shape_ok) in expected.items():
        if tensor.dtype != dtype or tensor.device != device or not shape_ok:
            raise ValueError(f"place_tree: {name} must be {dtype} on {device} for {b} rows of {n} nodes "
                             f"(tables [{b}, W] with contiguous rows, slots [{b * n}], kv_lens [{b}]), got "
                             f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
    base = torch.empty(b, dtype=torch.long, device=device)
    positions = torch.empty(b * n, dtype=torch.long, device=device)
    if b:
        _place_tree_kernel[(b,)](row_base.contiguous(), rows.contiguous(), tables, depths.contiguous(), slots,
                                 kv_lens, base, positions, n, tables.shape[1], tables.stride(0), block_size,
                                 padding_row, scratch_slot, last_position, NODES=triton.next_power_of_2(n))
    return base, positions
