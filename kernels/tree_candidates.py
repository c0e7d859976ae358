"""Each row's tree tokens for a decode step: the contract of `tree_candidates_triton.py`.

Before the forward, a decode step writes out the tokens it verifies: per batch
row, the root (the row's next token), the heads' proposals at each head node
(the rank-th best token of the node's head, from the previous step's top-k) and
the prompt-lookup chain's n-gram proposals. As PyTorch ops that is four kernels
(two row gathers, the node gather and a concatenation) in every captured step;
the Triton kernel is one, one program per row.

For batch row b (state row r = rows[b]) and node j < N:
    candidates[b, 0] = roots[r]
    candidates[b, j] = topk[r, head_index[j - 1], ranks[j - 1]]   for head nodes 1 <= j < first_lookup_node
    candidates[b, j] = lookup[b, j - first_lookup_node]            for the lookup chain
"""

from __future__ import annotations

import torch

from medusa.decoding.batch_verify import build_candidates
from medusa.decoding.device_tree import DeviceTree
from medusa.kernels.dispatch import use_triton


def gather_candidates(tree: DeviceTree, rows: torch.Tensor, roots: torch.Tensor, topk: torch.Tensor | None,
                      lookup: torch.Tensor | None = None) -> torch.Tensor:
    """rows [B] long state rows, roots [R] long, topk [R, K, kmax] long (None for a tree without head
    nodes), lookup [B, >= L] long (None without a chain) -> candidates [B, N] long. The Triton kernel on
    a GPU, else the reference."""
    if use_triton(roots):
        from medusa.kernels.tree_candidates_triton import gather_candidates_triton

        return gather_candidates_triton(tree, rows, roots, topk, lookup)
    return gather_candidates_reference(tree, rows, roots, topk, lookup)


def gather_candidates_reference(tree: DeviceTree, rows: torch.Tensor, roots: torch.Tensor,
                                topk: torch.Tensor | None, lookup: torch.Tensor | None = None) -> torch.Tensor:
    """The module's contract in PyTorch ops (the CPU path); same arguments as `gather_candidates`."""
    heads = topk[rows] if topk is not None and tree.first_lookup_node > 1 else None
    return build_candidates(tree, roots[rows], heads, lookup)
