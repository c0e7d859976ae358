"""Sampling by the Gumbel-max trick: the contract of `gumbel_sample_triton.py`.

argmax_t(x_t / T + G_t), with G_t independent standard Gumbel noise, is an exact
draw from softmax(x / T). A draw then reads each row's logits once, where the
inverse CDF needs a softmax, a float64 cumulative sum and a search over the
vocabulary: on an H200 those took 0.62 ms for a 16-token tree at 32 rows of
49,152 logits (RESULTS.md, session 23), a third of such a step.

The noise of a row is a function of one uniform u in [0, 1) (its request's
uniform for that output position: `sampler.seeded_uniforms`) and the token
only: key = floor(u * 2^32); h_t = fmix32(fmix32(t ^ key) + key mod 2^32)
(MurmurHash3's finalizer, a bijection on 32 bits); u_t = (odd 24-bit number
h_t >> 8 | 1) / 2^24 in (0, 1), exact in float32; G_t = -log(-log(u_t)). So a
seeded request draws the same token for an output position whatever row,
batch or tree it is drawn in, and plain decoding with that seed draws it too.

Filters (top-k, top-p) come as one cutoff per row in raw logits: tokens whose
logit is below it cannot be drawn (`filter_cutoffs`). Scaling by 1 / T keeps the
order of logits, so the kept set is the same as on the scaled ones, and a step
with filters and one without draw the same token for a row without any.

Contract: logits [R, V] float; temperature [R] float32 > 0; cutoff [R] float32
(-inf: none); uniforms [R] float64 in [0, 1) -> tokens [R] long, the first
maximum of the scores (equal scores: lowest token).
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton

MASK32 = 0xFFFFFFFF
ROW_CHUNK = 64  # rows whose [rows, V] noise the reference builds at once (bounded memory on a CPU)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32  # int64 products wrap: their low 32 bits are exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def gumbel_noise(uniforms: torch.Tensor, vocab: int) -> torch.Tensor:
    """uniforms [R] float64 -> [R, V] float32 standard Gumbel noise (the module's docstring)."""
    key = (uniforms * 2.0 ** 32).long()[:, None]  # [R, 1], floor: u < 1
    tokens = torch.arange(vocab, device=uniforms.device)[None]  # [1, V]
    h = fmix32((fmix32(tokens ^ key) + key) & MASK32)
    u = ((h >> 8) | 1).float() * 2.0 ** -24  # odd multiples of 2^-24: (0, 1), exact in float32
    return -torch.log(-torch.log(u))


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                            uniforms: torch.Tensor) -> torch.Tensor:
    """The contract in PyTorch, ROW_CHUNK rows at a time."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for start in range(0, logits.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        x = logits[rows].float()
        score = x / temperature[rows, None] + gumbel_noise(uniforms[rows], x.shape[-1])
        out[rows] = score.masked_fill(x < cutoff[rows, None], float("-inf")).argmax(-1)
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row (the contract): the Triton kernels on a GPU, the reference elsewhere."""
    rows = logits.shape[0]
    if logits.dim() != 2 or any(t.shape != (rows,) for t in (temperature, cutoff, uniforms)):
        raise ValueError(f"gumbel_argmax: logits must be [R, V] and temperature, cutoff, uniforms [R], got "
                         f"{tuple(logits.shape)}, {tuple(temperature.shape)}, {tuple(cutoff.shape)}, "
                         f"{tuple(uniforms.shape)}")
    if uniforms.dtype != torch.float64 or not temperature.is_floating_point() or not cutoff.is_floating_point():
        raise ValueError(f"gumbel_argmax: uniforms must be float64 and temperature, cutoff float, got "
                         f"{uniforms.dtype}, {temperature.dtype}, {cutoff.dtype}")
    if use_triton(logits) and logits.numel():
        from medusa.kernels.gumbel_sample_triton import gumbel_argmax_triton

        return gumbel_argmax_triton(logits, temperature.float(), cutoff.float(), uniforms)
    return gumbel_argmax_reference(logits, temperature.float(), cutoff.float(), uniforms)
