"""Gumbel-max sampling (and the k best perturbed scores) in two Triton launches (`gumbel_sample.py` has the contract).

1. Grid (rows, chunks of CHUNK tokens): each token's score x / T + G (-inf below
   the row's cutoff), the chunk's k best as int64 keys ordered as (score, -token)
   (`top_k_triton._keys`, `_select`) -> [rows, chunks, k].
2. `top_k_triton`'s merge: each row's k best keys -> their tokens.
The noise is computed in the kernel from the row's uniform and the token (no
[R, V] noise tensor is read or written), in the same integer steps as the
reference, so the two draw the same token up to the last bit of a logarithm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.kernels.top_k_triton import _keys, _merge_top_k_kernel, _select

CHUNK = 1024


@triton.jit
def _fmix32(h):
    """MurmurHash3's finalizer on int64 values in [0, 2^32) (products wrap; their low 32 bits are kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _gumbel_chunk_kernel(x_ptr, temperature_ptr, cutoff_ptr, uniforms_ptr, keys_ptr, V, stride_x, num_chunks,
                         K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] int32
    real = tokens < V
    x = tl.load(x_ptr + row * stride_x + tokens, mask=real, other=0.0).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    cutoff = tl.load(cutoff_ptr + row)
    key = (tl.load(uniforms_ptr + row) * 4294967296.0).to(tl.int64)  # floor(u * 2^32)
    h = _fmix32((_fmix32(tokens.to(tl.int64) ^ key) + key) & 0xFFFFFFFF)
    u = ((h >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)  # odd multiples of 2^-24
    score = x / temperature - tl.log(-tl.log(u))
    score = tl.where(x < cutoff, float("-inf"), score)
    keys = tl.where(real, _keys(score, tokens), -9223372036854775808)
    _select(keys, keys_ptr + (row * num_chunks + chunk) * K, K, False)


def gumbel_top_k_triton(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                        uniforms: torch.Tensor, k: int = 1) -> torch.Tensor:
    """logits [R, V] (float16/bfloat16/float32); temperature, cutoff [R] float32; uniforms [R] float64
    -> [R, k] long: the k best perturbed scores' tokens, best first (k = 1: the draw)."""
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gumbel_top_k: logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if temperature.dtype != torch.float32 or cutoff.dtype != torch.float32 or uniforms.dtype != torch.float64:
        raise ValueError(f"gumbel_top_k: temperature and cutoff must be float32 and uniforms float64, got "
                         f"{temperature.dtype}, {cutoff.dtype}, {uniforms.dtype}")
    rows, width = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature, cutoff, uniforms = temperature.contiguous(), cutoff.contiguous(), uniforms.contiguous()
    chunks = triton.cdiv(width, CHUNK)
    keys = torch.empty(rows, chunks, k, dtype=torch.int64, device=logits.device)
    _gumbel_chunk_kernel[(rows, chunks)](logits, temperature, cutoff, uniforms, keys, width, logits.stride(0),
                                         chunks, K=k, CHUNK=CHUNK, num_warps=4)
    out = torch.empty(rows, k, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(chunks * k)
    _merge_top_k_kernel[(rows,)](keys, out, chunks * k, K=k, BLOCK=block, num_warps=1 if block <= 1024 else 4)
    return out


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                         uniforms: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; temperature, cutoff [R] float32; uniforms [R] float64 -> [R] long: the draws."""
    return gumbel_top_k_triton(logits, temperature, cutoff, uniforms, 1)[:, 0]
