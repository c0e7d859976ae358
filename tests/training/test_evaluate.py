"""Simulated acceptance equals what the decoder really accepts; accuracies count correctly."""

import torch

from medusa.config import ModelConfig
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.model import DecoderModel
from medusa.training.evaluate import accepted_length_per_root, head_topk, rank_hits, walk
from medusa.tree import TreeSpec


def tiny(vocab=16):
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    model = DecoderModel(config).eval()
    heads = MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=vocab, num_heads=3)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return model, heads


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
