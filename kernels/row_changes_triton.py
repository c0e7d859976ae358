"""A step's per-row logit changes in one Triton launch (`row_changes.py` has the contract).

Grid (rows G, chunks of BLOCK tokens, groups of NODES nodes): a program loads its row's bias, counts and
prompt_seen chunk once, then for each of its nodes reads the logits, changes them and writes float32. The
arithmetic is the reference's, operation for operation, so the bits are the same: the division is IEEE
(`div_rn`; Triton's `/` on float32 is approximate) and products are not fused into the subtractions after
them (`enable_fp_fusion=False`: an FMA rounds once where PyTorch rounds twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens a program changes
NODES = 8  # nodes a program walks with one load of its row's tables: more rows of programs for 1-row trees


@triton.jit
def _change_rows_kernel(x_ptr, out_ptr, rows_ptr, bias_ptr, counts_ptr, seen_ptr, frequency_ptr, presence_ptr,
                        repetition_ptr, biased_ptr, N, V, stride_xg, stride_xn, stride_f, stride_p, stride_r,
                        stride_b, HAS_BIAS: tl.constexpr, HAS_COUNTS: tl.constexpr, REPEATS: tl.constexpr,
                        BLOCK: tl.constexpr, NODES: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = tokens < V
    row = tl.load(rows_ptr + g)  # int64
    if HAS_BIAS:
        biased = tl.load(biased_ptr + g * stride_b) > 0  # other rows' bias rows may be stale: x + 0
        bias = tl.where(biased, tl.load(bias_ptr + row * V + tokens, mask=real, other=0.0), 0.0)
    if HAS_COUNTS:
        counts = tl.load(counts_ptr + row * V + tokens, mask=real, other=0.0)
        counted = counts > 0
        frequency = tl.load(frequency_ptr + g * stride_f)
        presence = tl.load(presence_ptr + g * stride_p)
        if REPEATS:
            seen = counted | (tl.load(seen_ptr + row * V + tokens, mask=real, other=0) != 0)
            repetition = tl.load(repetition_ptr + g * stride_r)
    first = tl.program_id(2) * NODES
    for n in range(first, tl.minimum(first + NODES, N)):
        x = tl.load(x_ptr + g * stride_xg + n * stride_xn + tokens, mask=real, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = x + bias
        if HAS_COUNTS:
            if REPEATS:
                x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
            x = x - frequency * counts - presence * counted.to(tl.float32)
        tl.store(out_ptr + (g * N + n) * V + tokens, x, mask=real)


def change_rows_triton(logits: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None,
                       counts: torch.Tensor | None, prompt_seen: torch.Tensor | None, frequency: torch.Tensor,
                       presence: torch.Tensor, repetition: torch.Tensor, biased: torch.Tensor,
                       repeats: bool) -> torch.Tensor:
    """logits [G, N, V] (last dimension contiguous); rows [G] long; tables and settings as the contract
    (checked by `row_changes.change_rows`) -> float32 [G, N, V]."""
    groups, nodes, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = rows.contiguous()
    out = torch.empty(groups, nodes, vocab, dtype=torch.float32, device=logits.device)
    has_counts = counts is not None
    seen = prompt_seen.view(torch.uint8) if has_counts else logits  # unread without counts
    grid = (groups, triton.cdiv(vocab, BLOCK), triton.cdiv(nodes, NODES))
    _change_rows_kernel[grid](logits, out, rows, bias if bias is not None else logits, counts if has_counts else logits,
                              seen, frequency, presence, repetition, biased, nodes, vocab, logits.stride(0),
                              logits.stride(1), frequency.stride(0), presence.stride(0), repetition.stride(0),
                              biased.stride(0), HAS_BIAS=bias is not None, HAS_COUNTS=has_counts,
                              REPEATS=has_counts and repeats, BLOCK=BLOCK, NODES=NODES, num_warps=4,
                              enable_fp_fusion=False)
    return out
