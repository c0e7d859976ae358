"""An oracle proposer for tests: it knows the base model's greedy continuation.

Each step it writes the true next tokens along one randomly chosen root-to-leaf
path of the tree and random tokens everywhere else, so whole paths are accepted,
often through non-first children, and the KV move after long acceptances (with
gaps between the kept nodes) is exercised.
"""

from __future__ import annotations

import torch


class OracleProposer:
    def __init__(self, reference: list[int], vocab_size: int, seed: int = 0) -> None:
        self.reference, self.vocab_size = reference, vocab_size
        self.rng = torch.Generator().manual_seed(seed)
        self.path_lengths: list[int] = []  # tokens the oracle made acceptable, per step (root included)

    def __call__(self, tree, root, head_logits, generated):
        spec = tree.spec
        candidates = torch.randint(self.vocab_size, (spec.num_nodes,), generator=self.rng)
        candidates[0] = root.item()
        rows = spec.retrieve_indices
        path = rows[torch.randint(rows.shape[0], (1,), generator=self.rng).item()]
        next_index = len(generated) + 1  # reference index of the token after the root
        length = 1
        for depth, node in enumerate(path.tolist()[1:], start=0):
            if node < 0 or next_index + depth >= len(self.reference):
                break
            candidates[node] = self.reference[next_index + depth]
            length += 1
        self.path_lengths.append(length)
        return candidates.to(root.device)
