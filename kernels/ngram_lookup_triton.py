"""Prompt lookup on the device in one Triton launch: one program per history row.

Same contract as `ngram_lookup_reference` in `ngram_lookup.py`, for the library's
n-gram sizes (3, 2, 1). A program scans its row once, BLOCK positions at a time,
keeping for each n the latest position whose n tokens before it equal the row's
last n tokens, then writes the proposal: the tokens from the longest match on
(periodically past the end), or the last token repeated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.decoding.prompt_lookup import NGRAM_SIZES

SIZES = (3, 2, 1)  # what the kernel implements
SCAN_BLOCK = 256


@triton.jit
def _ngram_lookup_kernel(hist_ptr, len_ptr, rows_ptr, out_ptr, stride_h, length,
                         BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i)
    base = hist_ptr + row * stride_h
    n_tok = tl.load(len_ptr + row)
    last1 = tl.load(base + n_tok - 1, mask=n_tok >= 1, other=0)
    last2 = tl.load(base + n_tok - 2, mask=n_tok >= 2, other=0)
    last3 = tl.load(base + n_tok - 3, mask=n_tok >= 3, other=0)
    best1 = tl.full([BLOCK], -1, tl.int64)  # per lane: the latest matching follower position seen
    best2 = tl.full([BLOCK], -1, tl.int64)
    best3 = tl.full([BLOCK], -1, tl.int64)
    scan_end = n_tok.to(tl.int32)  # loop bounds of one type (the start is an int32 constant)
    for start in range(0, scan_end, BLOCK):  # the row's own tokens only, however wide the buffer
        p = start + tl.arange(0, BLOCK).to(tl.int64)  # follower positions
        # p in [n, len) for size n (which also means len > n): p's n tokens before it exist
        in_row = p < n_tok
        m1 = in_row & (p >= 1)
        m1 = m1 & (tl.load(base + p - 1, mask=m1, other=0) == last1)
        m2 = m1 & (p >= 2)
        m2 = m2 & (tl.load(base + p - 2, mask=m2, other=0) == last2)
        m3 = m2 & (p >= 3)
        m3 = m3 & (tl.load(base + p - 3, mask=m3, other=0) == last3)
        best1 = tl.maximum(best1, tl.where(m1, p, -1))
        best2 = tl.maximum(best2, tl.where(m2, p, -1))
        best3 = tl.maximum(best3, tl.where(m3, p, -1))
    b1 = tl.max(best1, 0)
    b2 = tl.max(best2, 0)
    b3 = tl.max(best3, 0)
    j = tl.arange(0, OUT_BLOCK).to(tl.int64)
    want = j < length
    best = tl.where(b3 >= 0, b3, tl.where(b2 >= 0, b2, b1)) + j * 0  # per output lane, so masks stay vectors
    found = best >= 0
    start_at = tl.where(found, best, 0)
    period = tl.where(found, n_tok - best, 1)
    copied = tl.load(base + start_at + j % period, mask=want & found, other=0)
    # last1 is 0 for an empty row (its masked load)
    tl.store(out_ptr + i * length + j, tl.where(found, copied, last1), mask=want)


def ngram_lookup_triton(history: torch.Tensor, lengths: torch.Tensor, length: int,
                        sizes: tuple[int, ...] = NGRAM_SIZES, rows: torch.Tensor | None = None) -> torch.Tensor:
    """history [R, L] long (row r's tokens in [:lengths[r]], lengths <= L), lengths [R] long
    -> proposals [B, length] long for history rows `rows` [B] (default: all R, in order)."""
    if tuple(sorted(set(sizes), reverse=True)) != SIZES:
        raise ValueError(f"ngram_lookup_triton implements n-gram sizes {SIZES}, got {tuple(sizes)}")
    if history.dim() != 2 or history.dtype != torch.long or history.stride(1) != 1:
        raise ValueError(f"ngram_lookup: history must be [R, L] long with contiguous rows, got "
                         f"{tuple(history.shape)} {history.dtype}, stride {history.stride()}")
    if lengths.shape != (history.shape[0],) or lengths.dtype != torch.long or lengths.device != history.device:
        raise ValueError(f"ngram_lookup: lengths must be [{history.shape[0]}] long on {history.device}, got "
                         f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}")
    if length < 1:
        raise ValueError(f"ngram_lookup: length must be >= 1, got {length}")
    if rows is None:
        rows = torch.arange(history.shape[0], device=history.device)
    if rows.dim() != 1 or rows.dtype != torch.long or rows.device != history.device:
        raise ValueError(f"ngram_lookup: rows must be [B] long on {history.device}, got {tuple(rows.shape)} "
                         f"{rows.dtype} on {rows.device}")
    out = torch.empty(rows.shape[0], length, dtype=torch.long, device=history.device)
    if rows.shape[0]:
        _ngram_lookup_kernel[(rows.shape[0],)](history, lengths.contiguous(), rows.contiguous(), out,
                                               history.stride(0), length, BLOCK=SCAN_BLOCK,
                                               OUT_BLOCK=triton.next_power_of_2(length))
    return out
