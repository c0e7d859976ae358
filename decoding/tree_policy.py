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

Heads that fall short of their accuracies on one tree fall short on every tree:
what the heads-only trees have accepted against their predictions scales the
head part of every heads-only prior (`calibration`). A tree not yet run then
starts from a prior that has already learnt from the others, so random heads
stop being tried after a few steps of each tree, not after each tree's own
prior has worn off (measured on the GPU: 248 trial steps of a 64-node tree out
of 2,015 at one request, 0.97x). Lookup trees keep their own correction, above.

The step cost is corrected the same way. A graph-timed step leaves out the
host's work per step (scheduling, block bookkeeping, appending and
detokenizing each emitted token), which grows with the batch and with the
tokens a step emits: on an H200 a plain step of the default model took 1.08 ms
as a graph but 1.52 ms in the engine, and a Medusa step 2.07 ms. So the engine
reports every decode step's wall time, and once a tree has run a few steps at
a batch size the median of its latest wall times replaces the graph time there
(a median, because single steps catch a GC pause or another phase's late GPU
work, and one such step must not make a tree look dear for good). A tree not
yet run at that size is charged its graph time plus the host time measured
there for trees of its kind (else for any tree: a plain step's host time is a
floor for every step's).

Speculative trees are all charged so, run or not: their graph time plus the host time of the
speculative steps at that size, each tree's (wall - graph) weighted by the steps it ran. Trees
other than the decided one are wall-timed only in trials and revisits, a few steps at a time and at
other contexts than the decided tree's steps, so their own medians compare badly with its: at one
request on an H200 the 12- and 16-token trees, one tensor-core tile and 0.750 / 0.743 ms as graphs,
were charged 0.739 and 0.779 ms (session 21), which made them tie in tokens per ms and the choice
between them a coin toss per lease (the 16-token one made 3% more tokens a ms end to end). Charged
from one pooled host time, trees differ by what warmup timed side by side. The plain step keeps its
own wall time: it is the only tree of its kind.

Each batch size tries its best tree, every speculative tree whose score is within
TRIAL_BAND of the best (of plain decoding's, where that scores best), and the plain
step for a few steps each, then runs the one with the most tokens per second.
Near the best, priors cannot rank trees: on an H200 at one request, trying the
best alone settled on a 32-node tree at 2.60 tokens per step, where an earlier
policy had run the 64-node one at 2.68.
Speculation must beat plain decoding by MARGIN, for what the step times cannot
see (requests that finish at scattered steps leave their rows empty for a step
or two and are admitted a few at a time, their prompts in steps that the timings
leave out; new rows run the heads). A long run of one kind gives the best of the other kind
one step (every REVISIT_STEPS steps), so neither a change of traffic nor one
unlucky timing can switch speculation off, or plain decoding out, for good.

A plain step that runs the heads (a trial's, or a revisit's, so the speculative
step after it has proposals) costs more than plain decoding does once settled,
when the heads are skipped: for a 1B shape's 128k vocabulary, about a tenth of
the step. Its wall time is charged without the heads (their graph-timed share of
the step, `add_heads_cost`), or a trial would make plain decoding look dearer than
it is and hand the batch size to a tree that loses on the clock. A share, not the
graph-timed seconds taken off with the graph time as a floor: warmup times steps
at 512 cached tokens a row, and where real contexts are shorter every step beats
its graph time; floored, plain decoding alone could not (on an 8B shape at 64
rows, 6.5 ms charged against the 6.1 ms its steps took, which handed the batch to
a 4-node tree that ran at 0.86x plain decoding, session 11).

A tree's trial is a few steps, and near the best a trial can mislead: its
steps may come at a request's start, and its prior keeps most of its weight
(on an H200 at one request `searched-8+lookup4`, 12 nodes and 2.46 tokens a
step once run, was left at 2.02 after five trial steps, and the 36-node
`searched-32+lookup4` ran instead at 2.27 tokens per ms, where the 12-node
tree's own measured acceptance and step cost give 2.66; benchmarks/RESULTS.md
session 17). So every TREE_REVISIT_STEPS steps
of a speculative decision, the least observed speculative tree scoring within
TRIAL_BAND of it runs TRIAL_STEPS steps again (`revisiting`): at most 4% of the
steps, on trees within 10% of the best, and what they accept soon outweighs
their priors. A tree whose every node the decided one holds is not revisited: every step of the
decided tree counts what it would have emitted (below), and its cost is its graph time plus the pooled
host time, so its revisits would only run a smaller tree (session 22, Spec-Bench: 1,394 steps of the
12-token tree inside the 16-token decision, 4.8% of the steps).

A tree holding every node of another (their head paths and lookup chain) accepts at least what that
one does on any step, so its expected length is never below the smaller tree's (`expected_length`).
Without that floor a larger tree seen for a few unlucky steps could lose to its own subtree at the same
step cost (session 19, H200, one request: graph steps of 4 and 12 tokens cost 0.700 and 0.698 ms, one
16-row tile either way, and the policy ran the 8-token `searched-4+lookup4` in 6,906 of 7,201 Spec-Bench
steps at 2.81 tokens a step, where its 12-token superset had accepted 2.90 in session 18).

Every step of a tree also says what each tree inside it would have emitted on the same traffic: for a
row's deepest accepted node, the deepest node of its accepted path that the smaller tree holds
(`observe_subtrees`; exact for greedy rows up to siblings proposing one token). So the trees inside the
running one are observed at every step rather than in a trial of a few steps, which at a request's
start can leave them far below what they accept (session 19, H200, 8 requests: 4-5 trial steps left
the 8- to 36-token trees at 1.88-2.28 expected tokens; the 12-token one accepts 2.9 at one request).

A batch size whose trees are untried borrows the decision of the nearest
smaller batch size that has made one, when that decision is plain decoding: a
tree costs more against a plain step the more rows it has while it accepts the
same, so speculation that loses at the smaller size loses here too. Large
batch sizes then never try trees (a 16-node tree at 64 rows is a 1024-token
step) as a batch fills or drains through them, and never revisit them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from medusa.tree import TreeSpec

PRIOR_STEPS = 16  # how many observed sequence-steps the heads' prediction is worth
TRIAL_STEPS = 4  # wall-timed steps a tree runs at a batch size before its own timing is trusted there
# a tree's wall time at a batch size is the median of its last WALL_WINDOW steps there: two slow steps
# in five move it little, three new steps (three revisits for a kind that is not running) replace it
WALL_WINDOW = 5
# speculative trees scoring within this factor of the best one are tried too before a batch size decides
TRIAL_BAND = 1.1
REVISIT_STEPS = 200  # steps of one kind (plain or speculative) at a batch size before the other kind runs one
# steps of a decided tree before a speculative tree scoring within TRIAL_BAND of it runs TRIAL_STEPS more
TREE_REVISIT_STEPS = 100
SETTLE_STEPS = 8  # a batch size running its decided tree re-decides every SETTLE_STEPS steps of it
# Speculation must promise this many times plain decoding's tokens per second: near a tie, noise and the
# costs outside the timed steps (scattered finishes: empty rows, admissions a few at a time; heads for new rows) decide
MARGIN = 1.1
# tokens of pseudo-evidence that the heads are as good as their accuracies say: the calibration starts at
# 1 and a 64-node tree's four trial steps (a prior of about 0.8 tokens beyond the root each) halve it
CALIBRATION_TOKENS = 4.0


def unmeasured_prior(num_heads: int, ranks: int = 10) -> list[list[float]]:
    """A cautious stand-in [num_heads][ranks] for heads that carry no measured accuracies
    (converted from elsewhere, or random): rank r of head h is right with 0.3 * 0.6^h * 0.5^r.
    Worth only PRIOR_STEPS sequence-steps, so what the engine observes soon replaces it; on
    random heads speculation then loses to plain decoding on the clock and stops.
    """
    return [[0.3 * 0.6 ** h * 0.5 ** r for r in range(ranks)] for h in range(num_heads)]


@dataclass
class WallTime:
    """A tree's measured step time at one batch size: the median of its last WALL_WINDOW steps."""

    recent: deque = field(default_factory=lambda: deque(maxlen=WALL_WINDOW))  # seconds
    seconds: float = 0.0
    steps: int = 0  # all steps ever timed, not only the recent ones

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.seconds = median(self.recent)
        self.steps += 1


class TreePolicy:
    def __init__(self) -> None:
        self.prior: dict[TreeSpec, float] = {}  # predicted accepted length per tree
        self.step_cost: dict[int, dict[TreeSpec, float]] = {}  # bucket -> tree -> graph seconds per step
        self.plain: dict[int, TreeSpec] = {}  # bucket -> its plain (fewest-node) tree
        self.observed: dict[TreeSpec, tuple[int, int]] = {}  # tree -> (tokens emitted, sequence-steps)
        self._lookup_gain = (0.0, 0)  # over lookup trees with a prior: (tokens beyond the prior, sequence-steps)
        self._heads_evidence = (0.0, 0.0)  # over heads-only trees: (tokens beyond the root, as predicted)
        self.wall: dict[int, dict[TreeSpec, WallTime]] = {}  # bucket -> tree -> measured wall time
        self.run: dict[int, tuple[bool, int]] = {}  # bucket -> (speculative, steps in a row of that kind)
        self.decision: dict[int, TreeSpec] = {}  # bucket -> its best tree, once it and plain are tried
        self.speculated: set[int] = set()  # buckets where some speculative tree has run its trial
        self._host: dict[tuple[int, bool | None], float] = {}  # (bucket, speculative or None: any) -> seconds
        self.heads_cost: dict[int, float] = {}  # bucket -> seconds the heads add to a plain step
        self.revisiting: dict[int, tuple[TreeSpec, int]] = {}  # bucket -> (near tree on a revisit, steps left)
        self._since_revisit: dict[int, int] = {}  # bucket -> steps of its speculative decision since a revisit
        self._subtrees: dict[TreeSpec, list[TreeSpec]] = {}  # tree -> the other trees with a prior inside it
        self._subtrees_of: dict = self.prior  # the priors _subtrees was built from
        self._emits: dict[TreeSpec, list[tuple[TreeSpec, np.ndarray]]] = {}  # see `observe_subtrees`

    def add_prior(self, tree: TreeSpec, accuracies) -> bool:
        """Predict the tree's accepted length; False if the accuracies do not cover its heads or ranks."""
        try:
            self.prior[tree] = tree.expected_accept_length(accuracies)
        except ValueError:
            return False
        self._subtrees.clear()
        self._emits.clear()
        return True

    def add_cost(self, bucket: int, tree: TreeSpec, seconds: float) -> None:
        self.step_cost.setdefault(bucket, {})[tree] = seconds
        if bucket not in self.plain or tree.num_nodes < self.plain[bucket].num_nodes:
            self.plain[bucket] = tree

    def add_heads_cost(self, bucket: int, seconds: float) -> None:
        """Graph-timed seconds that running the heads adds to this bucket's plain step."""
        self.heads_cost[bucket] = max(0.0, seconds)

    def observe(self, tree: TreeSpec, emitted: int, sequence_steps: int) -> None:
        tokens, steps = self.observed.get(tree, (0, 0))
        self.observed[tree] = (tokens + emitted, steps + sequence_steps)
        if tree.lookup and tree in self.prior:  # kept as it comes, not summed over the trees per decision
            extra, seen = self._lookup_gain
            self._lookup_gain = (extra + emitted - self.prior[tree] * sequence_steps, seen + sequence_steps)
        elif tree in self.prior and tree.num_nodes > 1:
            got, predicted = self._heads_evidence
            self._heads_evidence = (got + emitted - sequence_steps,
                                    predicted + (self.prior[tree] - 1.0) * sequence_steps)

    def observe_subtrees(self, tree: TreeSpec, best_nodes: np.ndarray) -> None:
        """Count for each speculative tree with a prior inside `tree` the tokens it would have emitted
        on this step, from each row's deepest accepted node `best_nodes` [rows] of `tree` (see the
        module's docstring). Only the trees' own observations move, not the corrections the
        heads-only and lookup trees share (their evidence is the trees that ran)."""
        inside = self._inside(tree)  # first: it drops the cached tables if the priors were replaced
        if tree not in self._emits:
            self._emits[tree] = [(sub, _emitted_within(tree, sub)) for sub in inside if sub.num_nodes > 1]
        for sub, emitted in self._emits[tree]:
            tokens, steps = self.observed.get(sub, (0, 0))
            self.observed[sub] = (tokens + int(emitted[best_nodes].sum()), steps + len(best_nodes))

    def observe_step(self, bucket: int, tree: TreeSpec, seconds: float, proposed: bool = False) -> None:
        """A decode step's wall time, host work included, at this (padded) batch size. `proposed`:
        the step ran the heads; a plain one is then charged without them (the module's docstring)."""
        kind = tree.num_nodes > 1
        graph = self.step_cost.get(bucket, {}).get(tree, 0.0)
        if proposed and not kind and graph > 0:  # without the heads' graph-timed share of the step
            seconds *= graph / (graph + self.heads_cost.get(bucket, 0.0))
        wall = self.wall.setdefault(bucket, {}).setdefault(tree, WallTime())
        wall.add(seconds)
        last, steps = self.run.get(bucket, (kind, 0))
        self.run[bucket] = (kind, steps + 1 if last == kind else 1)
        if kind and wall.steps >= TRIAL_STEPS:
            self.speculated.add(bucket)
        # A decided tree's numbers move little from one of its steps to the next: re-deciding every
        # SETTLE_STEPS of them keeps the policy's host time per step small. A trial step or a
        # revisit's step may change the decision at once.
        decided = self.decision.get(bucket)
        if bucket in self.step_cost and (decided is not tree or wall.steps % SETTLE_STEPS == 0):
            self._settle(bucket)
        self._count_tree_revisit(bucket, tree)

    def _count_tree_revisit(self, bucket: int, tree: TreeSpec) -> None:
        """Every TREE_REVISIT_STEPS steps of a speculative decision, the least observed speculative tree
        scoring within TRIAL_BAND of it runs TRIAL_STEPS steps (see `choose`)."""
        revisit = self.revisiting.get(bucket)
        if revisit is not None and revisit[0] is tree:
            left = revisit[1] - 1
            if left > 0 and self.decision.get(bucket) is not tree:
                self.revisiting[bucket] = (tree, left)
            else:
                del self.revisiting[bucket]
        decided = self.decision.get(bucket)
        if decided is not tree or decided.num_nodes == 1:
            return
        self._since_revisit[bucket] = self._since_revisit.get(bucket, 0) + 1
        if self._since_revisit[bucket] >= TREE_REVISIT_STEPS:
            self._since_revisit[bucket] = 0
            floor = self.score(bucket, decided) / TRIAL_BAND
            held = set(self._inside(decided))  # observed on every step of the decided tree: nothing to learn
            near = [t for t in self.step_cost[bucket] if t.num_nodes > 1 and t is not decided and t not in held
                    and self.score(bucket, t) >= floor]
            if near:
                least_seen = min(near, key=lambda t: self.observed.get(t, (0, 0))[1])
                self.revisiting[bucket] = (least_seen, TRIAL_STEPS)

    def _settle(self, bucket: int) -> None:
        """Refresh the host time charged to untried trees here and decision[bucket]: the best tree
        once it and plain have run their trials (none while either is untried)."""
        graph = self.step_cost[bucket]
        extra = [(tree.num_nodes > 1, wall.steps, wall.seconds - graph[tree]) for tree, wall
                 in self.wall[bucket].items() if wall.steps >= TRIAL_STEPS and tree in graph]
        for kind in (False, True, None):  # (speculative, steps, host seconds) per tried tree
            rows = [(steps, host) for speculative, steps, host in extra if kind in (None, speculative)]
            if rows:  # weighted by steps: the decided tree's many steps say most about the host now
                self._host[bucket, kind] = sum(s * host for s, host in rows) / sum(s for s, _ in rows)
        best = self._best(bucket)
        if (self._tried(bucket, best) and self._tried(bucket, self.plain[bucket])
                and not self._untried_near_best(bucket, best)):
            self.decision[bucket] = best
        else:
            self.decision.pop(bucket, None)

    def cost(self, bucket: int, tree: TreeSpec) -> float:
        """Seconds per step: the plain step's measured wall time once tried; else (and for every
        speculative tree) graph time plus the host time measured here for trees of its kind, else
        for any tree (0 before any)."""
        if tree.num_nodes == 1 and self._tried(bucket, tree):
            return self.wall[bucket][tree].seconds
        host = self._host.get((bucket, tree.num_nodes > 1), self._host.get((bucket, None), 0.0))
        return self.step_cost[bucket][tree] + host

    def proposes(self, bucket: int, tree: TreeSpec) -> bool:
        """Whether a step of `tree` at this batch size must run the heads for the next step:
        a speculative step always does, a plain one only where the next step may speculate.

        Otherwise the heads (with a 128k vocabulary as costly as a tenth of a 1B model's step)
        are skipped; a row that moves to a speculating batch size then proposes stale tokens
        for one step, which costs acceptance, never correctness.
        """
        return tree.num_nodes > 1 or self.may_speculate(bucket)

    def may_speculate(self, bucket: int) -> bool:
        """Whether the step after a plain one at this batch size may speculate (so its rows, new
        ones included, need the heads' proposals). True where no measured policy runs (no warmup);
        False where the batch size has only the plain step, borrows plain decoding, or has settled
        on it with no revisit due."""
        if bucket not in self.step_cost:
            return True
        if len(self.step_cost[bucket]) == 1 or self._borrows_plain(bucket):
            return False  # the plain step is its only one, or it runs plain without trials
        decided = self.decision.get(bucket)
        if decided is None or decided.num_nodes > 1:
            return True  # still trying trees, or speculating (this plain step refreshes plain's timing)
        speculative, steps = self.run.get(bucket, (False, 0))
        return not speculative and steps + 1 >= REVISIT_STEPS

    def settled_on(self, bucket: int, tree: TreeSpec) -> bool:
        """Whether this batch size runs `tree` for more than a trial step or a revisit's: its decision,
        plain decoding where it borrows that, or any tree where no measured policy runs."""
        if bucket not in self.step_cost:
            return True
        if self._borrows_plain(bucket):
            return tree == self.plain[bucket]
        return self.decision.get(bucket) == tree

    def expected_length(self, tree: TreeSpec) -> float:
        """Tokens a step of `tree` emits: its prior corrected by what it accepted, and at least what any
        tree whose nodes it holds is expected to accept."""
        return max([self._own_length(tree)] + [self._own_length(t) for t in self._inside(tree)])

    def _inside(self, tree: TreeSpec) -> list[TreeSpec]:
        """The other trees with a prior whose every node `tree` holds (cached)."""
        if self._subtrees_of is not self.prior:  # the priors may be replaced wholesale
            self._subtrees, self._subtrees_of, self._emits = {}, self.prior, {}
        if tree not in self._subtrees:
            self._subtrees[tree] = [t for t in self.prior if t != tree and _holds(tree, t)]
        return self._subtrees[tree]

    def _own_length(self, tree: TreeSpec) -> float:
        tokens, steps = self.observed.get(tree, (0, 0))
        if tree.lookup:
            prior = self.prior[tree] + self.lookup_bonus()
        else:
            prior = 1.0 + (self.prior[tree] - 1.0) * self.calibration()
        return (prior * PRIOR_STEPS + tokens) / (PRIOR_STEPS + steps)

    def calibration(self) -> float:
        """Tokens beyond the root that the heads-only trees have accepted, over what their priors
        predicted for the same steps, with CALIBRATION_TOKENS of agreement to start from: below 1
        when the heads do worse on this traffic than their accuracies say, above 1 when better."""
        got, predicted = self._heads_evidence
        return (max(got, 0.0) + CALIBRATION_TOKENS) / (predicted + CALIBRATION_TOKENS)

    def lookup_bonus(self) -> float:
        """Tokens per step that prompt-lookup chains have added over the heads' prediction, over every
        lookup tree observed so far. The prior counts head nodes only; the chain adds about the same
        to every tree, so what one lookup tree shows lifts the others' prior too (never below 0)."""
        extra, seen = self._lookup_gain
        return max(0.0, extra / seen) if seen else 0.0

    def score(self, bucket: int, tree: TreeSpec) -> float:
        """Expected tokens per second of `tree` here; plain decoding's counts MARGIN times."""
        return self.expected_length(tree) / self.cost(bucket, tree) * (MARGIN if tree.num_nodes == 1 else 1.0)

    def choose(self, bucket: int) -> TreeSpec:
        """The tree with the best score at this (padded) batch size, after it and the plain step
        have each run TRIAL_STEPS timed steps there; plain where the batch size borrows it."""
        if self._borrows_plain(bucket):
            return self.plain[bucket]
        best = self.decision.get(bucket)
        if best is None:  # on trial: the best tree so far, the trees near it, then the plain step
            best = self._best(bucket)
            if not self._tried(bucket, best):
                return best
            near = self._untried_near_best(bucket, best)
            return near[0] if near else self.plain[bucket]
        speculative, steps = self.run.get(bucket, (False, 0))
        if steps >= REVISIT_STEPS and speculative == (best.num_nodes > 1):
            others = [tree for tree in self.step_cost[bucket] if (tree.num_nodes > 1) != speculative]
            if others:  # one step to refresh the other kind's timing (and a tree's acceptance)
                return max(others, key=lambda tree: self.score(bucket, tree))
        revisit = self.revisiting.get(bucket)
        return revisit[0] if revisit is not None and best.num_nodes > 1 else best

    def trial_trees(self, bucket: int) -> list[TreeSpec]:
        """The trees `choose` runs at this batch size before its first decision, in order, as far as the priors
        and timings tell before any step: the best, the untried trees near it, then the plain step (plain
        alone where the batch size borrows plain decoding). Warmup captures their mixed graphs."""
        if self._borrows_plain(bucket):
            return [self.plain[bucket]]
        best = self._best(bucket)
        return list(dict.fromkeys([best, *self._untried_near_best(bucket, best), self.plain[bucket]]))

    def _best(self, bucket: int) -> TreeSpec:
        return max(self.step_cost[bucket], key=lambda tree: self.score(bucket, tree))

    def _untried_near_best(self, bucket: int, best: TreeSpec) -> list[TreeSpec]:
        """Untried speculative trees scoring within TRIAL_BAND of `best`, best first. Near a speculative best
        the priors cannot rank trees; near a plain one they cannot say whether speculation pays: on a CPU,
        where a tree costs about what it returns, four warmups of one model put plain decoding first twice and
        a tree first twice (`eager_costs.py`), and a prompt-lookup chain's tokens count in a tree's prior
        only once it has run."""
        floor = self.score(bucket, best) / TRIAL_BAND
        near = [tree for tree in self.step_cost[bucket] if tree.num_nodes > 1 and not self._tried(bucket, tree)
                and self.score(bucket, tree) >= floor]
        return sorted(near, key=lambda tree: -self.score(bucket, tree))

    def _tried(self, bucket: int, tree: TreeSpec) -> bool:
        wall = self.wall.get(bucket, {}).get(tree)
        return wall is not None and wall.steps >= TRIAL_STEPS

    def _borrows_plain(self, bucket: int) -> bool:
        """No speculative tree has been tried here, and the nearest smaller batch size with a
        decision decided on plain decoding (see the module's last paragraph)."""
        if bucket in self.speculated:
            return False
        below = [b for b in self.decision if b < bucket]
        return bool(below) and self.decision[max(below)].num_nodes == 1


def _holds(big: TreeSpec, small: TreeSpec) -> bool:
    """Whether `big` has every node of `small`: its head paths and at least its lookup chain."""
    return small.lookup <= big.lookup and set(small.paths) <= set(big.paths)


def _emitted_within(big: TreeSpec, small: TreeSpec) -> np.ndarray:
    """[big's nodes]: the tokens a step of `small` (held by `big`) emits when `big`'s deepest accepted
    node is that node: 1 + the depth of the deepest node on its path from the root that `small` holds."""
    held = {(): True, **{p: True for p in small.paths}}
    first, parents, depths = big.first_lookup_node, big.parents.tolist(), big.depths.tolist()
    emitted = [1] * big.num_nodes
    for node in range(1, big.num_nodes):
        inside = node - first < small.lookup if node >= first else big.paths[node - 1] in held
        emitted[node] = depths[node] + 1 if inside else emitted[parents[node]]
    return np.array(emitted, dtype=np.int64)
