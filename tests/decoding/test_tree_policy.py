"""The measured tree policy: step costs and predicted acceptance pick the tree, observations correct it."""

from medusa.decoding.engine import LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.tree_policy import MARGIN, REVISIT_STEPS, TRIAL_STEPS, WALL_WINDOW
from tiny_models import tiny_decoder


def engine_with_costs(costs, prior):
    model, heads = tiny_decoder(24, logit_scale=3, num_heads=4)
    engine = LLMEngine(model, heads)
    trees = {t.num_nodes: t for t in engine.scheduler.trees}
    for bucket, row in costs.items():
        for n, seconds in row.items():
            engine.policy.add_cost(bucket, trees[n], seconds)
    engine.policy.prior = {trees[n]: e for n, e in prior.items()}
    engine.scheduler.policy = engine.policy.choose  # on the CPU the bucket is the batch size
    return engine, trees


def test_bigger_batches_get_smaller_trees_from_measured_costs():
    # bucket 1: a 64-node step costs little more than a plain one; bucket 8: it costs 3x
    costs = {1: {1: 1.0, 4: 1.0, 64: 1.1}, 8: {1: 1.0, 4: 1.1, 64: 3.0}}
    engine, trees = engine_with_costs(costs, {1: 1.0, 4: 1.6, 64: 2.5})
    assert engine.scheduler.tree_for(1) is trees[64]
    assert engine.scheduler.tree_for(8) is trees[4]


def test_observed_acceptance_overrides_an_optimistic_prediction():
    costs = {1: {1: 1.0, 4: 1.05, 64: 1.3}}
    engine, trees = engine_with_costs(costs, {1: 1.0, 4: 1.6, 64: 2.5})
    policy = engine.policy
    assert engine.scheduler.tree_for(1) is trees[64]
    policy.observe(trees[64], 1100, 1000)  # really 1.1 tokens per step: not worth 1.3x the cost
    # heads that deliver 0.1 of the 1.5 extra tokens predicted will not deliver 0.6 on a smaller tree
    assert policy.expected_length(trees[4]) < 1.05 and engine.scheduler.tree_for(1) is trees[1]
    policy.observe(trees[4], 1500, 1000)  # but a tree's own observations outweigh the calibration
    assert abs(policy.expected_length(trees[4]) - 1.5) < 0.01 and engine.scheduler.tree_for(1) is trees[4]


def test_what_heads_accept_on_one_tree_recalibrates_the_untried_trees():
    from medusa.decoding.tree_policy import CALIBRATION_TOKENS

    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.0, 64: 1.0}}, {1: 1.0, 4: 1.6, 64: 2.5})
    policy = engine.policy
    assert policy.calibration() == 1.0 and policy.expected_length(trees[4]) == 1.6
    policy.observe(trees[64], 4 + 3, 4)  # 0.75 extra tokens a step where 1.5 were predicted
    c = (3 + CALIBRATION_TOKENS) / (6 + CALIBRATION_TOKENS)
    assert abs(policy.calibration() - c) < 1e-12
    assert abs(policy.expected_length(trees[4]) - (1 + 0.6 * c)) < 1e-12  # untried: the calibrated prior
    policy.observe(trees[4], 2 * 100, 100)  # heads better than predicted on the small tree lift the big one
    assert policy.calibration() > 1.0 and policy.expected_length(trees[64]) > 2.5 * 16 / 20


def test_random_heads_stop_being_tried_after_a_few_steps_of_each_tree():
    """Heads without accuracies that accept nothing, on the engine's own trees, in a simulated
    run of 2000 steps at one row (costs like a 1B shape's on an H200): session 7 measured 248
    speculative steps of 2015 there, 0.97x. Each tree now runs its trials and is dropped."""
    from medusa.decoding.tree_policy import unmeasured_prior

    engine, _ = engine_with_costs({}, {})
    policy, prior = engine.policy, unmeasured_prior(4)
    graph = {1: 1.2, 4: 1.25, 8: 1.3, 16: 1.35, 32: 1.45, 64: 1.6}  # ms, without the heads for plain
    for tree in engine.scheduler.trees:
        assert policy.add_prior(tree, prior)
        policy.add_cost(1, tree, graph[tree.num_nodes])
    policy.add_heads_cost(1, 0.15)
    speculative = 0
    for _ in range(2000):
        tree = engine.scheduler.tree_for(1)
        proposed = policy.proposes(1, tree)
        speculative += tree.num_nodes > 1
        policy.observe(tree, 1, 1)
        policy.observe_step(1, tree, graph[tree.num_nodes] + 0.2 + (0.15 if proposed and tree.num_nodes == 1 else 0),
                            proposed)
    assert policy.decision[1].num_nodes == 1
    assert speculative <= 4 * TRIAL_STEPS + 2000 // REVISIT_STEPS + 4, speculative


