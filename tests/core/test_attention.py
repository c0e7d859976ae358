"""`attend` on a CPU folds each KV head's query heads into the query length: it must equal grouped attention."""

import pytest
import torch

from medusa.attention import CPU_FOLD_MIN_KEYS, attend


def grouped_reference(q, k, v, mask=None, causal=False):
    """K/V repeated for every query head, float64, masks made explicit."""
    group = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
    t, s = q.shape[-3], k.shape[-3]
    scores = torch.einsum("...thd,...shd->...hts", q.double(), k.double()) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("...hts,...shd->...thd", scores.softmax(-1), v.double())


def tree_mask(t, s, generator):
    """[T, S]: every key of the prefix, then a random ancestor pattern with each query seeing itself."""
    own = (torch.rand(t, t, generator=generator) < 0.5).tril()
    own |= torch.eye(t, dtype=torch.bool)
    return torch.cat([torch.ones(t, s - t, dtype=torch.bool), own], dim=1)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "shared", "shared_with_head_axis", "per_head", "batched"])
def test_folded_grouped_attention_equals_repeated_kv(heads, kv_heads, mask_kind):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + len(mask_kind))
    batch, t, s, d = 2, 5, CPU_FOLD_MIN_KEYS + 3, 16  # enough keys for the folded path
    q = torch.randn(batch, t, heads, d, generator=g)
    k, v = torch.randn(2, batch, s, kv_heads, d, generator=g)
    mask, causal = None, mask_kind == "causal"
    if causal:
        k, v = k[:, :t], v[:, :t]  # a prompt attending to itself
    elif mask_kind == "shared":
        mask = tree_mask(t, s, g)  # [T, S]
    elif mask_kind == "shared_with_head_axis":
        mask = tree_mask(t, s, g)[None, None]  # [1, 1, T, S]
    elif mask_kind == "per_head":
        mask = torch.stack([tree_mask(t, s, g) for _ in range(heads)])  # [Hq, T, S]
    elif mask_kind == "batched":
        mask = torch.stack([tree_mask(t, s, g) for _ in range(batch)])[:, None]  # [B, 1, T, S]
    out = attend(q, k, v, mask=mask, causal=causal)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), grouped_reference(q, k, v, mask, causal), atol=1e-5, rtol=1e-5)


def test_a_scale_reaches_the_folded_attention():
    g = torch.Generator().manual_seed(0)
    s = CPU_FOLD_MIN_KEYS
    q, k, v = torch.randn(4, 6, 8, generator=g), torch.randn(s, 2, 8, generator=g), torch.randn(s, 2, 8, generator=g)
    # scaling the queries by c is the same attention as scale c / sqrt(D)
    torch.testing.assert_close(attend(q, k, v, scale=0.5 / 8 ** 0.5), attend(q * 0.5, k, v))


def test_a_cpu_folds_only_few_non_causal_queries_over_many_keys(monkeypatch):
    """Decoding and verification steps over a long context take the folded path; prompt forwards, short
    contexts and causal calls keep SDPA's grouped one, which is as fast or faster there."""
    import medusa.attention as attention

    folded, fold = [], attention._attend_folded
    monkeypatch.setattr(attention, "_attend_folded", lambda q, *a: folded.append(q.shape[-3]) or fold(q, *a))
    few, keys = attention.CPU_FOLD_MAX_QUERIES, attention.CPU_FOLD_MIN_KEYS
    for t, s, causal in [(1, keys, False), (few, keys + few, False), (few + 1, keys + few, False),
                         (4, keys - 1, False), (4, keys, True)]:
        q, kv = torch.randn(t, 6, 8), torch.randn(s, 2, 8)
        attend(q, kv, kv, mask=None if causal else torch.ones(t, s, dtype=torch.bool), causal=causal)
    assert folded == [1, few]
    attend(torch.randn(3, 4, 8), torch.randn(keys, 4, 8), torch.randn(keys, 4, 8))  # no grouping: nothing to fold
    assert folded == [1, few]
