"""Without CUDA graphs (a CPU) warmup times a few eager steps; the measured policy starts from costs read off them."""

import pytest

from medusa.decoding import eager_costs
from medusa.decoding.eager_costs import EAGER_ROUNDS, EagerCosts, ladder_rows, measure
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import TreeSpec
from engine_driver import random_prompts, single_thread
from tiny_models import tiny_decoder

VOCAB = 24
SINGLE, TREE = TreeSpec.load("single"), TreeSpec.load("tree-8")


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def engine_of(model, heads, max_num_seqs=4):
    return LLMEngine(model, heads, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                                          max_num_batched_tokens=256)))


def test_ladder_rows_double_up_to_the_batch_or_the_ladders_top():
    assert ladder_rows(1) == [1]
    assert ladder_rows(5) == [1, 2, 4]
    assert ladder_rows(64) == [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= eager_costs.LADDER_ROWS]


def test_costs_read_plain_steps_off_the_ladder_and_add_each_rows_tree():
    costs = EagerCosts(rows=[1, 2, 4], plain=[0.08, 0.10, 0.14], heads=[0.01, 0.012, 0.02], one_row={TREE: 0.12})
    assert costs.step(1, SINGLE) == pytest.approx(0.08)
    assert costs.step(3, SINGLE) == pytest.approx(0.12)  # between the ladder's points
    assert costs.step(8, SINGLE) == pytest.approx(0.14 + 0.02 * 4)  # past its end, along its last segment
    assert costs.step(1, TREE) == pytest.approx(0.12)  # as timed
    assert costs.step(3, TREE) == pytest.approx(0.12 + 3 * 0.04)  # each row adds what the tree adds at one row
    assert costs.heads_at(3) == pytest.approx(0.016)
    assert EagerCosts([1, 2], [0.1, 0.1], [-0.01, 0.0], {}).heads_at(1) == 0.0  # noise never makes heads free


def test_measure_times_every_step_each_round_and_keeps_its_fastest():
    calls, base = [], {(TREE, 1, True): 0.3, **{(SINGLE, r, p): 0.1 * r + (0.05 if p else 0) for r in (1, 2, 4)
                                                for p in (False, True)}}

    def time_step(tree, rows, propose):
        first = (tree, rows, propose) not in calls
        calls.append((tree, rows, propose))
        return base[tree, rows, propose] + (1.0 if first else 0.0)  # each step's first run is slow

    costs = measure(time_step, [SINGLE, TREE], SINGLE, max_rows=4)
    runs = [(TREE, 1, True)] + [(SINGLE, r, p) for r in (1, 2, 4) for p in (False, True)]
    assert calls == [(SINGLE, 1, False)] + runs * EAGER_ROUNDS  # one warm-up step, then interleaved rounds
    assert costs.rows == [1, 2, 4]
    assert costs.plain == pytest.approx([0.1, 0.2, 0.4])
    assert costs.heads == pytest.approx([0.05, 0.05, 0.05])
    assert costs.one_row == {TREE: pytest.approx(0.3)}  # its slow first run is not the one kept


def test_a_cpu_engines_warmup_times_trees_eagerly_and_starts_the_measured_policy(tiny):
    model, heads = tiny
    engine = engine_of(model, heads)
    step = engine.runner.decode
    assert not step.use_graphs
    timed, time_step = [], step.time_step

    def recording(tree, rows, *args, **kwargs):
        timed.append((tree.num_nodes, rows))
        return time_step(tree, rows, *args, **kwargs)

    step.time_step = recording
    chosen = engine.warmup()
    step.time_step = time_step
    assert set(chosen) == {1, 2, 3, 4}  # nothing is padded: every batch size is a bucket
    # plain steps on the ladder's rows, each tree at one row (their measured times are the costs' source;
    # which is faster on a busy CI machine is not asserted: a tiny model's 1- and 4-row steps are near even)
    assert {(1, r) for r in (1, 2, 4)} <= set(timed)
    assert {n for n, r in timed if r == 1} == {tree.num_nodes for tree in engine.scheduler.trees}
    policy = engine.policy
    for bucket in chosen:
        costs = policy.step_cost[bucket]
        assert set(costs) == set(engine.scheduler.trees) and all(c > 0 for c in costs.values())
    assert engine.scheduler.policy(1) is policy.choose(1)
    assert set(engine.warmup(max_batch=1)) == {1}

    def no_more(*args, **kwargs):
        raise AssertionError("timed again")
    engine.runner.decode.time_step = no_more  # a second warmup over timed buckets times nothing
    assert engine.warmup() == chosen