def test_decode_steps_record_what_each_tree_emitted_and_took():
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.0}}, {1: 1.0, 4: 3.0})
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    observed = engine.policy.observed
    assert sum(steps for _, steps in observed.values()) == out.stats.steps
    assert sum(emitted for emitted, _ in observed.values()) == sum(out.stats.accepted_lengths)
    wall = engine.policy.wall[1]  # every decode step's wall time, at batch size 1
    assert sum(w.steps for w in wall.values()) == out.stats.steps
    assert wall[trees[4]].steps >= TRIAL_STEPS and wall[trees[1]].steps >= TRIAL_STEPS  # both were tried
    assert all(w.seconds > 0 for w in wall.values())


def timed(policy, bucket, tree, seconds):
    for _ in range(TRIAL_STEPS):
        policy.observe_step(bucket, tree, seconds)


def test_measured_wall_time_keeps_speculation_only_where_it_beats_plain_on_the_clock():
    costs = {1: {1: 1.0, 4: 1.05, 64: 1.3}}  # graph times favour the trees
    engine, trees = engine_with_costs(costs, {1: 1.0, 4: 1.6, 64: 2.5})
    policy = engine.policy
    assert engine.scheduler.tree_for(1) is trees[64]  # the graph's choice runs first...
    timed(policy, 1, trees[64], 3.0)  # ...and the host makes its step cost 3.0, not 1.3
    # the untried 4-node tree is charged its graph time plus the host time measured for trees
    assert abs(policy.cost(1, trees[4]) - (1.05 + 1.7)) < 1e-9
    assert engine.scheduler.tree_for(1) is trees[1]  # plain is tried before anything is decided
    timed(policy, 1, trees[1], 1.2)
    assert engine.scheduler.tree_for(1) is trees[1]  # 1 token / 1.2 beats 2.5 / 3.0 and 1.6 / 2.75
    for _ in range(REVISIT_STEPS - TRIAL_STEPS - 1):
        policy.observe_step(1, trees[1], 1.2)
    assert engine.scheduler.tree_for(1) is trees[1]
    policy.observe_step(1, trees[1], 1.2)  # a long plain run: the best tree gets one step to re-measure
    assert engine.scheduler.tree_for(1) is trees[64]
    for _ in range(WALL_WINDOW // 2 + 1):  # the host got faster: the median follows a few steps
        policy.observe_step(1, trees[64], 1.3)
    assert policy.wall[1][trees[64]].steps == TRIAL_STEPS + WALL_WINDOW // 2 + 1
    assert policy.cost(1, trees[64]) == 1.3
    assert engine.scheduler.tree_for(1) is trees[64]  # 2.5 / 1.3 beats 1 / 1.2


def test_speculative_trees_are_charged_their_graph_time_plus_one_pooled_host_time():
    """Session 21, one request on an H200: two trees of one tile (0.750 / 0.743 ms as graphs) were charged
    their own wall medians, the decided one's from long contexts, the other's from a few revisit steps, and
    the smaller tree won on a cost difference the graphs did not show. Both now pay the pooled host time."""
    engine, trees = engine_with_costs({1: {1: 0.5, 4: 0.75, 8: 0.75}}, {1: 1.0, 4: 2.0, 8: 2.1})
    policy = engine.policy
    timed(policy, 1, trees[1], 0.5)
    for _ in range(100):
        policy.observe_step(1, trees[8], 0.80)  # the decided tree: 50 us of host time a step
    timed(policy, 1, trees[4], 0.70)  # a revisit's few steps, at short contexts: 50 us under its graph
    host = (100 * 0.05 - TRIAL_STEPS * 0.05) / (100 + TRIAL_STEPS)
    assert abs(policy.cost(1, trees[4]) - (0.75 + host)) < 1e-12
    assert policy.cost(1, trees[4]) == policy.cost(1, trees[8])
    assert engine.scheduler.tree_for(1) is trees[8]  # own medians would charge 0.70 against 0.80: 2.86 > 2.63
    assert policy.cost(1, trees[1]) == 0.5  # plain decoding keeps its own wall time


def test_one_slow_step_does_not_hand_a_batch_size_to_a_slower_tree():
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.05}}, {1: 1.0, 4: 1.6})
    policy = engine.policy
    timed(policy, 1, trees[4], 2.0)  # 1.6 tokens per 2.0: plain decoding's 1 per 1.0 is better...
    for seconds in (1.0, 1.0, 9.0, 1.0):  # ...but a garbage-collector pause hit one of its trial steps
        policy.observe_step(1, trees[1], seconds)
    assert policy.cost(1, trees[1]) == 1.0  # the median of its steps, not a mean that one pause lifts
    assert engine.scheduler.tree_for(1) is trees[1]
    policy.observe_step(1, trees[4], 9.0)
    policy.observe_step(1, trees[4], 9.0)
    assert policy.cost(1, trees[4]) == 2.0  # two slow steps in five: still the median


