"""Batched device-side verification against the batch-1 verifier, row by row, on random trees and logits."""

import numpy as np
import pytest
import torch

from medusa.decoding.batch_verify import build_candidates, compaction_slots, emitted_tokens, greedy_verdict
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.verifier import AcceptanceConfig, verify
from medusa.tree import TreeSpec
from tiny_models import tiny_decoder


@pytest.mark.parametrize("name,lookup", [("single", 0), ("tree-4", 0), ("tree-16", 0), ("tree-64", 0),
                                         ("tree-4", 6), ("tree-64", 5)])
def test_batched_greedy_equals_per_row_verify(name, lookup):
    """With a lookup chain too (tree-4's is deeper than its heads; tree-64's is cut to 64 nodes)."""
    tree = DeviceTree.from_spec(TreeSpec.load(name).with_lookup(lookup), torch.device("cpu"))
    g = torch.Generator().manual_seed(len(name) + lookup)
    batch, vocab, n = 6, 5, tree.num_nodes  # tiny vocab: many children match, so paths go deep
    candidates = torch.randint(0, vocab, (batch, n), generator=g)
    logits = torch.randn(batch, n, vocab, generator=g)
    best = greedy_verdict(tree, candidates, logits.argmax(-1))
    next_tokens = logits.argmax(-1).gather(1, best[:, None]).squeeze(1)
    count, tokens = emitted_tokens(tree, candidates, best, next_tokens)
    slots = torch.arange(batch * n).view(batch, n) * 3 + 100  # any distinct slots
    src, dst = compaction_slots(tree, slots, best)
    width = tree.spec.max_depth + 1
    for b in range(batch):
        verdict = verify(tree, candidates[b], logits[b], SamplingConfig(), AcceptanceConfig())
        accepted = verdict.accepted
        assert int(best[b]) == int(accepted[-1]) and int(next_tokens[b]) == int(verdict.next_token)
        want = candidates[b, accepted[1:]].tolist() + [int(verdict.next_token)]
        assert int(count[b]) == len(want) and tokens[b, : len(want)].tolist() == want
        moves = {int(s): int(d) for s, d in zip(src[b * width:(b + 1) * width], dst[b * width:(b + 1) * width])
                 if s != d}
        assert moves == {int(slots[b, a]): int(slots[b, i]) for i, a in enumerate(accepted.tolist()) if a != i}


def test_candidates_take_each_depths_head_and_rank():
    tree = DeviceTree.from_spec(TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1)]), torch.device("cpu"))
    topk = torch.tensor([[[10, 11], [20, 21]]])  # [B=1, K=2 heads, kmax=2]
    assert build_candidates(tree, torch.tensor([7]), topk).tolist() == [[7, 10, 11, 20, 21]]
    assert build_candidates(DeviceTree.from_spec(TreeSpec(), torch.device("cpu")), torch.tensor([3, 4]),
                            None).tolist() == [[3], [4]]


def test_lookup_nodes_take_the_lookup_tokens_after_the_head_nodes():
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0)]).with_lookup(3)
    tree = DeviceTree.from_spec(spec, torch.device("cpu"))
    assert tree.num_lookup == 3 and tree.first_lookup_node == 4 and tree.head_index.tolist() == [0, 0, 1]
    topk = torch.tensor([[[10, 11], [20, 21]], [[12, 13], [22, 23]]])  # [B=2, K=2, kmax=2]
    lookup = torch.tensor([[30, 31, 32, 99], [40, 41, 42, 99]])  # [B, 4]: wider than L, as the engine's buffer
    got = build_candidates(tree, torch.tensor([7, 8]), topk, lookup)
    assert got.tolist() == [[7, 10, 11, 20, 30, 31, 32], [8, 12, 13, 22, 40, 41, 42]]
    with pytest.raises(ValueError, match="lookup"):
        build_candidates(tree, torch.tensor([7, 8]), topk)


def test_an_accepted_lookup_chain_is_emitted_and_its_kv_moved():
    spec = TreeSpec.from_paths([(0,), (0, 0)]).with_lookup(4)  # nodes: 0 root, 1-2 heads, 3-6 lookup
    tree = DeviceTree.from_spec(spec, torch.device("cpu"))
    candidates = torch.tensor([[5, 1, 1, 6, 7, 8, 2]])
    targets = torch.tensor([[6, 0, 0, 7, 8, 3, 0]])  # the chain matches 6, 7, 8, then 2 != 3
    best = greedy_verdict(tree, candidates, targets)
    assert best.tolist() == [5]
    count, tokens = emitted_tokens(tree, candidates, best, targets[:, 5])
    assert count.tolist() == [4] and tokens[0, :4].tolist() == [6, 7, 8, 3]
    src, dst = compaction_slots(tree, torch.arange(7)[None] + 100, best)
    assert {int(s): int(d) for s, d in zip(src, dst) if s != d} == {103: 101, 104: 102, 105: 103}


