"""When the model's layers take the Triton kernels instead of the PyTorch references.

Triton kernels have no backward, so they serve inference only: CUDA tensors
with autograd off. `MEDUSA_DISABLE_TRITON=1` forces the references (to bisect
a numerical difference, say).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("MEDUSA_DISABLE_TRITON") != "1"


def use_triton(x: torch.Tensor, *same_dtype: torch.Tensor) -> bool:
    """Inference on CUDA, no autocast (it mixes dtypes), and `same_dtype` tensors matching x's dtype."""
    return (x.is_cuda and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
            and all(t.dtype == x.dtype for t in same_dtype) and triton_installed())


# Set by the model around a forward: whether this step's kernels launch with PDL (kernels/pdl.py).
_step_overlap: bool | None = None


@contextlib.contextmanager
def overlapped_launches(enabled: bool):
    """Within this block, Triton kernels launch with PDL where `enabled` (and the GPU can), whatever
    their row count: the model knows whether every matmul of its step takes the skinny kernels."""
    global _step_overlap
    previous, _step_overlap = _step_overlap, enabled
    try:
        yield
    finally:
        _step_overlap = previous


def step_overlap() -> bool | None:
    """The enclosing `overlapped_launches` setting, or None outside one."""
    return _step_overlap
