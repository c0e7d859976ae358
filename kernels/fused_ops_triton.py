"""Triton kernels for RMSNorm (+ residual add), SiLU-and-mul and RoPE: one launch each.

Same contracts as the references in `fused_ops.py`. Each kernel works on one
row (token) per program, in float32, rounding where the reference rounds.
Inputs may be strided views (q, k, v are column slices of the fused QKV
output); outputs are fresh contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.kernels.pdl import pdl_options, wait_for_previous
from medusa.kernels.skinny_matmul import SplitSums


@triton.jit
def load_product(ptr, offs, mask, stride_split, SPLITS: tl.constexpr, DTYPE: tl.constexpr):
    """A matmul's output at ptr + offs, as DTYPE: loaded as it is, or (SPLITS > 0) given as float32 partial sums
    over K slices stride_split apart (`SplitSums`), summed and rounded once, as a whole-K product's epilogue rounds."""
    if SPLITS:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            x += tl.load(ptr + s * stride_split + offs, mask=mask, other=0.0)
        x = x.to(DTYPE)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(DTYPE)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_split, size, eps,
                     HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # no kernel writes it: read before waiting
    wait_for_previous(PDL)
    x = load_product(x_ptr, row * stride_x + cols, ok, stride_split, SPLITS, out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as torch rounds x + residual
        tl.store(res_out_ptr + row * size + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / size + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _product_rows(op: str, x: torch.Tensor | SplitSums) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (what the kernel reads, x's rows [rows, N], K slices): a tensor as it is (its last dim contiguous, rows
    maybe strided; 0 slices), or a product left as `SplitSums`: its parts, contiguous float32 [S, rows, N]."""
    n = x.shape[-1]
    if not isinstance(x, SplitSums):
        if x.stride(-1) != 1:
            raise ValueError(f"{op}: x's last dim must be contiguous, got strides {x.stride()}")
        rows = x.reshape(-1, n)
        return rows, rows, 0
    parts = x.parts
    if parts.dtype != torch.float32 or not parts.is_contiguous() or parts.shape[1:] != (x.shape.numel() // n, n):
        raise ValueError(f"{op}: SplitSums parts must be contiguous float32 [S, rows, {n}], got "
                         f"{tuple(parts.shape)} {parts.dtype}")
    return parts, parts[0], parts.shape[0]


def rms_norm_triton(x: torch.Tensor | SplitSums, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., H] (rows contiguous), or a product left as `SplitSums` -> (rms_norm(x [+ residual]),
    x + residual or None)."""
    size = x.shape[-1]
    if weight.shape != (size,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight must be [{size}] of {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual must match x {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    source, rows_x, splits = _product_rows("rms_norm", x)
    rows_r = residual.reshape(-1, size) if residual is not None else rows_x
    out = torch.empty(x.shape, dtype=x.dtype, device=rows_x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows_x.shape[0]:
        _rms_norm_kernel[(rows_x.shape[0],)](
            source, rows_r, weight, out, res_out, rows_x.stride(0), rows_r.stride(0),
            rows_x.numel(), size, eps, HAS_RESIDUAL=residual is not None, SPLITS=splits,
            BLOCK=triton.next_power_of_2(size), **pdl_options(out, rows_x.shape[0]))
    return out, (res_out if residual is not None else None)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
    tl.store(out_ptr + row * size + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: last dim must be even and contiguous, got {tuple(x.shape)}")
    size = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * size)
    out = torch.empty(*x.shape[:-1], size, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(size), 1024)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(size, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), size, BLOCK=block, **pdl_options(x, rows.shape[0]))
    return out


@triton.jit
def _rotate_rows(src_row, dst_row, stride_sh, stride_dh, num_heads, cos, sin, stride_split,
                 SPLITS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate one token's heads: src_row / dst_row point at its [H, D] rows (head strides given); src may be
    a product's `SplitSums` slices, stride_split apart (`load_product`)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    ok = (heads < num_heads)[:, None]
    src = heads[:, None] * stride_sh + dims[None, :]
    dtype = dst_row.dtype.element_ty
    a = load_product(src_row, src, ok, stride_split, SPLITS, dtype).to(tl.float32)
    b = load_product(src_row, src + HALF, ok, stride_split, SPLITS, dtype).to(tl.float32)
    dst = dst_row + heads[:, None] * stride_dh + dims[None, :]
    tl.store(dst, (a * cos[None, :] - b * sin[None, :]).to(dtype), mask=ok)
    tl.store(dst + HALF, (b * cos[None, :] + a * sin[None, :]).to(dtype), mask=ok)


@triton.jit
def _rotate_q(q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh, num_q_heads, stride_split,
              SPLITS: tl.constexpr, HALF: tl.constexpr, BLOCK_QH: tl.constexpr):
    """The token's cos/sin rows [D/2] from its position; q rotated into the contiguous q_out. Returns (cos, sin)."""
    pos = tl.load(pos_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + dims)
    sin = tl.load(sin_ptr + pos * HALF + dims)
    _rotate_rows(q_ptr + token * stride_qt, q_out_ptr + token * num_q_heads * 2 * HALF, stride_qh, 2 * HALF,
                 num_q_heads, cos, sin, stride_split, SPLITS, HALF, BLOCK_QH)
    return cos, sin


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rotate_q(q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh, num_q_heads, 0,
                         0, HALF, BLOCK_QH)
    _rotate_rows(k_ptr + token * stride_kt, k_out_ptr + token * num_k_heads * 2 * HALF, stride_kh, 2 * HALF,
                 num_k_heads, cos, sin, 0, 0, HALF, BLOCK_KH)


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...]; q [..., Hq, D]; k [..., Hkv, D] (strided views allowed); cos/sin [P, D/2] fp32."""
    d = q.shape[-1]
    half = d // 2
    if k.shape[-1] != d or d % 2 or half & (half - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"rotary: q and k need one head_dim D with D/2 a power of two and contiguous last dims, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(f"rotary: cos/sin must be contiguous float32 [positions, {half}]")
    lead = q.shape[:-2]
    if k.shape[:-2] != lead:
        raise ValueError(f"rotary: q and k leading shapes differ: {tuple(q.shape)} vs {tuple(k.shape)}")
    qs, ks = q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:])  # views for QKV slices
    pos = positions.expand(lead).reshape(-1).contiguous()
    q_out = torch.empty(qs.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(ks.shape, dtype=k.dtype, device=k.device)
    if qs.shape[0]:
        _rotary_kernel[(qs.shape[0],)](qs, ks, q_out, k_out, pos, cos, sin, qs.stride(0), qs.stride(1), ks.stride(0),
                                       ks.stride(1), qs.shape[1], ks.shape[1], HALF=half,
                                       BLOCK_QH=triton.next_power_of_2(qs.shape[1]),
                                       BLOCK_KH=triton.next_power_of_2(ks.shape[1]))
    return q_out.view(q.shape), k_out.view(k.shape)
