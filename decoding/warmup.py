"""What `LLMEngine.warmup()` captures and times before serving, and how the measured tree policy starts.

With CUDA graphs: the prefill graphs, then per batch bucket every tree that fits `max_graph_tokens`,
timed as graphs in interleaved rounds (`_time_trees`), so the policy (`tree_policy.py`) starts from
measured step costs and the heads' accuracies; then the mixed (decode + prompt chunk) graphs of the
trees each bucket will try first (`TreePolicy.trial_trees`), and with `sampling` their sampling variants,
so that a level's first requests do not wait for captures. Without graphs (a CPU) a few eager steps give the costs
(`eager_costs.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from medusa.decoding import eager_costs
from medusa.decoding.decode_step import GREEDY, SAMPLED
from medusa.decoding.tree_policy import unmeasured_prior
from medusa.tree import TreeSpec

if TYPE_CHECKING:
    from medusa.decoding.engine import LLMEngine

# each bucket's trees are timed in this many interleaved rounds, and each keeps its fastest
TIMING_ROUNDS = 3


def run(engine: LLMEngine, context: int, max_batch: int | None, sampling: bool) -> dict[int, str]:
    """`LLMEngine.warmup` (its docstring says what it does and returns)."""
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 (or None for every batch bucket), got {max_batch}")
    step = engine.runner.decode
    seqs = engine.config.scheduler.max_num_seqs
    most = seqs if max_batch is None else min(max_batch, seqs)
    buckets = sorted({step.bucket(b) for b in range(1, most + 1)})
    accuracies = None
    if engine.heads is not None:
        accuracies = engine.heads.config.accuracies or unmeasured_prior(engine.heads.config.num_heads)
    if not step.use_graphs:
        if not accuracies or len(engine.scheduler.trees) == 1:
            return {}  # nothing to capture, nothing to choose: the token budget's tree runs
        return _estimate_costs(engine, buckets, accuracies, context)
    engine.runner.prefill.capture_all()
    if not accuracies or len(engine.scheduler.trees) == 1:
        # nothing to choose (plain decoding, or one tree: `spec_bench.py --pin-tree`): the token budget's
        # tree, captured where it stays under max_graph_tokens (other buckets capture at first use)
        fixed = [b for b in buckets if _fits(engine, b, engine.scheduler.tree_for(b))]
        for bucket in fixed:
            step.capture(engine._device_tree(engine.scheduler.tree_for(bucket)), bucket)
        _capture_mixed(engine, fixed, lambda bucket: [engine.scheduler.tree_for(bucket)], sampling)
        return {b: engine.scheduler.tree_for(b).label for b in buckets}
    for bucket in buckets:
        trees = [tree for tree in engine.scheduler.trees
                 if _fits(engine, bucket, tree) and engine.policy.add_prior(tree, accuracies)]
        _time_trees(engine, bucket, trees, context)
    engine.scheduler.policy = engine._measured_tree
    timed = [b for b in buckets if b in engine.policy.step_cost]
    # the trees each bucket tries first: with only the chosen tree's and the plain step's, a first run at 32
    # requests captured 9 mixed graphs of the trees it tried and settled on (0.60 s: 1.07x plain against 1.65x
    # without them, H100, session 41)
    _capture_mixed(engine, timed, engine.policy.trial_trees, sampling)
    if sampling:
        _capture_sampled_trials(engine, timed, engine.policy.trial_trees)
    return {b: engine.policy.choose(b).label for b in buckets}


def _estimate_costs(engine: LLMEngine, buckets: list[int], accuracies, context: int) -> dict[int, str]:
    """`run` without graphs: the policy's step costs for every bucket from a few eager steps (once:
    `MedusaModel.engine()` warms a CPU engine up, and a caller's warmup() must not time it again)."""
    if all(b in engine.policy.step_cost for b in buckets):
        return {b: engine.policy.choose(b).label for b in buckets}
    step = engine.runner.decode
    trees = [tree for tree in engine.scheduler.trees if engine.policy.add_prior(tree, accuracies)]
    timed = lambda tree, rows, propose: step.time_step(  # noqa: E731
        engine._device_tree(tree), rows, context, engine.config.num_blocks, repeats=0, propose=propose)
    costs = eager_costs.measure(timed, trees, TreeSpec.load("single"), max(buckets))
    for bucket in buckets:
        for tree in trees:
            if _fits(engine, bucket, tree):
                engine.policy.add_cost(bucket, tree, costs.step(bucket, tree))
        engine.policy.add_heads_cost(bucket, costs.heads_at(bucket))
    engine.scheduler.policy = engine._measured_tree
    return {b: engine.policy.choose(b).label for b in buckets}