def test_speculation_must_beat_plain_by_the_margin():
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.0}}, {1: 1.0, 4: 1.0})
    policy = engine.policy
    timed(policy, 1, trees[1], 1.0)
    assert 1.05 < MARGIN < 1.15
    for gain, chosen in ((1.05, 1), (1.15, 4)):  # tokens per second over plain decoding's
        policy.prior[trees[4]] = 1.3 * gain  # accepted length of a step that costs 1.3 plain steps
        timed(policy, 1, trees[4], 1.3)
        assert engine.scheduler.tree_for(1) is trees[chosen]


def test_a_speculating_batch_size_re_times_plain_decoding_now_and_then():
    """An unlucky trial made plain decoding look dear, so speculation won; one plain step every
    REVISIT_STEPS (proposing for the speculative step after it) corrects that."""
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.05}}, {1: 1.0, 4: 1.3})
    policy = engine.policy
    timed(policy, 1, trees[4], 1.3)
    timed(policy, 1, trees[1], 2.0)  # really 1.0
    revisits = 0
    for step in range(10 * REVISIT_STEPS):
        tree = engine.scheduler.tree_for(1)
        if tree is trees[1]:
            if policy.decision[1] is trees[1]:
                break  # settled on plain
            assert policy.run[1] == (True, REVISIT_STEPS) and policy.proposes(1, tree)
            revisits += 1
        policy.observe_step(1, tree, 1.0 if tree is trees[1] else 1.3)
    assert step > REVISIT_STEPS and revisits == WALL_WINDOW // 2 + 1  # the median is plain's real cost now
    assert policy.cost(1, trees[1]) == 1.0 and not policy.proposes(1, trees[1])


def test_larger_batch_sizes_borrow_plain_decoding_from_a_smaller_one_instead_of_trying_trees():
    sizes = (4, 8, 16, 64)
    engine, trees = engine_with_costs({b: {1: 1.0, 4: 1.1, 8: 1.2} for b in sizes}, {1: 1.0, 4: 1.4, 8: 1.6})
    policy = engine.policy
    assert [engine.scheduler.tree_for(b) for b in sizes] == [trees[8]] * 4  # nothing decided: trees first
    timed(policy, 8, trees[8], 2.0)
    timed(policy, 8, trees[1], 1.0)
    assert policy.decision == {8: trees[1]}
    assert engine.scheduler.tree_for(16) is trees[1] and engine.scheduler.tree_for(64) is trees[1]
    assert policy.trial_trees(64) == [trees[1]]
    assert not policy.may_speculate(64) and not policy.proposes(64, trees[1])
    for _ in range(2 * REVISIT_STEPS):  # borrowed: no trial, no revisit
        assert engine.scheduler.tree_for(64) is trees[1]
        policy.observe_step(64, trees[1], 1.0)
    assert engine.scheduler.tree_for(4) is trees[8]  # a smaller batch size still tries its trees
    timed(policy, 16, trees[4], 1.05)  # where a batch size has tried a tree itself, its own timings rule
    assert engine.scheduler.tree_for(16) is trees[8]
    policy.prior[trees[8]] = 4.0  # batch size 8 finds speculation pays after all...
    policy.observe_step(8, trees[8], 2.0)
    assert policy.decision[8] is trees[8]
    assert engine.scheduler.tree_for(64) is trees[8]  # ...so 64 no longer borrows plain: it tries trees


