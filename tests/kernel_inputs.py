"""Random kernel inputs shared by the kernel tests: no zeros, both signs, on the GPU where there is one."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(g, *shape, dtype=torch.float32):
    """Uniform in +-[0.1, 1.1): no zeros, both signs."""
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return ((torch.rand(*shape, generator=g) + 0.1) * sign).to(dtype).to(DEVICE)
