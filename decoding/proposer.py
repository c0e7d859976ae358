"""Turn the heads' predictions into the tokens of the next tree.

A node at depth d with rank r takes head (d-1)'s r-th most likely token; all
nodes of one depth draw from the same head, independent of their parent, as in
Medusa. A tree's prompt-lookup nodes get the root's token here; the decoders
overwrite them from their n-gram indexes. A proposer is any callable with the
`Proposer` signature, which lets tests plug in an oracle that knows the right
answer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from medusa.decoding.device_tree import DeviceTree


class Proposer(Protocol):
    def __call__(self, tree: DeviceTree, root: torch.Tensor, head_logits: torch.Tensor | None,
                 generated: list[int]) -> torch.Tensor:
        """root [] token; head_logits [K, V] at the root's parent; generated so far
        (root excluded) -> candidates [N] with candidates[0] == root."""
        ...


def propose_from_heads(tree: DeviceTree, root: torch.Tensor, head_logits: torch.Tensor | None,
                       generated: list[int]) -> torch.Tensor:
    if tree.num_nodes == 1:
        return root.view(1)
    needed = head_logits[: tree.spec.head_depth]  # [D, V]
    top = torch.topk(needed, tree.max_topk, dim=-1).indices  # [D, max_topk]
    return torch.cat([root.view(1), top[tree.head_index, tree.ranks], root.view(1).expand(tree.num_lookup)])