def test_a_wall_time_of_a_tree_is_kept_per_batch_size():
    costs = {1: {1: 1.0, 4: 1.05}, 8: {1: 1.0, 4: 1.05}}
    engine, trees = engine_with_costs(costs, {1: 1.0, 4: 1.6})
    timed(engine.policy, 8, trees[4], 5.0)
    timed(engine.policy, 8, trees[1], 1.0)
    assert engine.scheduler.tree_for(8) is trees[1]
    assert engine.scheduler.tree_for(1) is trees[4]  # batch 1 has its own (graph) costs


def test_heads_without_accuracies_get_a_cautious_prior_that_observation_overrides():
    """Random heads (no measured accuracies) start from the stand-in prior; once the trees
    are seen to accept nothing, plain decoding wins on equal costs."""
    from medusa.decoding.tree_policy import unmeasured_prior

    prior = unmeasured_prior(4)
    assert len(prior) == 4 and all(len(row) == 10 for row in prior)
    assert all(0 < a < 0.31 for row in prior for a in row)
    assert all(row[0] > row[1] for row in prior) and all(prior[h][0] > prior[h + 1][0] for h in range(3))
    costs = {1: 1.0, 4: 1.02, 64: 1.1}
    engine, trees = engine_with_costs({1: costs}, {})
    policy = engine.policy
    for n in costs:
        assert policy.add_prior(trees[n], prior)
    assert policy.expected_length(trees[64]) > policy.expected_length(trees[4]) > 1.0
    assert engine.scheduler.tree_for(1) is trees[64]  # the guess is worth trying...
    for n, seconds in costs.items():
        policy.observe(trees[n], 1000, 1000)  # ...but nothing is ever accepted
        timed(policy, 1, trees[n], seconds)
    assert engine.scheduler.tree_for(1) is trees[1]


def test_plain_steps_skip_the_heads_unless_the_next_step_may_speculate():
    costs = {1: {1: 1.0, 4: 1.05}, 8: {1: 1.0}}
    engine, trees = engine_with_costs(costs, {1: 1.0, 4: 1.6})
    policy = engine.policy
    assert policy.proposes(1, trees[4])  # a speculative step always proposes for the next one
    assert policy.proposes(2, trees[1])  # no timed trees at this size (the CPU, say): as before
    assert not policy.proposes(8, trees[1])  # plain is all this size runs
    timed(policy, 1, trees[4], 5.0)
    timed(policy, 1, trees[1], 1.0)
    assert engine.scheduler.tree_for(1) is trees[1] and not policy.proposes(1, trees[1])
    for _ in range(REVISIT_STEPS - TRIAL_STEPS - 1):
        policy.observe_step(1, trees[1], 1.0)
    assert policy.proposes(1, trees[1])  # the step after this one revisits the tree: it needs proposals
    policy.observe_step(1, trees[1], 1.0)
    assert engine.scheduler.tree_for(1) is trees[4]


def test_an_engine_settled_on_plain_decoding_skips_the_heads_and_their_top_k_and_keeps_its_output():
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.05}}, {1: 1.0, 4: 1.6})
    timed(engine.policy, 1, trees[4], 5.0)
    timed(engine.policy, 1, trees[1], 1.0)
    calls = []
    step = engine.runner.decode
    heads = step.heads
    step.heads = lambda *a, **k: calls.append(1) or heads(*a, **k)
    step.topk = step.topk[:0]  # [0, K, kmax]: reading or writing any row's top-k would raise
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = engine.generate([[5, 6, 7]], params)[0]
    plain = LLMEngine(engine.model, None).generate([[5, 6, 7]], params)[0]
    assert out.token_ids == plain.token_ids
    assert out.stats.steps == 23 and calls == []  # not even for the new row's first proposals
    assert engine.stats().steps_per_tree == {trees[1].name: 23}


