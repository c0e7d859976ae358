"""Scheduler unit tests with a mock model: the test plays the engine's part (no weights)."""

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.scheduler import Scheduler, SchedulerConfig
from medusa.decoding.sequence import Sequence
from medusa.tree import TreeSpec

TREES = [TreeSpec.load("single"), TreeSpec.load("tree-8"), TreeSpec.load("tree-64")]


def make(max_tokens=64, max_seqs=8, tree_tokens=128, blocks=256):
    config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, max_tree_tokens=tree_tokens)
    return Scheduler(config, BlockManager(blocks, 16, enable_prefix_caching=False), TREES)


def mock_step(scheduler, plan, accept=1):
    """What the engine does after the forward: commit prompt chunks; a decode step keeps root + accept-1."""
    for item in plan.scheduled:
        seq = item.seq
        if item.is_prefill:
            scheduler.blocks.commit(seq, item.num_tokens)
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                seq.append_tokens([7])  # the first sampled token: the pending root
        else:
            seq.append_tokens([7] * accept)
            scheduler.blocks.commit(seq, accept)


def test_token_budget_and_chunked_prefill():
    s = make(max_tokens=64)
    long, short = Sequence("long", list(range(150))), Sequence("short", list(range(10)))
    s.add(long)
    s.add(short)
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        assert plan.num_tokens <= 64
        chunks.append([(i.seq.request_id, i.num_tokens, i.is_prefill) for i in plan.scheduled])
        mock_step(s, plan)
    assert chunks[0] == [("long", 64, True)]  # FCFS: the long prompt takes the whole budget
    assert chunks[1] == [("long", 64, True)]
    # the last 22 prompt tokens, then the short prompt fills the rest of the budget
    assert chunks[2] == [("long", 22, True), ("short", 10, True)]


def test_decoding_costs_one_plus_tree_and_tree_shrinks_with_batch():
    s = make(max_tokens=512, max_seqs=64, tree_tokens=128)
    assert s.tree_for(1).num_nodes == 64
    assert s.tree_for(4).num_nodes == 8  # 4 x 64 > 128 >= 4 x 8
    assert s.tree_for(40).num_nodes == 1  # down to plain decoding
    seqs = [Sequence(f"r{i}", [1, 2, 3]) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    mock_step(s, s.schedule())  # all four prefills
    plan = s.schedule()
    assert plan.tree.num_nodes == 8
    assert all(not i.is_prefill and i.num_tokens == 8 for i in plan.scheduled)
    assert plan.num_tokens == 32


def test_max_num_seqs_and_preemption_by_recompute():
    s = make(max_tokens=256, max_seqs=2, blocks=6)
    seqs = [Sequence(f"r{i}", list(range(30))) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    plan = s.schedule()
    assert [i.seq.request_id for i in plan.scheduled] == ["r0", "r1"]  # max_num_seqs caps the batch
    mock_step(s, plan)
    preempted = []
    for _ in range(40):  # decode until the 6 blocks run out
        plan = s.schedule()
        for victim in plan.preempted:  # its KV is dropped; it waits to be recomputed, outputs kept
            assert victim.num_computed_tokens == 0 and not victim.block_table and victim in s.waiting
            assert victim.num_output_tokens > 0
        preempted += [v.request_id for v in plan.preempted]
        mock_step(s, plan, accept=3)
    assert preempted and preempted[0] == "r1"  # the newest running sequence goes first
    s.blocks.check_invariants()


def test_tree_never_exceeds_the_token_budget():
    """A 64-node tree under a 48-token budget would never be scheduled: the tree shrinks to fit."""
    s = make(max_tokens=48, tree_tokens=256)
    assert s.tree_for(1).num_nodes <= 48
    s.policy = lambda n: TREES[-1]  # a measured policy that picks the 64-node tree
    assert s.tree_for(1).num_nodes <= 48
    seq = Sequence("a", list(range(10)))
    s.add(seq)
    mock_step(s, s.schedule())
    plan = s.schedule()
    assert [(i.seq.request_id, i.is_prefill) for i in plan.scheduled] == [("a", False)]


def test_a_policy_without_a_measurement_leaves_the_tree_to_the_budget():
    """warmup(max_batch=...) times some batch sizes only: elsewhere the policy says None and the
    token budget picks the tree, as it does with no policy at all."""
    s = make(max_tokens=512, tree_tokens=256)
    unmeasured = [s.tree_for(n) for n in (1, 2, 8)]
    s.policy = lambda n: TREES[0] if n == 1 else None  # measured at one sequence only
    assert s.tree_for(1) == TREES[0]
    assert [s.tree_for(n) for n in (2, 8)] == unmeasured[1:]


def test_a_tree_too_big_for_the_pool_shrinks_instead_of_preempting_forever():
    """A lone sequence near the pool's end: a 64-node tree cannot be backed even with every other sequence
    preempted, so the step runs the largest tree that fits (it used to preempt itself every step)."""
    s = make(max_tokens=512, blocks=6)  # 96 slots
    seq = Sequence("r", list(range(20)))
    s.add(seq)
    mock_step(s, s.schedule())
    for expected in (64, 8, 8):  # 20 computed: 20 + 64 <= 96; 40 after the first step: 40 + 64 > 96
        plan = s.schedule()
        assert plan.tree.num_nodes == expected and not plan.preempted
        assert [(i.seq, i.num_tokens) for i in plan.scheduled] == [(seq, expected)]
        mock_step(s, plan, accept=20 if expected == 64 else 1)


def test_in_flight_tokens_get_blocks_and_short_blocks_refuse_rather_than_preempt():
    s = make(max_tokens=512, tree_tokens=8, blocks=5)  # 80 slots
    a, b = Sequence("a", list(range(30))), Sequence("b", list(range(30)))
    s.add(a)
    s.add(b)
    mock_step(s, s.schedule())  # both prompts: 31 tokens each, 30 computed, two blocks each
    a.num_inflight_tokens = 4  # a launched step may still add four tokens: its tree goes after them
    plan = s.schedule(preempt=False)
    assert plan.tree.num_nodes == 1 and len(a.block_table) * 16 >= 30 + 4 + 1
    b.num_inflight_tokens = 40
    assert s.schedule(preempt=False) is None  # b's worst case needs more than the free block
    assert s.running == [a, b] and not s.waiting  # nothing was preempted
    b.num_inflight_tokens = 0
    assert not s.schedule().preempted
