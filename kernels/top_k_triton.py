"""Top-k of wide rows in two Triton launches (`top_k.py` has the contract).

Each entry becomes one int64 key: its value's bits, made to order as the floats
do, above its column, inverted, so that the largest key is the largest value
at the lowest column, and keys are unique. Then a selection is k rounds of one
max reduction each, the winner leaving play:
1. Grid (rows, chunks of CHUNK columns): each chunk's k best keys -> [rows, chunks, k].
2. Grid (rows,): the k best among a row's chunks x k keys -> their columns.
A row's k best are among its chunks' k best, so the result is exact. One warp
per program: every reduction stays within a warp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024


@triton.jit
def _keys(values, columns):
    """float32 values, int32 columns -> int64 keys ordered as (value, -column)."""
    bits = (values + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0, equal as floats are
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller int
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - columns).to(tl.int64)


@triton.jit
def _select(keys, out_ptr, K: tl.constexpr, STORE_COLUMNS: tl.constexpr):
    """K rounds: the largest key is stored (or its column), then leaves play."""
    for i in tl.static_range(K):
        best = tl.max(keys, 0)
        if STORE_COLUMNS:
            tl.store(out_ptr + i, (0x7FFFFFFF - (best & 0x7FFFFFFF)).to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + i, best)
        keys = tl.where(keys == best, -9223372036854775808, keys)  # int64 min: below every real key


@triton.jit
def _chunk_top_k_kernel(x_ptr, keys_ptr, V, stride_x, num_chunks, K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] int32
    real = columns < V
    values = tl.load(x_ptr + row * stride_x + columns, mask=real, other=0.0).to(tl.float32)
    keys = tl.where(real, _keys(values, columns), -9223372036854775808)
    _select(keys, keys_ptr + (row * num_chunks + chunk) * K, K, False)


@triton.jit
def _merge_top_k_kernel(keys_ptr, out_ptr, count, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    at = tl.arange(0, BLOCK)  # the row's chunks x K candidate keys
    keys = tl.load(keys_ptr + row * count + at, mask=at < count, other=-9223372036854775808)
    _select(keys, out_ptr + row * K, K, True)


def top_k_triton(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., V] (float16/bfloat16/float32) -> [..., k] long."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"top_k: x must be float16, bfloat16 or float32, got {x.dtype}")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    chunks = triton.cdiv(width, CHUNK)
    keys = torch.empty(rows.shape[0], chunks, k, dtype=torch.int64, device=x.device)
    _chunk_top_k_kernel[(rows.shape[0], chunks)](rows, keys, width, rows.stride(0), chunks, K=k, CHUNK=CHUNK,
                                                  num_warps=1)
    out = torch.empty(rows.shape[0], k, dtype=torch.long, device=x.device)
    block = triton.next_power_of_2(chunks * k)
    _merge_top_k_kernel[(rows.shape[0],)](keys, out, chunks * k, K=k, BLOCK=block, num_warps=1 if block <= 1024 else 4)
    return out.view(*x.shape[:-1], k)
