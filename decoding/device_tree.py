"""A TreeSpec's tensors moved to the decoding device once, not every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from medusa.tree import TreeSpec


@dataclass(frozen=True)
class DeviceTree:
    spec: TreeSpec
    mask: torch.Tensor  # [N, N] bool, ancestor-or-self
    depths: torch.Tensor  # [N] long, position offsets
    parents: torch.Tensor  # [N] long, root -1
    head_index: torch.Tensor  # [Nh] long, which head proposes each head node (nodes 1..Nh)
    ranks: torch.Tensor  # [Nh] long, its rank in that head's top-k
    num_lookup: int  # L: the last L nodes are the prompt-lookup chain, filled from n-gram matches
    max_topk: int  # how many top-k candidates the deepest-needed head must give
    bits: torch.Tensor | None  # [N] int64 ancestor bits (the kernels' tree mask); None past 64 nodes
    paths: torch.Tensor  # [N, D + 1] long: node i's ancestor at each depth (i itself past its depth)
    _batch_bits: dict = field(default_factory=dict, compare=False, repr=False)  # padded -> [padded * N]

    @classmethod
    def from_spec(cls, spec: TreeSpec, device: torch.device) -> "DeviceTree":
        return cls(
            spec=spec,
            mask=spec.attention_mask.to(device),
            depths=spec.depths.to(device),
            parents=spec.parents.to(device),
            head_index=spec.head_index[1:spec.first_lookup_node].to(device),
            ranks=spec.ranks[1:spec.first_lookup_node].to(device),
            num_lookup=spec.lookup,
            max_topk=max(spec.topk_per_depth, default=0),
            bits=spec.ancestor_bits.to(device) if spec.num_nodes <= 64 else None,
            paths=_paths(spec).to(device),
        )

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes

    def batch_bits(self, padded: int) -> torch.Tensor | None:
        """`bits` for each of `padded` rows, [padded * N] int64 (None past 64 nodes): built once per batch
        size, so a captured step reads a kept buffer instead of copying the bits in every replay."""
        if self.bits is None:
            return None
        if padded not in self._batch_bits:
            self._batch_bits[padded] = self.bits.repeat(padded)
        return self._batch_bits[padded]

    @property
    def first_lookup_node(self) -> int:
        """Nodes from here on are the lookup chain (== num_nodes without one)."""
        return self.spec.first_lookup_node


def _paths(spec: TreeSpec) -> torch.Tensor:
    parents, depths = spec.parents.tolist(), spec.depths.tolist()
    paths = torch.arange(spec.num_nodes)[:, None].repeat(1, spec.max_depth + 1)
    for node in range(spec.num_nodes):
        walk = node
        while walk >= 0:
            paths[node, depths[walk]] = walk
            walk = parents[walk]
    return paths
