"""Triton kernel for the Medusa heads' residual stacks (`heads_stack.py` has the contract).

One launch per stage (the root term, then each layer), for all K heads at once:
program (j, k) owns BLOCK_N output features of head k, loads their whole weight
rows ([BLOCK_N, H], about 16 KiB) before waiting on the previous kernel (PDL),
then for each of the ROWS input rows multiplies and reduces along H in float32
and adds the residual. The root stage gathers the root tokens' embeddings and
scales them to unit RMS itself, so the embedding never goes through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.kernels.heads_stack import KERNEL_MAX_ROWS, UNIT_RMS_EPS
from medusa.kernels.pdl import pdl_options, wait_for_previous

TILE_BYTES = 16 * 1024  # a program's weight tile, as in the skinny matmul


@triton.jit
def _heads_stage_kernel(in_ptr, tok_ptr, res_ptr, w_ptr, b_ptr, out_ptr, H, stride_in_k, stride_res_k, eps,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EMBED: tl.constexpr, LAYER: tl.constexpr, PDL: tl.constexpr):
    # EMBED: the input rows are embed[tok[r]] scaled to unit RMS; else in[k, r]. LAYER: SiLU(. + bias).
    head = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    k = tl.arange(0, BLOCK_K)  # the whole of H (BLOCK_K >= H)
    n_ok = n < H
    k_ok = k < H
    w = tl.load(w_ptr + head * H * H + n[:, None] * H + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K], read before the previous kernel is done
    if LAYER:
        bias = tl.load(b_ptr + head * H + n, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    dtype = out_ptr.dtype.element_ty
    for r in tl.static_range(ROWS):
        if EMBED:
            tok = tl.load(tok_ptr + r).to(tl.int64)
            e = tl.load(in_ptr + tok * H + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            e = (e * tl.rsqrt(tl.sum(e * e, 0) / H + eps)).to(dtype).to(tl.float32)
        else:
            e = tl.load(in_ptr + head * stride_in_k + r * H + k, mask=k_ok, other=0.0).to(tl.float32)
        t = tl.sum(w * e[None, :], 1)  # [BLOCK_N]
        if LAYER:
            t = (t + bias).to(dtype).to(tl.float32)
            t = t * tl.sigmoid(t)
        t = t.to(dtype).to(tl.float32)
        res = tl.load(res_ptr + head * stride_res_k + r * H + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (head * ROWS + r) * H + n, (res + t).to(dtype), mask=n_ok)


def heads_stack_triton(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                       root: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same arguments and result as `heads_stack.heads_stack`; checks shapes, dtypes and layout."""
    rows, h = x.shape if x.dim() == 2 else (0, 0)
    if x.dim() != 2 or not 0 < rows <= KERNEL_MAX_ROWS:
        raise ValueError(f"heads_stack: x must be [R, H] with 1..{KERNEL_MAX_ROWS} rows, got {tuple(x.shape)}")
    square = (num_heads, h, h)
    weights = [w for w, _ in layers] + ([root[2]] if root is not None else [])
    for w in weights:
        if tuple(w.shape) != square or w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"heads_stack: every weight must be a contiguous {square} of {x.dtype}, got "
                             f"{tuple(w.shape)} {w.dtype}")
    for _, b in layers:
        if tuple(b.shape) != (num_heads, h) or b.dtype != x.dtype or not b.is_contiguous():
            raise ValueError(f"heads_stack: every bias must be a contiguous {(num_heads, h)} of {x.dtype}, got "
                             f"{tuple(b.shape)} {b.dtype}")
    if root is not None:
        roots, embed, _ = root
        if roots.shape != (rows,) or roots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"heads_stack: roots must be [{rows}] integer ids, got {tuple(roots.shape)} {roots.dtype}")
        if embed.dim() != 2 or embed.shape[1] != h or embed.dtype != x.dtype or not embed.is_contiguous():
            raise ValueError(f"heads_stack: embed must be a contiguous [V, {h}] of {x.dtype}, got "
                             f"{tuple(embed.shape)} {embed.dtype}")
    padded = triton.next_power_of_2(rows)
    if padded != rows and (root is not None or layers):
        # ROWS is a compile-time constant: an eager call (the admission of any number of requests at once)
        # runs the variant of the power of two above, which the decode graphs' batch buckets (1, 2, 4, 8,
        # 16) compiled at warmup, instead of compiling one mid-run (0.3 s a variant on the H200, session 21)
        x = torch.cat([x, x.new_zeros(padded - rows, h)])
        if root is not None:
            root = (torch.cat([root[0], root[0].new_zeros(padded - rows)]), root[1], root[2])
        return heads_stack_triton(x, layers, num_heads, root)[:, :rows].contiguous()
    x = x.contiguous()
    block_k = triton.next_power_of_2(h)
    block_n = max(1, min(64, TILE_BYTES // x.element_size() // block_k))
    grid = (triton.cdiv(h, block_n), num_heads)
    launch = dict(ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl_options(x, rows))
    current, stride = x, 0  # [K, R, H] states; stride 0: every head reads x
    if root is not None:
        roots, embed, root_proj_t = root
        out = torch.empty(num_heads, rows, h, dtype=x.dtype, device=x.device)
        _heads_stage_kernel[grid](embed, roots.contiguous(), x, root_proj_t, root_proj_t, out, h, 0, 0, UNIT_RMS_EPS,
                                  EMBED=True, LAYER=False, **launch)
        current, stride = out, rows * h
    for weight, bias in layers:
        out = torch.empty(num_heads, rows, h, dtype=x.dtype, device=x.device)
        _heads_stage_kernel[grid](current, current, current, weight, bias, out, h, stride, stride, UNIT_RMS_EPS,
                                  EMBED=False, LAYER=True, **launch)
        current, stride = out, rows * h
    return current if stride else current.expand(num_heads, rows, h).contiguous()