def _capture_sampled_trials(engine: LLMEngine, buckets: list[int], captured) -> None:
    """The temperature-only step of every tree timed at each bucket but those `captured(bucket)` (with
    `_capture_mixed`'s). A bucket's trials and revisits run
    trees other than its first, and sampled rows accept less than the greedy priors say, so they often
    settle elsewhere; their greedy graphs are captured by the timing, their sampled ones were not: on an
    H200 the first run of a level captured 3-10 of them (55-85 ms each), 0.73-0.90x of plain decoding
    against 1.15-1.41x once captured (benchmarks/RESULTS.md, session 23)."""
    step = engine.runner.decode
    for bucket in buckets:
        done = captured(bucket)
        for tree in engine.policy.step_cost[bucket]:
            if tree.num_nodes > 1 and tree not in done:
                step.capture(engine._device_tree(tree), bucket, sampling=SAMPLED)


def _time_trees(engine: LLMEngine, bucket: int, trees: list[TreeSpec], context: int) -> None:
    """Give the policy each tree's graph-timed step at this bucket: the fastest of TIMING_ROUNDS rounds
    that time every tree in turn, so a drift of the GPU's speed lands on all of them (two trees of one
    tensor-core tile were timed 1% apart by one lease's warmup, 10% apart by another lease's step_parts).

    A plain step that stays plain skips the heads: that is its cost. The variant with heads (a trial's,
    the step before a revisit, or plain decoding's re-timing step amid speculation) is captured and timed
    now, not mid-run: the policy charges those steps without the heads' part."""
    step, fastest = engine.runner.decode, {}
    for _ in range(TIMING_ROUNDS):
        for tree in trees:
            plain = tree.num_nodes == 1
            variants = (False, True) if plain else (True,)  # proposing or not
            for propose in variants:
                seconds = step.time_step(engine._device_tree(tree), bucket, context, engine.config.num_blocks,
                                         propose=propose)
                fastest[tree, propose] = min(fastest.get((tree, propose), seconds), seconds)
    for tree in trees:
        if tree.num_nodes == 1:
            engine.policy.add_cost(bucket, tree, fastest[tree, False])
            engine.policy.add_heads_cost(bucket, fastest[tree, True] - fastest[tree, False])
        else:
            engine.policy.add_cost(bucket, tree, fastest[tree, True])


def _fits(engine: LLMEngine, bucket: int, tree: TreeSpec) -> bool:
    """Whether warmup captures (and times) `tree` at this batch bucket: plain steps always, trees while
    bucket x nodes stays within max_graph_tokens (larger ones would cost warmup more than they return)."""
    return tree.num_nodes == 1 or bucket * tree.num_nodes <= engine.config.max_graph_tokens


def _capture_mixed(engine: LLMEngine, buckets: list[int], trees, sampling: bool = False) -> None:
    """Capture, for each batch bucket, the decode graphs of `trees(bucket)` carrying each prompt token
    bucket a mixed step may carry: captured at first use, a level's first requests would wait for
    dozens of captures (session 11, the default model at 32 requests: 19,819 tok/s, then 32,018).
    With `sampling`, their sampling variants too, with and without prompts (the greedy steps without
    prompts are captured already, where warmup timed or captured its trees)."""
    prefill = engine.runner.prefill
    sizes = [b for b in prefill.buckets if b <= engine.mixed_prompt_tokens]
    step = engine.runner.decode
    for bucket in buckets:
        for tree in trees(bucket):
            proposals = [engine.policy.proposes(bucket, tree)]
            if tree.num_nodes == 1 and bucket in engine.policy.step_cost:
                # a timed bucket's plain steps run the heads while it may speculate, not once it settles
                # on plain decoding: two graphs of each shape (a GPU test caught the second one captured
                # by a sampled request's first steps)
                proposals = [True, False]
            shapes = [(GREEDY, size) for size in sizes]
            if sampling:  # temperature-only rows: a request filtering by top-k/top-p captures its own
                shapes += [(SAMPLED, 0)] + [(SAMPLED, size) for size in sizes]
            for propose in proposals:
                for sampled, size in shapes:
                    step.capture(engine._device_tree(tree), bucket, sampling=sampled, propose=propose,
                                 prompts=prefill.static_segment(size) if size else None)
