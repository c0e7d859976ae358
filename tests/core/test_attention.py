"""`attend` on a CPU runs few non-causal queries as explicit products (each KV head's query heads folded into the
query length) and the rest through SDPA: both must equal grouped attention."""

import pytest
import torch

from medusa import attention
from medusa.attention import CPU_EXPLICIT_MAX_QUERIES, attend


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


@pytest.mark.parametrize("queries", [5, CPU_EXPLICIT_MAX_QUERIES + 1])  # the explicit path, then SDPA
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "shared", "shared_with_head_axis", "per_head", "batched"])
def test_cpu_attention_equals_repeated_kv(queries, heads, kv_heads, mask_kind):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + len(mask_kind) + queries)
    batch, t, s, d = 2, queries, queries + 37, 16
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


@pytest.mark.parametrize("lead", [(), (3,)])
def test_the_explicit_path_without_a_batch_axis_and_with_one(lead):
    g = torch.Generator().manual_seed(len(lead))
    q = torch.randn(*lead, 1, 6, 8, generator=g)  # one query: a decode step
    k, v = torch.randn(2, *lead, 300, 2, 8, generator=g)
    mask = tree_mask(1, 300, g)
    torch.testing.assert_close(attend(q, k, v, mask=mask).double(), grouped_reference(q, k, v, mask),
                               atol=1e-5, rtol=1e-5)


def test_a_scale_reaches_both_paths():
    g = torch.Generator().manual_seed(0)
    for t in (4, CPU_EXPLICIT_MAX_QUERIES + 1):
        q, k, v = torch.randn(t, 6, 8, generator=g), torch.randn(t + 9, 2, 8, generator=g), torch.randn(t + 9, 2, 8)
        # scaling the queries by c is the same attention as scale c / sqrt(D)
        torch.testing.assert_close(attend(q, k, v, scale=0.5 / 8 ** 0.5), attend(q * 0.5, k, v))


def test_a_query_that_sees_no_key_stays_finite():
    q, kv = torch.randn(2, 4, 8), torch.randn(5, 2, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    out = attend(q, kv, kv, mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0].double(), grouped_reference(q[:1], kv, kv, mask[:1])[0])


def test_only_few_non_causal_float32_queries_take_the_explicit_path(monkeypatch):
    """Decoding and verification steps run the explicit products; prompt forwards (causal), wide chunks and
    bfloat16 keep SDPA."""
    explicit, run = [], attention._attend_explicit
    monkeypatch.setattr(attention, "_attend_explicit", lambda q, *a: explicit.append(q.shape[-3]) or run(q, *a))
    few = CPU_EXPLICIT_MAX_QUERIES
    for t, causal, dtype in [(1, False, torch.float32), (few, False, torch.float32), (few + 1, False, torch.float32),
                             (4, True, torch.float32), (3, False, torch.bfloat16), (2, False, torch.float64)]:
        q, kv = torch.randn(t, 6, 8, dtype=dtype), torch.randn(t + 16, 2, 8, dtype=dtype)
        attend(q, kv[:t] if causal else kv, kv[:t] if causal else kv, causal=causal,
               mask=None if causal else torch.ones(t, t + 16, dtype=torch.bool))
    assert explicit == [1, few, 2]
