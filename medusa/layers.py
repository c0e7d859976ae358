"""Building blocks of the decoder: RMSNorm and linear layers that load per tensor.

q/k/v and gate/up are fused into one matmul each (fewer kernel launches per
step), yet weights still arrive one checkpoint tensor at a time: each fused
layer knows where every shard goes. Tensor parallelism can later swap these for
column/row-parallel versions with the same `load_shard` contract.

`norm_linear` is the norm plus the linear layer after it: a Triton norm kernel,
then the matmul (folding the two, or SiLU-and-mul and the down projection, into
one Triton GEMM was measured slower at every shape, benchmarks/RESULTS.md
session 9). `Linear` sends products of few rows to the skinny Triton kernels
(`kernels/skinny_matmul.py`) and the rest to cuBLAS.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa.kernels.dispatch import use_triton
from medusa.kernels.fused_ops import add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference
from medusa.kernels import skinny_matmul
from medusa.kernels.skinny_matmul import SplitSums


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor | SplitSums) -> torch.Tensor:
        # statistics in float32, as the reference implementations do
        if isinstance(x, SplitSums):
            x = x.total()
        if use_triton(x, self.weight):
            from medusa.kernels.fused_ops_triton import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps)[0]
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor | SplitSums, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual): the residual stream's add fused into the norm. x may be a
        product left as `SplitSums` (o_proj's, down_proj's), which the Triton kernel adds up as it loads it."""
        if use_triton(residual, self.weight) and x.dtype == residual.dtype:
            from medusa.kernels.fused_ops_triton import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps, residual)
        if isinstance(x, SplitSums):
            x = x.total()
        return add_rms_norm_reference(x, residual, self.weight, self.eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I], one kernel on the GPU."""
    if use_triton(x):
        from medusa.kernels.fused_ops_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


def norm_linear(norm: RMSNorm, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                split_sums: bool = True) -> tuple[torch.Tensor | SplitSums, torch.Tensor]:
    """-> (linear(norm(x [+ residual])), residual stream: x + residual, or x itself when residual is None).

    x, residual [..., H]; the first output is [..., linear's out_features]. split_sums: passed to the `Linear`
    (False: this call's consumer cannot take `SplitSums`).
    """
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm.add_and_norm(x, residual)
    return linear(h, split_sums=split_sums), residual


class Linear(nn.Linear):
    """nn.Linear whose product takes the skinny Triton kernel for a few rows on the GPU
    (a batch-1 plain step; `kernels/skinny_matmul.py`), cuBLAS otherwise.

    split_sums: the output only goes to consumers that take a product left as `SplitSums` (o_proj and
    down_proj: the next RMSNorm's residual add; qkv_proj: RoPE and the KV write), so a tree step's few rows
    cut K into slices on the tensor cores.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, split_sums: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.split_sums = split_sums

    def forward(self, x: torch.Tensor, split_sums: bool = True) -> torch.Tensor | SplitSums:
        """split_sums=False: this call's consumer cannot take `SplitSums` (a whole-K product whatever the layer)."""
        return skinny_matmul.linear(x, self.weight, self.bias, self.split_sums and split_sums)


class FusedLinear(Linear):
    """One Linear whose output rows are the concatenation of named shards."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, split_sums: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, split_sums=split_sums)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, start + size)
            start += size

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        start, end = self.shard_offsets[shard]
        target = getattr(self, param)[start:end]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard}.{param}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