def test_what_one_lookup_tree_accepts_beyond_its_prior_lifts_the_other_lookup_trees():
    from medusa.decoding.tree_policy import TreePolicy
    from medusa.tree import TreeSpec

    small, big = TreeSpec.load("tree-4").with_lookup(4), TreeSpec.load("tree-16").with_lookup(4)
    heads_only = TreeSpec.load("tree-8")
    policy = TreePolicy()
    policy.prior = {small: 1.5, big: 2.0, heads_only: 1.8}
    assert policy.lookup_bonus() == 0.0 and policy.expected_length(big) == 2.0
    policy.observe(small, 2500, 1000)  # 2.5 tokens per step where the heads predicted 1.5
    assert abs(policy.lookup_bonus() - 1.0) < 1e-9
    assert abs(policy.expected_length(big) - 3.0) < 1e-9  # never observed: its prior + the chain's 1.0
    assert policy.expected_length(heads_only) == 1.8  # no chain, no bonus
    policy.observe(heads_only, 1000, 1000)
    policy.observe(small, 0, 1000)  # the chain now looks worthless: the bonus never goes negative
    assert policy.lookup_bonus() == 0.0


def test_plain_trial_steps_that_run_the_heads_are_charged_without_them():
    """A plain trial step runs the heads for the speculative step after it; settled plain decoding
    does not. Charged as measured, plain would look 1.3x dearer and a losing tree would win."""
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.05}}, {1: 1.0, 4: 1.3})
    policy = engine.policy
    policy.add_heads_cost(1, 0.3)
    timed(policy, 1, trees[4], 1.4)  # 1.3 tokens per 1.4 s: a loss against plain's 1 per 1.0 s
    for _ in range(TRIAL_STEPS):
        policy.observe_step(1, trees[1], 1.3, proposed=True)  # 1.0 s of plain step + 0.3 s of heads
    assert policy.cost(1, trees[1]) == 1.0
    assert policy.decision[1] is trees[1] and not policy.proposes(1, trees[1])
    for _ in range(3):  # faster than its graph time (contexts shorter than warmup's): the same share goes
        policy.observe_step(1, trees[1], 0.9, proposed=True)
    assert abs(policy.cost(1, trees[1]) - 0.9 / 1.3) < 1e-12
    policy.observe_step(1, trees[1], 1.3)  # a step without the heads is charged as measured
    assert list(policy.wall[1][trees[1]].recent)[-1] == 1.3


def test_trees_scoring_near_the_best_are_tried_before_a_batch_size_decides():
    """Priors cannot rank trees within a few percent of each other: each such tree runs its trials.
    Here the 16-node tree's prior is 5% below the 64-node tree's but it really accepts more."""
    from medusa.decoding.tree_policy import TRIAL_BAND

    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.0, 16: 1.0, 64: 1.0}}, {1: 1.0, 4: 1.2, 16: 2.28, 64: 2.4})
    policy = engine.policy
    assert 2.4 / 2.28 < TRIAL_BAND < 2.4 / 1.2
    assert policy.trial_trees(1) == [trees[64], trees[16], trees[1]]  # what warmup captures mixed graphs of
    ran = []
    for _ in range(6 * TRIAL_STEPS):
        tree = engine.scheduler.tree_for(1)
        ran.append(tree.num_nodes)
        accepted = {1: 1.0, 4: 1.2, 16: 2.6, 64: 2.2}[tree.num_nodes]
        policy.observe(tree, accepted * 100, 100)
        policy.observe_step(1, tree, 1.0)
    assert ran[:3 * TRIAL_STEPS] == [64] * TRIAL_STEPS + [16] * TRIAL_STEPS + [1] * TRIAL_STEPS
    assert 4 not in ran  # half the best's score: not worth a trial
    assert policy.decision[1] is trees[16] and set(ran[3 * TRIAL_STEPS:]) == {16}



