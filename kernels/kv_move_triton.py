"""The accepted tree tokens' KV moves in one Triton launch (`kv_move.py` has the contract).

Grid (rows, layers * 2 for k and v, chunks of the Hkv * D features): a program loads all
M source rows of its row for its layer, tensor and feature chunk ([BLOCK_M, BLOCK_F], in
registers), waits at a barrier for every thread of the program to have loaded, and
stores them to the M destination rows. So each row gathers before it writes, whichever
thread holds which element; different programs touch disjoint memory (another layer,
tensor or chunk, or another row's slots), or only copy the scratch slot onto itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.kernels.kv_move import check_moves

# Elements of one program's tile: BLOCK_F shrinks as rows grow, to keep the tile in registers.
TILE = 8192


@triton.jit
def _move_kv_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, M, F, stride_l, stride_s,
                    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1)
    chunk = tl.program_id(2).to(tl.int64)
    j = tl.arange(0, BLOCK_M)
    move = j < M
    src = tl.load(src_ptr + row * M + j, mask=move, other=0)  # int64 slots: slot * stride_s may pass 2^31
    dst = tl.load(dst_ptr + row * M + j, mask=move, other=0)
    f = chunk * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = move[:, None] & (f < F)[None, :]
    base = (layer_kv // 2).to(tl.int64) * stride_l + f[None, :]
    if layer_kv % 2 == 0:
        ptr = k_ptr
    else:
        ptr = v_ptr
    rows = tl.load(ptr + base + src[:, None] * stride_s, mask=mask)
    tl.debug_barrier()  # every thread's loads before any thread's stores: a dst may be another move's src
    tl.store(ptr + base + dst[:, None] * stride_s, rows, mask=mask)


def move_kv_triton(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   moves_per_row: int | None = None) -> None:
    """See `move_kv` in kv_move.py; checks shapes, dtypes, strides and devices, then one launch."""
    m = check_moves(k, v, src, dst, moves_per_row)
    n = src.shape[0]
    if n == 0:
        return
    layers, slots, heads, dim = k.shape
    features = heads * dim
    block_m = triton.next_power_of_2(m)
    block_f = min(triton.next_power_of_2(features), max(TILE // block_m, 1))
    grid = (n // m, 2 * layers, triton.cdiv(features, block_f))
    _move_kv_kernel[grid](k, v, src.contiguous(), dst.contiguous(), m, features, k.stride(0), k.stride(1),
                          BLOCK_M=block_m, BLOCK_F=block_f)
