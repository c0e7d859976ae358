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
maximum of the scores (equal scores: lowest token). `gumbel_top_k`: the k best
scores' tokens [R, k], best first, equal scores by lowest token: a Medusa head's
proposals for a sampled row, perturbed by the noise its position will be drawn
with (`decode_step.py`).
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton
from medusa.kernels.top_k import MAX_K, top_k_reference

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


def perturbed_scores(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """[R, V] float32: x / T + G, -inf below the cutoff (the scores the contract ranks)."""
    x = logits.float()
    score = x / temperature[:, None] + gumbel_noise(uniforms, x.shape[-1])
    return score.masked_fill(x < cutoff[:, None], float("-inf"))


def gumbel_top_k_reference(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                           uniforms: torch.Tensor, k: int = 1) -> torch.Tensor:
    """The contract in PyTorch, ROW_CHUNK rows at a time -> [R, k]."""
    out = torch.empty(logits.shape[0], k, dtype=torch.long, device=logits.device)
    for start in range(0, logits.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        score = perturbed_scores(logits[rows], temperature[rows], cutoff[rows], uniforms[rows])
        out[rows] = score.argmax(-1, keepdim=True) if k == 1 else top_k_reference(score, k)
    return out


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                            uniforms: torch.Tensor) -> torch.Tensor:
    return gumbel_top_k_reference(logits, temperature, cutoff, uniforms)[:, 0]


def gumbel_top_k(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                 uniforms: torch.Tensor, k: int = 1) -> torch.Tensor:
    """[R, k] tokens of the k best perturbed scores (the contract): the Triton kernels on a GPU, the reference
    elsewhere."""
    rows = logits.shape[0]
    if logits.dim() != 2 or any(t.shape != (rows,) for t in (temperature, cutoff, uniforms)):
        raise ValueError(f"gumbel_top_k: logits must be [R, V] and temperature, cutoff, uniforms [R], got "
                         f"{tuple(logits.shape)}, {tuple(temperature.shape)}, {tuple(cutoff.shape)}, "
                         f"{tuple(uniforms.shape)}")
    if uniforms.dtype != torch.float64 or not temperature.is_floating_point() or not cutoff.is_floating_point():
        raise ValueError(f"gumbel_top_k: uniforms must be float64 and temperature, cutoff float, got "
                         f"{uniforms.dtype}, {temperature.dtype}, {cutoff.dtype}")
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"gumbel_top_k: k must be in 1..{logits.shape[-1]} for rows of {logits.shape[-1]}, got {k}")
    if use_triton(logits) and logits.numel() and k <= MAX_K:  # each selection round is two reductions
        from medusa.kernels.gumbel_sample_triton import gumbel_top_k_triton

        return gumbel_top_k_triton(logits, temperature.float(), cutoff.float(), uniforms, k)
    return gumbel_top_k_reference(logits, temperature.float(), cutoff.float(), uniforms, k)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row [R] (the contract)."""
    return gumbel_top_k(logits, temperature, cutoff, uniforms)[:, 0]