def test_trees_scoring_near_plain_decoding_are_tried_before_a_batch_size_settles_on_it():
    """Where plain decoding scores best by a little (a CPU's trees cost about what they return), priors
    cannot say whether speculation pays: the trees within TRIAL_BAND of plain decoding run their trials,
    and here the 4-node tree, whose lookup-free prior undersells it, wins. A tree far below is not tried."""
    from medusa.decoding.tree_policy import TRIAL_BAND

    engine, trees = engine_with_costs({1: {1: 1.0, 4: 2.0, 64: 4.0}}, {1: 1.0, 4: 2.1, 64: 2.6})
    policy = engine.policy
    plain_score = policy.score(1, trees[1])
    assert plain_score / TRIAL_BAND <= policy.score(1, trees[4]) < plain_score
    assert policy.score(1, trees[64]) < plain_score / TRIAL_BAND
    assert policy.trial_trees(1) == [trees[1], trees[4]]
    ran = []
    for _ in range(4 * TRIAL_STEPS):
        tree = engine.scheduler.tree_for(1)
        ran.append(tree.num_nodes)
        policy.observe(tree, {1: 1.0, 4: 2.6, 64: 2.6}[tree.num_nodes] * 100, 100)
        policy.observe_step(1, tree, {1: 1.0, 4: 2.0, 64: 4.0}[tree.num_nodes])
    assert ran[: 2 * TRIAL_STEPS] == [1] * TRIAL_STEPS + [4] * TRIAL_STEPS
    assert 64 not in ran and policy.decision[1] is trees[4] and set(ran[2 * TRIAL_STEPS:]) == {4}


def test_a_batch_size_is_settled_on_its_decision_not_on_its_trials_or_revisits():
    """What `LLMEngine._may_carry` asks before capturing a mixed graph for a step's tree."""
    engine, trees = engine_with_costs({8: {1: 1.0, 4: 1.05}, 16: {1: 1.0, 4: 1.05}}, {1: 1.0, 4: 1.3})
    policy = engine.policy
    assert policy.settled_on(2, trees[4]) and policy.settled_on(2, trees[1])  # no measured policy there
    assert not policy.settled_on(8, trees[4]) and not policy.settled_on(8, trees[1])  # on trial
    timed(policy, 8, trees[4], 1.05)  # 1.3 tokens for 1.05 s: beats plain by more than the margin
    timed(policy, 8, trees[1], 1.0)
    assert policy.decision[8] is trees[4]
    assert policy.settled_on(8, trees[4]) and not policy.settled_on(8, trees[1])  # plain: a revisit's tree
    timed(policy, 16, trees[4], 3.0)
    timed(policy, 16, trees[1], 1.0)
    assert policy.settled_on(16, trees[1]) and not policy.settled_on(16, trees[4])
    policy.step_cost[64] = dict(policy.step_cost[16])
    policy.plain[64] = trees[1]
    assert 64 not in policy.decision and policy.settled_on(64, trees[1])  # borrowed plain decoding
    assert not policy.settled_on(64, trees[4])


def near_trees():
    """Stand-ins for an H200's 12- and 36-node trees that do not hold each other (each has a head path
    the other lacks), so neither's acceptance is counted from the other's steps -> {nodes: tree}."""
    from medusa.tree import TreeSpec

    small = TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (9,)], name="small")
    big = TreeSpec.from_paths([(i,) for i in range(8)] + [(0, j) for j in range(8)] + [(1, j) for j in range(8)]
                              + [(0, 0, j) for j in range(7)], name="big")
    return {1: TreeSpec.from_paths([], name="single"), small.num_nodes: small, big.num_nodes: big}


def run_policy(policy, trees, costs, real, steps, engine_trees=False):
    """Steps at one row; each tree accepts `real` tokens a step except the 8-node tree's first
    TRIAL_STEPS steps (an unlucky trial at a request's start: 1.8). -> the trees run, in order.
    engine_trees: observed as `trees`' own objects, as the engine's steps report the trees it made."""
    ran = []
    for _ in range(steps):
        tree = policy.choose(1)
        tree = trees[tree.num_nodes] if engine_trees else tree
        ran.append(tree.num_nodes)
        unlucky = tree.num_nodes == 8 and ran.count(8) <= TRIAL_STEPS
        policy.observe(tree, 1.8 if unlucky else real[tree.num_nodes], 1)
        policy.observe_step(1, tree, costs[1][tree.num_nodes])
    return ran


def policy_with(trees, costs, prior):
    from medusa.decoding.tree_policy import TreePolicy

    policy = TreePolicy()
    for n, seconds in costs[1].items():
        policy.add_cost(1, trees[n], seconds)
    policy.prior = {trees[n]: e for n, e in prior.items()}
    return policy


