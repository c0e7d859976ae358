"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

A batch-1 decode step of a small model is a chain of ~300 kernels that each
read a few KB to a few MB; between two of them the GPU idles for the launch
and for the first loads' latency. With PDL (Hopper and later) the next kernel
is launched as soon as every program of the current one has started
(`gdc_launch_dependents`), loads what no earlier kernel writes (its weights)
and then blocks in `gdc_wait` until the previous kernel has completed and its
writes are visible. Measured on an H200 (benchmarks/RESULTS.md, session 16):
the default model's plain decode step (303 kernels, a CUDA graph) took 0.90 ms
with the skinny matmuls and no PDL, 0.52 ms with both (cuBLAS, no PDL: 0.96).

The rule every kernel that takes `PDL` follows: before `wait_for_previous`,
read only tensors that no kernel of the step writes (weights, norm scales)
and write nothing. After it, everything is ordered as without PDL, and
because each kernel waits for its predecessor, waiting is transitive: a
kernel launched early can never see an older kernel's unfinished work.
A kernel launched without the attribute (cuBLAS, PyTorch ops) simply waits
for the previous kernel to complete, as always.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from medusa.kernels import skinny_matmul
from medusa.kernels.dispatch import step_overlap


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Let the next kernel launch now, then wait until the previous kernel's writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("MEDUSA_DISABLE_PDL") == "1":
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False  # griddepcontrol needs sm_90
    from triton.backends.nvidia.compiler import CUDAOptions

    return any(field.name == "launch_pdl" for field in dataclasses.fields(CUDAOptions))


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether kernels working on `x` launch with PDL: a Hopper-or-later GPU, a Triton that can
    launch that way, no interpreter, and `MEDUSA_DISABLE_PDL` unset (for A/B timing)."""
    return x.is_cuda and _supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_options(x: torch.Tensor, tokens: int) -> dict:
    """Keyword arguments for a kernel launch over `tokens` rows: `PDL` for the kernel and `launch_pdl`
    for Triton's launcher.

    PDL pays in a step whose every matmul is a skinny kernel, so that the whole step is a chain of
    kernels that wait for each other; the model says so (`dispatch.overlapped_launches`), and outside
    a model's forward a one-row launch is taken for such a step. In steps whose matmuls are cuBLAS's,
    PDL on the kernels between them measured 3-7% slower on an H200 (RESULTS.md, session 16).
    """
    wanted = step_overlap()
    if wanted is None:
        wanted = tokens <= skinny_matmul.MAX_ROWS
    return {"PDL": True, "launch_pdl": True} if wanted and pdl_enabled(x) else {"PDL": False}
