"""`x @ weight.T (+ bias)` for few rows: the contract of `skinny_matmul_triton.py`, and when to use it.

A decode step at batch 1 multiplies one row (a plain step) or a tree's few dozen
rows by every weight matrix. cuBLAS picks tiles made for many rows: on an H200 the
default model's 120 projections of a plain step averaged 3.8 us each for ~1 us of
weight bytes, and the 1B shape's QKV and O projections averaged 5.9 us, about half
the copy bandwidth (benchmarks/RESULTS.md, session 5). The Triton kernels instead give each program
a few whole weight rows, load them before waiting on the previous kernel (PDL,
`pdl.py`), and then multiply: one row on the CUDA cores (any K up to MAX_K), up
to DOT_MAX_ROWS rows on the tensor cores (K up to DOT_MAX_K, so that a weight
tile and a 16-row input tile stay within one program). Larger products keep
cuBLAS, which is at its best there. A product whose consumer sums partials as it
loads them (o_proj and down_proj feed the next norm, qkv_proj RoPE and the KV
write) is cut along K instead (`SplitSums`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa.kernels.dispatch import step_overlap, use_triton

KERNEL_MAX_ROWS = 16  # the one-row kernel unrolls a multiply-reduce per row over its weight tile
# Products of one row take that kernel: every further row is another pass of float32 multiply-adds over
# the tile on the CUDA cores, and on an H200 (RESULTS.md, session 16) steps of 4 rows ran slower than with
# cuBLAS on the 1B and 8B shapes (8B: 7.04 against 4.67 ms), 2 rows 2% slower on the 8B shape.
MAX_ROWS = 1
MAX_K = 16384  # a one-row program holds whole weight rows: 1 x 16384 bf16 is its largest tile (32 KiB)
# The tensor-core kernel: one 16-row tile of input, K up to DOT_MAX_K and a [16, K] tile within DOT_TILE_BYTES.
# Measured on an H200 (RESULTS.md, session 16), steps of 2-16 tokens of the 135M shape (K 576 and 1536) ran
# 0.74-0.82 ms against cuBLAS's 0.94-1.00, but 36 and 64 tokens (several tiles) 1.15 and 1.43 against 0.99
# and 1.03, and the 1B shape's K = 2048 ran at half cuBLAS's speed at every size.
DOT_MAX_ROWS = 16
DOT_MAX_K = 1536
DOT_TILE_BYTES = 64 * 1024  # K padded to a power of two: bf16 up to K 2048, float32 up to 1024
# MEDUSA_SKINNY=0 sends every product to cuBLAS (to time one against the other, or to bisect a difference)
ENABLED = os.environ.get("MEDUSA_SKINNY", "1") != "0"
# Products whose consumer sums partials (`SplitSums`: see `medusa.layers.Linear`'s split_sums) are cut
# along K into slices of SPLIT_K_BLOCK, one program per (32 weight rows, slice). A whole-K program streams
# 32 x K weights through one SM, so the 135M's [576, 1536] down projection ran on 18 SMs: on an H200, per call
# in a graph with PDL (RESULTS.md, session 31), 16 rows took 4.47 us whole and 1.67 us in 6 slices of 256
# (o_proj, [576, 576]: 2.29 against 1.49). MEDUSA_SPLIT_K=0 keeps whole-K products (to time one against the other).
SPLIT_K_BLOCK = 256
SPLIT_K_ENABLED = os.environ.get("MEDUSA_SPLIT_K", "1") != "0"
# On a CPU, F.linear of a few rows by a large weight (x @ W.T) ran 1.1-3.9x slower than the same product
# with the weight as the left operand (W @ x.T): 2 cores, MKL, float32, weights of 19-262 MB at 2-64 rows (the
# default model's [49152, 576] lm_head: 2-4 rows 22-23 against 6-9 ms, 8-32 rows 1.1-1.6x, 64 rows about even,
# slower from 128; RESULTS.md, session 27). Session 27 kept the default model's layers (1.3-7 MB) on F.linear
# from a [8192, 64] weight that lost (0.7-1.0x: K = 64); its [3072, 576] gate/up gained 2.0-3.9x at 2-16 rows
# (session 47), and swapping every layer cut the default model's forward of 8 tokens from 206 to 116-122 ms
# (4 tokens: 158-170 -> 87-90 ms, what one token costs; `benchmarks/cpu_projection.py`).
CPU_SWAP_MIN_BYTES = 1 << 20  # the default model's lm_head and its layers' weights (576 x 576 fp32 is 1.3 MB)
CPU_SWAP_MIN_K = 256  # K = 64 lost, K >= 576 gained; between them untimed
CPU_SWAP_MAX_ROWS = 64


@dataclass(frozen=True)
class SplitSums:
    """A product `x @ W.T` left as float32 partial sums over slices of K, for a consumer that adds them up as it
    loads its input (`rms_norm_triton`, `rope_write_kv_triton`), so that cutting K costs no kernel of its own.

    parts [S, *shape] float32 (a product's are contiguous [S, rows, N]; `split` and `view` give views of them,
    as Tensor.split and Tensor.view do of the product, so q, k and v can be cut from a fused QKV product);
    shape: the product's [..., N]; dtype: the product's (x's) dtype.
    """

    parts: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The product itself [..., N]: the slices summed in float32, rounded once to dtype."""
        return self.parts.sum(0).to(self.dtype).view(self.shape)

    def split(self, sizes: list[int], dim: int = -1) -> list[SplitSums]:
        """Column slices of the product (views of the parts), as `Tensor.split(sizes, dim=-1)`."""
        if dim not in (-1, len(self.shape) - 1) or sum(sizes) != self.shape[-1]:
            raise ValueError(f"SplitSums.split: sizes summing to the last dim {self.shape[-1]}, got {sizes} "
                             f"along dim {dim}")
        return [SplitSums(part, self.shape[:-1] + (size,), self.dtype)
                for part, size in zip(self.parts.split(sizes, dim=-1), sizes)]

    def view(self, *shape: int) -> SplitSums:
        """The product viewed as `shape` (the parts as [S, *shape]), as `Tensor.view`."""
        parts = self.parts.view(self.parts.shape[0], *shape)
        return SplitSums(parts, parts.shape[1:], self.dtype)


def splits_k(rows: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a product of `rows` rows and K = k of `dtype` may be cut into K slices (`SplitSums`): the
    tensor-core sizes (2..DOT_MAX_ROWS rows) of 2-byte types, K at least two slices."""
    return (SPLIT_K_ENABLED and 1 < rows <= DOT_MAX_ROWS and k >= 2 * SPLIT_K_BLOCK
            and dtype in (torch.float16, torch.bfloat16))


def skinny_matmul_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype."""
    return F.linear(x, weight, bias)


def fits_tensor_cores(rows: int, k: int, element_size: int) -> bool:
    """Whether the tensor-core kernel takes `rows` rows of K = k (elements of `element_size` bytes)."""
    padded = 1 << max(k - 1, 0).bit_length()
    return 1 < rows <= DOT_MAX_ROWS and 0 < k <= DOT_MAX_K and 16 * padded * element_size <= DOT_TILE_BYTES


def covers(rows: int, k: int, element_size: int) -> bool:
    """Whether `linear` sends a product of `rows` rows and K = k to a skinny kernel (on a GPU, at inference)."""
    return ENABLED and (0 < rows <= MAX_ROWS and 0 < k <= MAX_K or fits_tensor_cores(rows, k, element_size))


def takes_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` sends this product to a Triton kernel: inference on a GPU, `covers` its
    rows and K, one dtype throughout and a contiguous weight; more than one row only inside a forward
    whose launches overlap (`dispatch.overlapped_launches`, PDL). The tensor-core kernel wins only
    there: on its own (the lm_head after a tree's forward, the heads' vocabulary projection) it ran
    slower than cuBLAS on an H200 (RESULTS.md, session 17: the 135M lm_head at 2-16 rows 43-45 us
    against 16.4-17.0; 576 x 1536 weights 6.9-7.4 against 4.5-4.9)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > MAX_ROWS and not step_overlap():
        return False
    extra = (bias,) if bias is not None else ()
    return (covers(rows, weight.shape[1], x.element_size()) and weight.is_contiguous()
            and use_triton(x, weight, *extra))


def swaps_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes this CPU product as weight @ x.T: inference, 2 to CPU_SWAP_MAX_ROWS rows,
    a weight of at least CPU_SWAP_MIN_BYTES and K of at least CPU_SWAP_MIN_K (one row stays F.linear: it is
    a matrix-vector product either way, and a plain step's logits keep F.linear's exact values)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cpu" and 2 <= rows <= CPU_SWAP_MAX_ROWS and not torch.is_grad_enabled()
            and weight.shape[-1] >= CPU_SWAP_MIN_K and weight.numel() * weight.element_size() >= CPU_SWAP_MIN_BYTES)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           split_sums: bool = False) -> torch.Tensor | SplitSums:
    """F.linear, through the skinny Triton kernels where `takes_skinny` says so, or with the operands
    swapped on a CPU where `swaps_on_cpu` says so. split_sums: the caller's consumer takes `SplitSums`, which
    a product of several rows on the tensor cores then returns (`splits_k`)."""
    if takes_skinny(x, weight, bias):
        rows = x.numel() // x.shape[-1]
        if split_sums and splits_k(rows, x.shape[-1], x.dtype):
            from medusa.kernels.skinny_matmul_triton import split_k_matmul_triton

            return split_k_matmul_triton(x, weight, bias)
        from medusa.kernels.skinny_matmul_triton import skinny_matmul_triton

        return skinny_matmul_triton(x, weight, bias)
    if swaps_on_cpu(x, weight):
        out = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().contiguous()  # [rows, N], as F.linear's
        out = out if bias is None else out + bias
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
