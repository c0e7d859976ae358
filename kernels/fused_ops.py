"""PyTorch references for the decoder's fused elementwise kernels (and the CPU path).

A decoding step of a small model is bound by kernel launches, not bytes: an
eager Llama layer issues ~50 small kernels, mostly float casts around RMSNorm
and RoPE. `fused_ops_triton.py` does each of these in one kernel; the functions
here define what they must compute, rounding steps included, so that the Triton
path and the reference agree to the last bf16 bit in all but rare ties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * x / rms(x), statistics in float32, rounded to x.dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream in one pass."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-interleaved RoPE. positions [...]; q [..., Hq, D]; k [..., Hkv, D]; cos/sin [P, D/2] float32."""
    c = cos[positions].unsqueeze(-2)  # [..., 1, D/2]
    s = sin[positions].unsqueeze(-2)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
