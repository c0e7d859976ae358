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


def test_scoring_skips_only_prompt_positions_nothing_reads(monkeypatch):
    """Heads run from the first position any target needs: accuracies and accepted lengths are unchanged."""
    from medusa.training import evaluate
    from medusa.training.data import batches
    from medusa.training.distill_cache import Sequences

    model, heads = tiny()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (n,), generator=gen).tolist() for n in (30, 12, 45)]
    answers = [torch.randint(0, 16, (n,), generator=gen).tolist() for n in (20, 25, 9)]
    seqs = Sequences.from_lists([p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts])
    assert evaluate.first_scored_position(_loss_mask(seqs), num_heads=3) == 12 - 3 - 1
    tree = TreeSpec.load("tree-8")
    skipped = evaluate.evaluate_heads(model, heads, batches(seqs, 4096, 0, 0), tree=tree)
    monkeypatch.setattr(evaluate, "first_scored_position", lambda *args, **kwargs: 0)
    full = evaluate.evaluate_heads(model, heads, batches(seqs, 4096, 0, 0), tree=tree)
    assert skipped.accuracies == full.accuracies and skipped.num_targets == full.num_targets > 0
    assert skipped.accepted_lengths == full.accepted_lengths and len(full.accepted_lengths) > 10


def test_head_topk_marks_skipped_positions():
    model, heads = tiny()
    ids = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(1))
    full, part = head_topk(model, heads, ids, 4), head_topk(model, heads, ids, 4, begin=7)
    assert part.shape == full.shape
    assert (part[:, :7] == -1).all() and torch.equal(part[:, 7:], full[:, 7:])


def _loss_mask(seqs):
    from medusa.training.data import batches

    return next(iter(batches(seqs, 4096, 0, 0))).loss_mask