@pytest.mark.parametrize("tree_cost, speculates", [(1.0, False), (0.001, True)])
def test_a_cpu_engines_choice_follows_its_eager_timings(tiny, monkeypatch, tree_cost, speculates):
    """Trees that cost 10x a plain step at one row lose everywhere; trees as cheap as it win at one row."""
    model, heads = tiny
    engine = engine_of(model, heads)
    monkeypatch.setattr(engine.runner.decode, "time_step", lambda tree, rows, *args, propose=True, **kw:
                        0.1 * rows if tree.num_nodes == 1 else tree_cost * rows)
    chosen = engine.warmup()
    assert (chosen[1] != engine.policy.plain[1].label) == speculates
    assert chosen[4] == engine.policy.plain[4].label or speculates


def test_eager_timing_mid_run_leaves_every_request_as_plain_greedy_decoding_has_it(tiny):
    """Timing steps write only the scratch slot and the padding row: requests running meanwhile
    finish as batch-1 plain greedy decoding has them."""
    model, heads = tiny
    ps = random_prompts(3, VOCAB, 30, seed=3)
    engine = engine_of(model, heads)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in ps]
    outputs = {}
    for _ in range(3):
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    engine.warmup()
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, p in zip(ids, ps):
        plain = [t for chunk in TreeDecoder(model, None, SINGLE).decode(p, 20, SamplingConfig()) for t in chunk]
        assert outputs[rid].token_ids == plain[:20]


def test_sampled_traffic_is_decided_by_a_policy_of_its_own(tiny):
    """Sampled rows accept less than greedy ones: what they teach must not decide greedy traffic's trees (a
    burst of sampled requests settled a batch size on plain decoding, then greedy requests ran it). Warmup
    gives both policies its costs; a step's tree, costs and acceptance belong to the one of its traffic."""
    model, heads = tiny
    engine = engine_of(model, heads)
    assert engine.sampled_policy is None and engine.traffic_policy() is engine.policy
    engine.warmup()
    greedy, sampled = engine.policy, engine.sampled_policy
    assert sampled is not None and sampled is not greedy and sampled.step_cost == greedy.step_cost
    ps = random_prompts(3, VOCAB, 12, seed=4)
    engine.generate(ps, SamplingParams(max_tokens=8, temperature=0.9, seed=1))
    assert sampled.observed and not greedy.observed and engine._sampled_seqs == 0
    seen = dict(sampled.observed)
    engine.generate(ps, SamplingParams(max_tokens=8))
    assert greedy.observed and sampled.observed == seen and engine.traffic_policy() is greedy
    rid = engine.add_request(ps[0], SamplingParams(max_tokens=8, temperature=0.9, n=2))
    assert engine.traffic_policy() is sampled and engine._sampled_seqs == 2
    engine.abort(rid)
    assert engine._sampled_seqs == 0 and engine.traffic_policy() is greedy


def test_traffic_the_host_decides_has_a_policy_of_its_own(tiny, monkeypatch):
    """Rows the host decides (bad words, guides) make every step dearer: their costs must not switch free
    traffic's speculation off, nor free steps make their trees look cheap. While any such row runs, the host
    policy decides, whatever else is in the batch (sampled rows too)."""
    from test_penalties import words_as

    words_as(monkeypatch, {"ab": [(3, 4)]})
    model, heads = tiny
    engine = engine_of(model, heads)
    engine.warmup()
    greedy, sampled, host = engine.policy, engine.sampled_policy, engine.host_policy
    assert host is not None and host is not greedy and host is not sampled and host.step_cost == greedy.step_cost
    ps = random_prompts(3, VOCAB, 12, seed=4)
    engine.generate(ps, SamplingParams(max_tokens=8, bad_words=("ab",)))
    assert host.observed and not greedy.observed and not sampled.observed and engine._host_seqs == 0
    seen = dict(host.observed)
    engine.generate(ps, SamplingParams(max_tokens=8))
    assert greedy.observed and host.observed == seen and engine.traffic_policy() is greedy
    engine.add_request(ps[0], SamplingParams(max_tokens=8, temperature=0.9))
    rid = engine.add_request(ps[1], SamplingParams(max_tokens=8, bad_words=("ab",)))
    assert engine.traffic_policy() is host and engine._host_seqs == 1
    engine.abort(rid)
    assert engine._host_seqs == 0 and engine.traffic_policy() is sampled
