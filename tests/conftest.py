"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter: set before any kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (the README's `-n 2`) each worker is a process of its own: one thread each, or two
# workers' matmuls would oversubscribe two cores (CI: 17.0 min serial, 12.6 min in two one-thread workers)
# The processes tests start (benchmark scripts, the notebooks' kernels, the CLI) inherit one thread too: with two
# they spin at OpenMP barriers while the other worker holds a core (a notebook ran in 252 s beside it, 27 s alone).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Iterator[Path]:
    """The default model's converted HF folder, converted once per test session.

    Uses a session temporary cache (so the user's cache is never touched) unless
    `MEDUSA_CACHE` is already set, which lets CI keep one conversion across runs.
    `MEDUSA_CACHE` stays pointed at that cache for the session, so tests calling
    `default_model_path()` themselves hit the same folder.
    """
    from medusa.default_model import default_model_path, find_default_gguf

    try:
        find_default_gguf()
    except FileNotFoundError as err:  # an install step is missing: fail loudly, never skip
        pytest.fail(str(err))
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("MEDUSA_CACHE"):
            mp.setenv("MEDUSA_CACHE", str(tmp_path_factory.mktemp("medusa_cache")))
        yield default_model_path()


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: skip them on machines without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
