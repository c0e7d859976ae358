"""Pick the tree that fits this device: most expected tokens per second.

A tree of N nodes costs one forward of N tokens. On an H200 a 64-token forward
costs about what one token does; on a CPU it costs many times more. So the
choice is measured, not assumed: for each candidate size we search the best
tree for the heads' measured accuracies, time a verification forward of that
size here, and keep the best expected_accept_length / step_time. A speculative
step also runs the heads once (their shared vocabulary projection: on 2 CPU cores
8-11 ms against a 65-70 ms single-token forward of the default model, RESULTS.md
session 27), so that time is added to every tree but the single node.
"""

from __future__ import annotations

import time

import torch

from medusa.decoding.kv_cache import ContiguousKVCache
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel
from medusa.tree import TreeSpec

CANDIDATE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Used only when heads carry no measured accuracies: a first probe of 4 heads on
# the default model (top-1 0.43 / 0.26 / 0.18 / 0.14), lower ranks decaying.
FALLBACK_ACCURACIES = [
    [0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.02, 0.015, 0.01, 0.01],
    [0.28, 0.09, 0.05, 0.03, 0.025, 0.02, 0.015, 0.01, 0.01, 0.01],
    [0.19, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.01, 0.01],
    [0.15, 0.06, 0.035, 0.025, 0.02, 0.015, 0.01, 0.01, 0.01, 0.01],
]


def choose_tree(base: DecoderModel, heads: MedusaHeads | None, context: int = 256) -> TreeSpec:
    if heads is None:
        return TreeSpec.load("single")
    accuracies = heads.config.accuracies or FALLBACK_ACCURACIES
    accuracies = [row for row in accuracies][: heads.config.num_heads]
    best, best_rate = TreeSpec.load("single"), 0.0
    proposing = heads_seconds(base, heads)
    for size in CANDIDATE_SIZES:
        tree = TreeSpec.search(accuracies, size, name=f"auto-{size}")
        seconds = step_seconds(base, size, context) + (proposing if size > 1 else 0.0)
        rate = tree.expected_accept_length(accuracies) / seconds
        if rate > best_rate:
            best, best_rate = tree, rate
    return best


@torch.inference_mode()
def step_seconds(base: DecoderModel, num_tokens: int, context: int, repeats: int = 3) -> float:
    """Median wall time of one forward of `num_tokens` tree tokens after `context` cached tokens."""
    device = base.embed_tokens.weight.device
    context = min(context, base.config.max_position_embeddings - num_tokens)
    cache = ContiguousKVCache(base.config, context + num_tokens, base.embed_tokens.weight.dtype, device)
    cache.length = context  # contents do not matter for timing
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.full((num_tokens,), context, device=device)
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()

    def forward() -> None:
        cache.begin(positions, mask)
        base.compute_logits(base(ids, positions, cache))
    return _median_seconds(forward, device, repeats)


@torch.inference_mode()
def heads_seconds(base: DecoderModel, heads: MedusaHeads, repeats: int = 3) -> float:
    """Median wall time of the heads' proposals at one position (what a speculative step adds)."""
    device = base.embed_tokens.weight.device
    hidden = torch.zeros(1, base.config.hidden_size, dtype=base.embed_tokens.weight.dtype, device=device)
    root = torch.zeros(1, dtype=torch.long, device=device)
    return _median_seconds(lambda: heads(hidden, base.lm_head.weight, roots=root).topk(10, dim=-1), device, repeats)


def _median_seconds(run, device: torch.device, repeats: int) -> float:
    """Median wall time of `run()` over `repeats` calls, after one that warms up."""
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
