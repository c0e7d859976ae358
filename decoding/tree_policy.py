"""Which tree each batch size verifies: measured step cost against expected acceptance.

`LLMEngine.warmup()` times the captured decode step of every (batch bucket,
tree) on the device; the heads' measured top-k accuracies predict each tree's
accepted length. A bucket then runs the tree with the most expected tokens per
second, so large batches fall back to small trees, down to plain decoding,
where the device says speculation stops paying. The prediction is a prior: as
the engine runs, each tree's accepted length moves to what it actually
observes, so heads that do worse on real traffic than on their held-out data
soon get smaller trees.
"""

from __future__ import annotations

from medusa.tree import TreeSpec

PRIOR_STEPS = 16  # how many observed sequence-steps the heads' prediction is worth


class TreePolicy:
    def __init__(self) -> None:
        self.prior: dict[TreeSpec, float] = {}  # predicted accepted length per tree
        self.step_cost: dict[int, dict[TreeSpec, float]] = {}  # bucket -> tree -> seconds per step
        self.observed: dict[TreeSpec, tuple[int, int]] = {}  # tree -> (tokens emitted, sequence-steps)

    def add_prior(self, tree: TreeSpec, accuracies) -> bool:
        """Predict the tree's accepted length; False if the accuracies do not cover its heads or ranks."""
        try:
            self.prior[tree] = tree.expected_accept_length(accuracies)
        except ValueError:
            return False
        return True

    def add_cost(self, bucket: int, tree: TreeSpec, seconds: float) -> None:
        self.step_cost.setdefault(bucket, {})[tree] = seconds

    def observe(self, tree: TreeSpec, emitted: int, sequence_steps: int) -> None:
        tokens, steps = self.observed.get(tree, (0, 0))
        self.observed[tree] = (tokens + emitted, steps + sequence_steps)

    def expected_length(self, tree: TreeSpec) -> float:
        tokens, steps = self.observed.get(tree, (0, 0))
        return (self.prior[tree] * PRIOR_STEPS + tokens) / (PRIOR_STEPS + steps)

    def choose(self, bucket: int) -> TreeSpec:
        """The tree with the most expected tokens per second at this (padded) batch size."""
        costs = self.step_cost[bucket]
        return max(costs, key=lambda tree: self.expected_length(tree) / costs[tree])
