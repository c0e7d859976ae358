"""The heads' losses: hard targets, the base's soft distribution, and their mix."""

import pytest
import torch
import torch.nn.functional as F

from medusa.training.config import load_config
from medusa.training.losses import head_targets, medusa_loss, soft_head_ce

K, B, T, V = 3, 2, 9, 11


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :3] = False  # a prompt
    return ids, mask, torch.randn(K, B, T, V, generator=g), torch.randn(B, T, V, generator=g)


def test_soft_targets_are_the_base_distribution_one_position_before_the_target():
    """By the definition: head k at t against softmax(base at t + k + 1), over valid positions."""
    ids, mask, heads, base = batch()
    _, valid = head_targets(ids, mask, K)
    got = soft_head_ce(heads, base, valid)
    for k in range(K):
        terms = [-(F.softmax(base[b, t + k + 1], -1) * F.log_softmax(heads[k, b, t], -1)).sum()
                 for b in range(B) for t in range(T) if valid[k, b, t]]
        assert torch.allclose(got[k], torch.stack(terms).mean(), atol=1e-5)


def test_heads_that_copy_the_base_reach_the_entropy_floor():
    ids, mask, _, base = batch(1)
    _, valid = head_targets(ids, mask, K)
    shifted = torch.stack([torch.cat([base[:, k + 1:], base[:, :k + 1]], 1) for k in range(K)])  # head k = base at t+k+1
    floor = soft_head_ce(shifted, base, valid)
    noisy = soft_head_ce(shifted + 0.5 * torch.randn_like(shifted), base, valid)
    assert (floor < noisy).all()


@pytest.mark.parametrize("weight", [0.0, 0.3, 1.0])
def test_the_mix_weights_hard_and_soft_per_head(weight):
    ids, mask, heads, base = batch(2)
    hard = medusa_loss(heads, ids, mask, decay=0.5)
    mixed = medusa_loss(heads, ids, mask, decay=0.5, base_logits=base, soft_weight=weight)
    _, valid = head_targets(ids, mask, K)
    per_head = (1 - weight) * hard.per_head_ce + weight * soft_head_ce(heads, base, valid)
    assert torch.allclose(mixed.loss, (0.5 ** torch.arange(K) * per_head).sum(), atol=1e-5)


def test_soft_targets_need_base_logits_and_a_weight_in_range():
    ids, mask, heads, _ = batch()
    with pytest.raises(ValueError, match="base_logits"):
        medusa_loss(heads, ids, mask, soft_weight=0.5)
    with pytest.raises(ValueError, match=r"train.soft_targets must be in \[0, 1\], got 1.5"):
        load_config(None, ["train.soft_targets=1.5"])
