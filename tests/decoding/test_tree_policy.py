"""The measured tree policy: step costs and predicted acceptance pick the tree, observations correct it."""

from medusa.decoding.engine import LLMEngine
from medusa.decoding.sampling_params import SamplingParams
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
    assert engine.scheduler.tree_for(1) is trees[64]
    engine.policy.observe(trees[64], 1100, 1000)  # really 1.1 tokens per step: not worth 1.3x the cost
    assert engine.scheduler.tree_for(1) is trees[4]
    engine.policy.observe(trees[4], 1000, 1000)  # and nothing accepted at all: plain decoding wins
    assert engine.scheduler.tree_for(1) is trees[1]


def test_decode_steps_record_what_each_tree_emitted():
    engine, trees = engine_with_costs({1: {1: 1.0, 4: 1.0}}, {1: 1.0, 4: 3.0})
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=12))[0]
    emitted, steps = engine.policy.observed[trees[4]]
    assert steps == out.stats.steps and emitted == sum(out.stats.accepted_lengths)
