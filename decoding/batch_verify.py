"""Tree verification for a whole batch on the device, with no host round trip.

Every decoding sequence of a step verifies the same tree (the scheduler picks
one per step), so candidates, targets and verdicts are [B, N] tensors and the
whole step (propose -> forward -> verify -> compact KV -> propose next) is a
fixed sequence of kernels that a CUDA graph can replay. Greedy rows are
decided here; rows that need host logic (sampling, min_tokens, logprobs) get
their verdict from `verifier.verify` and write it into the same buffers.
"""

from __future__ import annotations

import torch

from medusa.decoding.device_tree import DeviceTree


def build_candidates(tree: DeviceTree, roots: torch.Tensor, topk: torch.Tensor | None) -> torch.Tensor:
    """roots [B]; topk [B, K, kmax] the heads' top tokens -> candidates [B, N], root first."""
    if tree.num_nodes == 1:
        return roots[:, None]
    proposals = topk[:, tree.head_index, tree.ranks]  # [B, N - 1]
    return torch.cat([roots[:, None], proposals], dim=1)


def greedy_verdict(tree: DeviceTree, candidates: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """candidates, targets [B, N] (targets = argmax at each node) -> deepest accepted node [B]."""
    child_ok = candidates[:, 1:] == targets[:, tree.parents[1:]]  # [B, N - 1]
    ok = torch.cat([torch.ones_like(child_ok[:, :1]), child_ok], dim=1)  # [B, N], root always passes
    path_ok = ~(tree.mask[None] & ~ok[:, None, :]).any(-1)  # [B, N]: every ancestor-or-self passes
    score = torch.where(path_ok, tree.depths[None], -1)
    return score.argmax(-1)  # first (lowest index) among the deepest, like the batch-1 verifier


def emitted_tokens(tree: DeviceTree, candidates: torch.Tensor, best: torch.Tensor,
                   next_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (count [B], tokens [B, D + 1]): the accepted drafts then the next root; entries past count are junk."""
    count = tree.depths[best] + 1  # [B]
    path = tree.paths[best]  # [B, D + 1]
    drafts = candidates.gather(1, path[:, 1:])  # [B, D] accepted draft tokens, then junk
    tokens = torch.cat([drafts, best.new_zeros(best.shape[0], 1)], dim=1)
    tokens.scatter_(1, (count - 1)[:, None], next_token[:, None])
    return count, tokens


def compaction_slots(tree: DeviceTree, slots: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [B, N] of the step's tokens -> (src, dst) [B * (D + 1)] moving the accepted path's KV down.

    The node at depth d of the path moves to the step's d-th slot. Moves past the
    path, and the root's, have src == dst and copy a slot onto itself.
    """
    path = tree.paths[best]  # [B, D + 1]
    dst = slots[:, : path.shape[1]]
    src = slots.gather(1, path)
    keep = torch.arange(path.shape[1], device=slots.device)[None] <= tree.depths[best][:, None]
    return torch.where(keep, src, dst).flatten(), dst.flatten()
