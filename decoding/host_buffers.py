"""Page-locked host staging buffers for a step's small integer inputs.

On a GPU every copy from pageable host memory synchronises the host with the
device; from page-locked memory it is queued and the host goes on. The step
code fills a reusable NumPy view of such a buffer and uploads it in one copy.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> np.ndarray:
    """A reusable host array, page-locked when `device` is a GPU."""
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda").numpy()


def upload(buffer: torch.Tensor, values: np.ndarray) -> None:
    """buffer[:len(values)] = values, queued (asynchronous from a `host_buffer`; from any other
    array the copy is staged first). The caller must not rewrite `values` before the copy ran."""
    buffer[: len(values)].copy_(torch.from_numpy(values), non_blocking=True)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor of `values` (a list or array) on `device`, without waiting for the device: on a GPU
    staged in page-locked memory (kept by the caching host allocator until the copy ran) and queued.
    `torch.tensor(values, device=...)` copies from pageable memory, which waits for every queued step."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


@dataclass
class PendingCopy:
    """A device tensor on its way to the host (`copy_to_host`): `tolist()` waits for the copy alone."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # recorded after the copy; None on the CPU, where the copy is done

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def copy_to_host(tensor: torch.Tensor, host: torch.Tensor | None = None,
                 done: torch.cuda.Event | None = None) -> PendingCopy:
    """Queue a copy of `tensor` to the host, into the page-locked `host` (same shape) and recording `done`
    after it where given, else into new ones; on the CPU the tensor itself."""
    if tensor.device.type != "cuda":
        return PendingCopy(tensor, None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if host is None else host
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event() if done is None else done
    done.record()
    return PendingCopy(host, done)


@contextmanager
def overwritten(fills: list[tuple[torch.Tensor, int]], kept: tuple[torch.Tensor, ...] = ()):
    """Inside: each static input of `fills` holds its value (padding, for a warm-up and capture that must
    touch no sequence); afterwards they, and `kept` (written inside), hold what they held before."""
    buffers = [tensor for tensor, _ in fills] + list(kept)
    saved = [tensor.clone() for tensor in buffers]
    for tensor, value in fills:
        tensor.fill_(value)
    try:
        yield
    finally:
        for tensor, value in zip(buffers, saved):
            tensor.copy_(value)