def test_a_near_tree_left_behind_by_an_unlucky_trial_is_revisited_and_takes_over(monkeypatch):
    """Session 17 on an H200 at one request: `searched-8+lookup4`'s five trial steps left it at 2.02
    tokens (2.46 once run), so `searched-32+lookup4` ran at 2.27 tokens per ms against its 2.66 by its
    measured acceptance and step cost (here two trees of 8 and 32 nodes, neither inside the other,
    stand for them). Revisits of near trees every TREE_REVISIT_STEPS steps correct that; without them
    the decision stays."""
    import medusa.decoding.tree_policy as tree_policy

    costs = {1: {1: 0.6, 8: 0.92, 32: 1.2}}
    prior, real = {1: 1.0, 8: 2.02, 32: 2.72}, {1: 1.0, 8: 2.46, 32: 2.72}
    trees = near_trees()
    assert sorted(trees) == [1, 8, 32]
    policy = policy_with(trees, costs, prior)
    ran = run_policy(policy, trees, costs, real, 1000)
    assert ran[:3 * TRIAL_STEPS] == [32] * TRIAL_STEPS + [8] * TRIAL_STEPS + [1] * TRIAL_STEPS
    first = ran.index(32, 3 * TRIAL_STEPS)
    assert policy.decision[1] is trees[8]
    switched = next(i for i in range(first, len(ran)) if ran[i:i + 50] == [8] * 50)
    assert switched < first + 3 * tree_policy.TREE_REVISIT_STEPS
    # revisits are short and rare: after the switch the 32-node tree is not within TRIAL_BAND of the best
    assert ran[switched:].count(8) > 0.95 * len(ran[switched:])

    monkeypatch.setattr(tree_policy, "TREE_REVISIT_STEPS", 10 ** 9)  # no revisits: the trial's verdict stands
    policy = policy_with(trees, costs, prior)
    ran = run_policy(policy, trees, costs, real, 1000)
    assert policy.decision[1] is trees[32] and {n for n in ran[-500:] if n > 1} == {32}  # plain: revisits


def test_a_copied_policy_decides_as_the_original_on_the_engines_trees():
    """LLMEngine.sampled_policy is a deep copy of the greedy policy, driven with the engine's own trees: its
    decisions and revisits compare trees by identity, so the copy must hold those same trees (a copy that
    copied them never ended a revisit)."""
    import copy

    costs = {1: {1: 0.6, 8: 0.92, 32: 1.2}}
    prior, real = {1: 1.0, 8: 2.02, 32: 2.72}, {1: 1.0, 8: 2.46, 32: 2.72}
    trees = near_trees()
    ran = run_policy(policy_with(trees, costs, prior), trees, costs, real, 1000)
    copied = copy.deepcopy(policy_with(trees, costs, prior))
    assert run_policy(copied, trees, costs, real, 1000, engine_trees=True) == ran


def test_a_tree_inside_the_decided_one_is_not_revisited():
    """Every step of the decided tree counts what a tree inside it would have emitted, and both are
    charged graph time plus one pooled host time: a revisit of the smaller tree would learn nothing and
    run a tree that emits less (session 22: 4.8% of Spec-Bench's steps)."""
    engine, trees = engine_with_costs({1: {1: 0.6, 8: 0.92, 32: 0.95}}, {1: 1.0, 8: 2.5, 32: 2.72})
    policy = engine.policy
    assert trees[8] in policy._inside(trees[32])
    ran = []
    for _ in range(1000):
        tree = engine.scheduler.tree_for(1)
        ran.append(tree.num_nodes)
        policy.observe(tree, {1: 1.0, 8: 2.5, 32: 2.72}[tree.num_nodes], 1)
        policy.observe_step(1, tree, {1: 0.6, 8: 0.92, 32: 0.95}[tree.num_nodes])
    assert policy.decision[1] is trees[32] and 2.5 / 0.92 > 2.72 / 0.95 / 1.1  # within TRIAL_BAND of it
    assert ran[:3 * TRIAL_STEPS] == [32] * TRIAL_STEPS + [8] * TRIAL_STEPS + [1] * TRIAL_STEPS
    assert 8 not in ran[3 * TRIAL_STEPS:]  # its trial only


