"""Which tree each batch size verifies: measured step cost against expected acceptance.

`LLMEngine.warmup()` times the captured decode step of every (batch bucket,
tree) on the device; the heads' measured top-k accuracies predict each tree's
accepted length. A bucket then runs the tree with the most expected tokens per
second, so large batches fall back to small trees, down to plain decoding,
where the device says speculation stops paying. The prediction is a prior: as
the engine runs, each tree's accepted length moves to what it actually
observes, so heads that do worse on real traffic than on their held-out data
soon get smaller trees. The accuracies say nothing about a prompt-lookup chain,
so lookup trees' priors also get what the chains have added so far on the trees
observed (`lookup_bonus`).

The step cost is corrected the same way. A graph-timed step leaves out the
host's work per step (scheduling, block bookkeeping, appending and
detokenizing each emitted token), which grows with the batch and with the
tokens a step emits: on an H200 a plain step of the default model took 1.08 ms
as a graph but 1.52 ms in the engine, and a Medusa step 2.07 ms. So the engine
reports every decode step's wall time, and once a tree has run a few steps at
a batch size its measured wall time replaces the graph time there. A tree not
yet run at that size is charged its graph time plus the host time measured
there for trees of its kind (speculative or plain). Each batch size tries the
plain step for a few steps too, so speculation is kept only where it beats
plain decoding on the clock. While a batch size runs plain, its best
speculative tree still gets one step in every REVISIT_STEPS, so a change of
traffic (or a slow start) cannot switch speculation off for good.
"""

from __future__ import annotations

from medusa.tree import TreeSpec

PRIOR_STEPS = 16  # how many observed sequence-steps the heads' prediction is worth
TRIAL_STEPS = 4  # wall-timed steps a tree runs at a batch size before its own timing is trusted there
WALL_EMA = 0.25  # weight of the newest step in a tree's running wall time
REVISIT_STEPS = 200  # plain steps at a batch size before its best speculative tree runs one step again


def unmeasured_prior(num_heads: int, ranks: int = 10) -> list[list[float]]:
    """A cautious stand-in [num_heads][ranks] for heads that carry no measured accuracies
    (converted from elsewhere, or random): rank r of head h is right with 0.3 * 0.6^h * 0.5^r.
    Worth only PRIOR_STEPS sequence-steps, so what the engine observes soon replaces it; on
    random heads speculation then loses to plain decoding on the clock and stops.
    """
    return [[0.3 * 0.6 ** h * 0.5 ** r for r in range(ranks)] for h in range(num_heads)]


class TreePolicy:
    def __init__(self) -> None:
        self.prior: dict[TreeSpec, float] = {}  # predicted accepted length per tree
        self.step_cost: dict[int, dict[TreeSpec, float]] = {}  # bucket -> tree -> seconds per step
        self.observed: dict[TreeSpec, tuple[int, int]] = {}  # tree -> (tokens emitted, sequence-steps)
        self._lookup_gain = (0.0, 0)  # over lookup trees with a prior: (tokens beyond the prior, sequence-steps)
        self.wall: dict[int, dict[TreeSpec, tuple[float, int]]] = {}  # bucket -> tree -> (seconds, steps)
        self.plain_run: dict[int, int] = {}  # bucket -> plain steps since its last speculative one

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
        if tree.lookup and tree in self.prior:  # kept as it comes: choose() reads the bonus every step
            extra, seen = self._lookup_gain
            self._lookup_gain = (extra + emitted - self.prior[tree] * sequence_steps, seen + sequence_steps)

    def observe_step(self, bucket: int, tree: TreeSpec, seconds: float) -> None:
        """A decode step's wall time, host work included, at this (padded) batch size."""
        mean, steps = self.wall.setdefault(bucket, {}).get(tree, (seconds, 0))
        self.wall[bucket][tree] = (mean + WALL_EMA * (seconds - mean) if steps else seconds, steps + 1)
        self.plain_run[bucket] = self.plain_run.get(bucket, 0) + 1 if tree.num_nodes == 1 else 0

    def cost(self, bucket: int, tree: TreeSpec) -> float:
        """Seconds per step: measured wall time once tried, else graph time plus its kind's host time."""
        seconds, steps = self.wall.get(bucket, {}).get(tree, (0.0, 0))
        if steps >= TRIAL_STEPS:
            return seconds
        return self.step_cost[bucket][tree] + self._host_seconds(bucket, tree.num_nodes > 1)

    def _host_seconds(self, bucket: int, speculative: bool) -> float:
        """Mean of (wall - graph) over the trees of this kind tried at this bucket; 0 before any."""
        graph = self.step_cost[bucket]
        extra = [seconds - graph[tree] for tree, (seconds, steps) in self.wall.get(bucket, {}).items()
                 if steps >= TRIAL_STEPS and (tree.num_nodes > 1) == speculative and tree in graph]
        return sum(extra) / len(extra) if extra else 0.0

    def proposes(self, bucket: int, tree: TreeSpec) -> bool:
        """Whether a step of `tree` at this batch size must run the heads for the next step.

        A speculative step always does. A plain step does only where the next step may
        speculate: its batch size has timed trees and a revisit is due. Otherwise the heads
        (with a 128k vocabulary as costly as a tenth of a 1B model's step) are skipped; a row
        that moves to a speculating batch size then proposes stale tokens for one step, which
        costs acceptance, never correctness.
        """
        if tree.num_nodes > 1 or bucket not in self.step_cost:
            return True
        if not any(t.num_nodes > 1 for t in self.step_cost[bucket]):
            return False
        return self.plain_run.get(bucket, 0) + 1 >= REVISIT_STEPS

    def expected_length(self, tree: TreeSpec) -> float:
        tokens, steps = self.observed.get(tree, (0, 0))
        prior = self.prior[tree] + (self.lookup_bonus() if tree.lookup else 0.0)
        return (prior * PRIOR_STEPS + tokens) / (PRIOR_STEPS + steps)

    def lookup_bonus(self) -> float:
        """Tokens per step that prompt-lookup chains have added over the heads' prediction, over every
        lookup tree observed so far. The prior counts head nodes only; the chain adds about the same
        to every tree, so what one lookup tree shows lifts the others' prior too (never below 0)."""
        extra, seen = self._lookup_gain
        return max(0.0, extra / seen) if seen else 0.0

    def choose(self, bucket: int) -> TreeSpec:
        """The tree with the most expected tokens per second at this (padded) batch size,
        after it and the plain step have each run TRIAL_STEPS timed steps there."""
        trees = self.step_cost[bucket]
        score = {tree: self.expected_length(tree) / self.cost(bucket, tree) for tree in trees}
        best = max(trees, key=score.get)
        plain = min(trees, key=lambda tree: tree.num_nodes)
        for tree in (best, plain):
            if self.wall.get(bucket, {}).get(tree, (0.0, 0))[1] < TRIAL_STEPS:
                return tree
        speculative = [tree for tree in trees if tree.num_nodes > 1]
        if best is plain and speculative and self.plain_run.get(bucket, 0) >= REVISIT_STEPS:
            return max(speculative, key=score.get)  # one step to refresh its acceptance and timing
        return best