def test_batched_sampling_equals_the_host_sampler_row_by_row():
    from medusa.decoding.batch_verify import sampled_targets
    from medusa.decoding.sampler import TokenSampler, target_probs

    g = torch.Generator().manual_seed(3)
    batch, n, vocab = 7, 7, 50
    logits = torch.randn(batch, n, vocab, generator=g) * 3
    configs = [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.3, top_k=5),
               SamplingConfig(temperature=0.9, top_p=0.6), SamplingConfig(temperature=1.0, top_k=20, top_p=0.9),
               SamplingConfig(temperature=0.5, top_k=vocab), SamplingConfig(temperature=0.8, min_p=0.1),
               SamplingConfig(temperature=1.4, min_p=0.05, top_k=12, top_p=0.8)]
    positions = torch.arange(n) + 11
    uniforms = torch.stack([TokenSampler.uniforms(100 + b, positions) for b in range(batch)])
    got = sampled_targets(logits, torch.tensor([c.temperature for c in configs]),
                          torch.tensor([c.top_k for c in configs]), torch.tensor([c.top_p for c in configs]),
                          torch.tensor([c.min_p for c in configs]), uniforms)
    for b, config in enumerate(configs):
        want = TokenSampler(100 + b)(logits[b], config, positions)
        assert got[b].tolist() == want.tolist(), b
        kept = target_probs(logits[b], config) > 0  # every draw is a token the filters keep
        assert kept.gather(1, got[b][:, None]).all(), b


def test_sampling_without_filters_skips_the_sorts_and_draws_the_same_tokens():
    """A step whose rows only set a temperature runs sampled_targets(filtered=False): no sort of the
    vocabulary, and the same draws as the full path and as the host sampler."""
    from unittest import mock

    from medusa.decoding.batch_verify import sampled_targets
    from medusa.decoding.sampler import TokenSampler

    g = torch.Generator().manual_seed(4)
    batch, n, vocab = 4, 6, 300
    logits = torch.randn(batch, n, vocab, generator=g) * 4
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.6])
    positions = torch.arange(n) + 3
    uniforms = torch.stack([TokenSampler.uniforms(7 + b, positions) for b in range(batch)])
    args = (logits, temperature, torch.zeros(batch, dtype=torch.long), torch.ones(batch), torch.zeros(batch), uniforms)
    full = sampled_targets(*args)
    with mock.patch.object(torch.Tensor, "sort", side_effect=AssertionError("sorted")), \
            mock.patch.object(torch, "sort", side_effect=AssertionError("sorted")):
        fast = sampled_targets(*args, filtered=False)
    assert torch.equal(fast, full)
    for b in range(batch):
        want = TokenSampler(7 + b)(logits[b], SamplingConfig(temperature=float(temperature[b])), positions)
        assert fast[b].tolist() == want.tolist(), b


def test_a_steps_sampling_kind_follows_its_rows_filters():
    from medusa.decoding.decode_step import FILTERED, GREEDY, SAMPLED, RowSampling
    from medusa.decoding.engine import LLMEngine

    model, heads = tiny_decoder(24, logit_scale=3, num_heads=2)
    step = LLMEngine(model, heads).runner.decode
    row = lambda top_k=0, top_p=1.0, min_p=0.0: RowSampling(0.8, top_k, top_p, np.zeros(4), min_p)  # noqa: E731
    for rows, kind in (([None, None], GREEDY), ([None, row()], SAMPLED), ([row(), row(top_p=0.9)], FILTERED),
                       ([row(top_k=5), None], FILTERED), ([row(min_p=0.1), row()], FILTERED)):
        step._prepare_sampling(rows, 2)
        assert step.sampling_step == kind, rows


def test_batch_buckets_never_pass_max_num_seqs():
    from medusa.decoding.decode_step import batch_buckets

    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(60) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60]  # was ... 56, 64: 64 rows in 60-row buffers


def test_batch_bits_are_built_once_per_batch_size():
    """A captured step reads the repeated tree bits from a kept buffer, one per batch size."""
    tree = DeviceTree.from_spec(TreeSpec.load("tree-8").with_lookup(2), torch.device("cpu"))
    two = tree.batch_bits(2)
    assert torch.equal(two, tree.bits.repeat(2)) and tree.batch_bits(2) is two
    assert torch.equal(tree.batch_bits(3), tree.bits.repeat(3)) and tree.batch_bits(3) is not two