def test_a_tree_is_expected_to_accept_at_least_what_a_tree_inside_it_accepts():
    """A tree holding every node of another (head paths and lookup chain) accepts at least what that one
    does, so a few unlucky steps of the larger tree cannot hand a batch size to its subtree at the same
    step cost; a tree missing one of its nodes, or its lookup chain, gets no such floor."""
    from medusa.decoding.tree_policy import TreePolicy
    from medusa.tree import TreeSpec

    small = TreeSpec.from_paths([(0,), (1,)], name="small").with_lookup(2)
    big = TreeSpec.from_paths([(0,), (1,), (0, 0)], name="big").with_lookup(2)
    other = TreeSpec.from_paths([(0,), (0, 0), (2,)], name="other").with_lookup(2)  # lacks small's (1,)
    no_chain = TreeSpec.from_paths([(0,), (1,), (0, 0)], name="no-chain")
    policy = TreePolicy()
    policy.prior = {small: 1.5, big: 1.6, other: 1.6, no_chain: 1.4}
    for tree in (small, big, other, no_chain):
        policy.add_cost(1, tree, 1e-3)
    policy.observe(small, 2800, 1000)  # 2.8 tokens a step over many steps
    for tree in (big, other, no_chain):
        policy.observe(tree, 4, 4)  # one token a step over a few unlucky ones
    assert policy._own_length(big) < policy.expected_length(small) <= policy.expected_length(big)
    assert policy.score(1, big) >= policy.score(1, small)
    assert policy.expected_length(other) == policy._own_length(other) < policy.expected_length(small)
    assert policy.expected_length(no_chain) == policy._own_length(no_chain) < policy.expected_length(small)


def test_a_step_of_a_tree_counts_what_the_trees_inside_it_would_have_emitted():
    """For a row's deepest accepted node, a tree inside the running one emits 1 + the depth of the
    deepest node of that path it holds; only its own observations move, not the shared corrections."""
    import numpy as np

    from medusa.decoding.tree_policy import TreePolicy, _emitted_within
    from medusa.tree import TreeSpec

    big = TreeSpec.from_paths([(0,), (1,), (0, 0)], name="big").with_lookup(2)  # nodes: root, 0, 1, 00, L1, L2
    small = TreeSpec.from_paths([(0,)], name="small").with_lookup(1)
    assert _emitted_within(big, small).tolist() == [1, 2, 1, 2, 2, 2]
    assert _emitted_within(big, big).tolist() == (big.depths + 1).tolist()
    plain = TreeSpec.from_paths([], name="single")
    policy = TreePolicy()
    policy.prior = {big: 2.0, small: 1.5, plain: 1.0}
    evidence = (policy._heads_evidence, policy._lookup_gain)
    policy.observe_subtrees(big, np.array([3, 5, 2, 0]))
    assert policy.observed == {small: (6, 4)}  # the plain tree always emits one token: nothing to learn
    assert (policy._heads_evidence, policy._lookup_gain) == evidence


def test_the_engine_reports_each_rows_deepest_accepted_node_to_the_policy():
    """The nodes the engine passes are the rows' deepest accepted ones: for the running tree itself they
    give back exactly the tokens each row emitted."""
    from medusa.decoding.tree_policy import _emitted_within

    model, heads = tiny_decoder(24, logit_scale=3, num_heads=4)
    engine = LLMEngine(model, heads)
    calls, count_step, observe = [], engine._count_step, engine.policy.observe_subtrees

    def counting(spec, counts, from_lookup=0, bests=(), policy=None):
        calls.append([spec, list(counts), None])
        return count_step(spec, counts, from_lookup, bests, policy)

    def observing(spec, best_nodes):
        assert calls[-1][0] == spec and calls[-1][2] is None
        calls[-1][2] = best_nodes
        return observe(spec, best_nodes)

    engine._count_step, engine.policy.observe_subtrees = counting, observing
    prompts = [[1 + i, 2, 3, 4 + i] * 3 for i in range(3)]
    engine.generate(prompts, SamplingParams(max_tokens=12))
    trees = [c for c in calls if c[0].num_nodes > 1]
    assert trees and all(c[2] is not None for c in trees)
    for spec, counts, best_nodes in trees:
        assert _emitted_within(spec, spec)[best_nodes].tolist() == counts
