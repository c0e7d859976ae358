"""Simulated acceptance equals what the decoder really accepts; accuracies count correctly."""

import torch

from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.training.evaluate import accepted_length_per_root, head_topk, rank_hits, walk
from medusa.tree import TreeSpec
from tiny_models import tiny_decoder


def tiny(vocab=16):
    return tiny_decoder(vocab, logit_scale=3, max_positions=256, num_heads=3)


def test_simulated_acceptance_equals_real_decoding():
    model, heads = tiny()
    for name in ("chain-3", "tree-8", "tree-16"):
        tree = TreeSpec.load(name)
        prompt = [1, 5, 2, 7]
        decoder = TreeDecoder(model, heads, tree)
        generated = []
        for chunk in decoder.decode(prompt, 60, SamplingConfig()):
            generated += chunk
        seq = torch.tensor(prompt + generated)
        topk = head_topk(model, heads, seq[None], 10)[0]
        simulated = walk(accepted_length_per_root(topk, seq, tree), len(prompt))
        assert simulated == decoder.stats.accepted_lengths
        lengths = decoder.stats.accepted_lengths
    assert sum(lengths) / len(lengths) > 1.3 and max(lengths) >= 2  # tree-16 accepts often: not vacuous


def test_rank_hits_counts_each_rank():
    # one head, T=5; target of position t is ids[t + 2]
    ids = torch.tensor([0, 1, 2, 3, 4])
    topk = torch.tensor([[[2, 9]], [[9, 3]], [[4, 9]], [[0, 0]], [[0, 0]]])  # [T, K=1, R=2]
    valid = torch.ones(5, dtype=torch.bool)
    assert rank_hits(topk, ids, valid).tolist() == [[2, 1]]
    valid[3] = False  # position 1's target (ids[3]) is not a response token
    assert rank_hits(topk, ids, valid).tolist() == [[2, 0]]
