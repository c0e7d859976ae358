"""Triton kernel for `x @ weight.T (+ bias)` with at most a few rows (`skinny_matmul.py` has the contract).

One program owns BLOCK_N whole rows of the weight ([BLOCK_N, K], about 16 KiB):
it loads them, and the bias, before waiting on the previous kernel (PDL), so the
weight bytes are on their way while the norm or activation before it finishes.
Then each of the ROWS input rows is multiplied into the tile and reduced along K
in float32, rounded once to the output dtype (as cuBLAS's epilogue rounds).
Several rows take the tensor cores: a whole-K product per 32 weight rows, or, for a
consumer that sums partials (`SplitSums`), one product per (32 weight rows, slice
of K), so that a narrow weight still spreads over many SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.kernels.pdl import pdl_options, wait_for_previous
from medusa.kernels.skinny_matmul import (DOT_MAX_K, DOT_MAX_ROWS, DOT_TILE_BYTES, KERNEL_MAX_ROWS, MAX_K,
                                           SPLIT_K_BLOCK, SplitSums, fits_tensor_cores, splits_k)

TILE_BYTES = 16 * 1024  # a program's weight tile (H200: 8-32 KiB tiles ran within 3% of each other)
# Weight rows per tensor-core program for 2-byte inputs. 16 rows give 4 warps only two 8-wide MMA tiles, so
# half the warps repeat the other half's work; 32 give each warp its own. On an H200 (RESULTS.md, session
# 19) the 135M step of 2-16 tokens took 0.658-0.684 ms against 0.725-0.745 with 16 rows (8 warps: 0.680-0.757;
# 64 rows: past the shared memory at K = 1536). float32 (tests) keeps 16: its tiles are twice the bytes.
DOT_BLOCK_N = 32


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_om,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    k = tl.arange(0, BLOCK_K)  # the whole of K (BLOCK_K >= K)
    n_ok = n < N
    k_ok = k < K
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_K], read before the previous kernel is done
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    for m in tl.static_range(ROWS):
        x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)  # [BLOCK_N]
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _skinny_dot_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SLICED: tl.constexpr, PDL: tl.constexpr):
    # Grid (N tiles, K slices); one 16-row tile holds every row (M <= DOT_MAX_ROWS). Whole K (one slice,
    # BLOCK_K >= K): the product, rounded to out's dtype. SLICED: program (j, s) multiplies by the s-th
    # BLOCK_K slice of K and stores its float32 partial at out[s] ([S, M, N], `SplitSums`).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = n < N
    k_ok = k < K
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_K], read before the previous kernel is done
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SLICED:
            bias = tl.where(s == 0, bias, 0.0)  # added once, by the first slice
    wait_for_previous(PDL)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if IEEE:  # float32 inputs: full-precision products, not TF32
        acc = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w))  # [BLOCK_M, BLOCK_N] float32
    if HAS_BIAS:
        acc += bias[None, :]
    if SLICED:
        tl.store(out_ptr + (s * M + m)[:, None] * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def _check_weight_and_bias(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """weight a contiguous [N, K] and bias [N] or None, both of x's dtype (K = x's last dim)."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be a contiguous [N, {k}], got {tuple(weight.shape)} "
                         f"with strides {weight.stride()}")
    if weight.dtype != x.dtype or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        raise ValueError(f"{op}: weight and bias [{n}] must be of x's dtype {x.dtype}, got "
                         f"{weight.dtype}" + ("" if bias is None else f", {tuple(bias.shape)} {bias.dtype}"))


def split_k_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> SplitSums:
    """`x @ weight.T (+ bias)` as SPLIT_K_BLOCK-wide slices of K, each slice's float32 product stored apart:
    -> SplitSums (parts [S, rows, N]). x [..., K] with 2..DOT_MAX_ROWS rows; weight [N, K] contiguous."""
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if not splits_k(rows.shape[0], k, x.dtype):
        raise ValueError(f"split_k_matmul: 2..{DOT_MAX_ROWS} rows of fp16/bf16 with K >= {2 * SPLIT_K_BLOCK}, "
                         f"got x {tuple(x.shape)} of {x.dtype}")
    _check_weight_and_bias("split_k_matmul", x, weight, bias)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    slices = triton.cdiv(k, SPLIT_K_BLOCK)
    parts = torch.empty(slices, rows.shape[0], n, dtype=torch.float32, device=x.device)
    _skinny_dot_kernel[(triton.cdiv(n, DOT_BLOCK_N), slices)](
        rows, weight, bias if bias is not None else weight, parts, rows.shape[0], n, k, rows.stride(0), n,
        BLOCK_M=16, BLOCK_N=DOT_BLOCK_N, BLOCK_K=SPLIT_K_BLOCK, HAS_BIAS=bias is not None, IEEE=False, SLICED=True,
        num_warps=4, **pdl_options(x, rows.shape[0]))
    return SplitSums(parts, x.shape[:-1] + (n,), x.dtype)


def skinny_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] with at most KERNEL_MAX_ROWS rows (DOT_MAX_ROWS where K <= DOT_MAX_K), weight [N, K]
    contiguous, bias [N] or None -> [..., N]. One row: a multiply-reduce per weight row on the CUDA cores;
    more: a tensor-core product of 16-row tiles."""
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k) if k else x.reshape(0, 0)
    _check_weight_and_bias("skinny_matmul", x, weight, bias)
    several = fits_tensor_cores(rows.shape[0], k, x.element_size())
    if not (several or 0 < rows.shape[0] <= KERNEL_MAX_ROWS and 0 < k <= MAX_K):
        raise ValueError(f"skinny_matmul: 1..{KERNEL_MAX_ROWS} rows of 1..{MAX_K} features, or up to "
                         f"{DOT_MAX_ROWS} rows of K <= {DOT_MAX_K} (a [16, K] tile of at most {DOT_TILE_BYTES} "
                         f"bytes), got x {tuple(x.shape)} of {x.dtype}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    if several:  # tensor cores
        block_n = DOT_BLOCK_N if x.element_size() <= 2 else 16
        _skinny_dot_kernel[(triton.cdiv(n, block_n), 1)](  # one slice: the whole of K
            rows, weight, bias if bias is not None else weight, out, rows.shape[0], n, k, rows.stride(0),
            out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, SLICED=False, num_warps=4 if block_k <= 1024 else 8,
            **pdl_options(x, rows.shape[0]))
        return out.view(*x.shape[:-1], n)
    block_n = max(1, min(64, TILE_BYTES // x.element_size() // block_k))
    tile_bytes = block_n * block_k * x.element_size()
    _skinny_matmul_kernel[(triton.cdiv(n, block_n),)](
        rows, weight, bias if bias is not None else weight, out, n, k, rows.stride(0), out.stride(0),
        ROWS=rows.shape[0], BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        num_warps=4 if tile_bytes <= TILE_BYTES else 8, **pdl_options(x, rows.shape[0]))
    return out.view(*x.shape[:-1], n)
