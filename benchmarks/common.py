"""What the benchmark scripts share: model shapes for random-weight runs, and a device sync."""

from __future__ import annotations

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256),
    "tiny": (64, 128, 2, 4, 2, 256),  # --quick runs on the CPU
}


def sync() -> None:
    """Wait for the GPU (a no-op on the CPU), so host timers see finished work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
