"""The Medusa heads' residual stacks at inference: the PyTorch reference (the contract of `heads_stack_triton.py`).

After every verification the decode step runs the K heads on one hidden row per
sequence: the root token's term (heads that read it), then each layer's
`h + SiLU(h W^T + b)`. As PyTorch ops that is ~17 small kernels (embedding,
five for the unit-RMS scale, a batched matmul per stage with its bias copy,
SiLU and add) for ~8 MB of weights; the Triton kernel makes each stage one
launch. The contract, for head k and row r (x [R, H], weights [K, H, H] laid out
as nn.Linear's, [out, in]):

    h_0[k, r] = x[r] + unit_rms(embed[roots[r]]) @ root_proj_t[k]^T   (heads that read the root)
              = x[r]                                                  (others)
    h_l[k, r] = h_{l-1}[k, r] + SiLU(h_{l-1}[k, r] @ weight_l[k]^T + bias_l[k])
    unit_rms(e) = e / sqrt(mean(e^2) + 1e-6)

rounded to x's dtype where the reference rounds (after each matmul with its
bias, after SiLU, after each sum). -> [K, R, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medusa.kernels.dispatch import use_triton

UNIT_RMS_EPS = 1e-6
KERNEL_MAX_ROWS = 16  # the kernel unrolls a multiply-reduce per row over its weight tile


def unit_rms(e: torch.Tensor) -> torch.Tensor:
    """Token embeddings [..., H] scaled to unit RMS, whatever the base's embedding scale."""
    return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + UNIT_RMS_EPS)


def heads_stack(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                root: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [R, H]; layers [(weight [K, H, H], bias [K, H])]; root None or (roots [R] long, embed [V, H],
    root_proj_t [K, H, H]) -> [K, R, H]. The Triton kernel on a GPU at inference for up to
    KERNEL_MAX_ROWS rows of one dtype, else the reference."""
    tensors = [t for pair in layers for t in pair] + ([root[1], root[2]] if root is not None else [])
    if 0 < x.shape[0] <= KERNEL_MAX_ROWS and use_triton(x, *tensors):
        from medusa.kernels.heads_stack_triton import heads_stack_triton

        return heads_stack_triton(x, layers, num_heads, root)
    return heads_stack_reference(x, layers, num_heads, root)


def heads_stack_reference(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
                          root: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The module's contract in PyTorch ops (the CPU path); same arguments as `heads_stack`."""
    rows, h = x.shape
    flat = x.reshape(1, rows, h).expand(num_heads, rows, h)  # [K, R, H]
    if root is not None:
        roots, embed, root_proj_t = root
        e = unit_rms(F.embedding(roots, embed).to(x.dtype)).reshape(1, rows, h).expand(num_heads, rows, h)
        flat = flat + torch.bmm(e, root_proj_t.transpose(1, 2))
    for weight, bias in layers:
        flat = flat + F.silu(torch.baddbmm(bias[:, None], flat, weight.transpose(1, 2)))
    return flat if root is not None or layers else flat.contiguous()
