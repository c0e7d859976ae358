"""When the model's layers take the Triton kernels instead of the PyTorch references.

Triton kernels have no backward, so they serve inference only: CUDA tensors
with autograd off. `MEDUSA_DISABLE_TRITON=1` forces the references (to bisect
a numerical difference, say).

`MEDUSA_FUSED_MATMUL=1` additionally folds RMSNorm and SiLU-and-mul into the
linear layers after them (`fused_matmul_triton.py`). It is off by default until
the GPU timings show those kernels beat norm + cuBLAS; it is read at every call
(cheap next to a launch, and free inside a captured CUDA graph), so tests and
benchmarks can flip it in one process.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("MEDUSA_DISABLE_TRITON") != "1"


def use_triton(x: torch.Tensor, *same_dtype: torch.Tensor) -> bool:
    """Inference on CUDA, no autocast (it mixes dtypes), and `same_dtype` tensors matching x's dtype."""
    return (x.is_cuda and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
            and all(t.dtype == x.dtype for t in same_dtype) and triton_installed())


# Beyond this many rows a GEMM is compute-bound: saving the norm's launch is worth little there,
# and the fused kernels are tiled for decode-sized M, where cuBLAS is at its worst.
FUSED_MATMUL_MAX_ROWS = 512


def use_fused_matmul(x: torch.Tensor, *same_dtype: torch.Tensor | None) -> bool:
    """`MEDUSA_FUSED_MATMUL=1`, the `use_triton` conditions (Nones in `same_dtype` skipped), and few rows."""
    return (os.environ.get("MEDUSA_FUSED_MATMUL") == "1" and math.prod(x.shape[:-1]) <= FUSED_MATMUL_MAX_ROWS
            and use_triton(x, *(t for t in same_dtype if t is not None)))
