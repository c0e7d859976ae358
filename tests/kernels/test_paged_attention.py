"""The paged-attention reference against a naive dense computation on random inputs."""

import math

import pytest
import torch

from medusa.kernels.paged_attention import move_kv_reference, paged_attention_reference, write_kv_reference
from medusa.tree import TreeSpec


def naive(q, k, v, mask):
    """q [Tq, Hq, D], k/v [S, Hkv, D], mask [Tq, S] -> [Tq, Hq, D] with explicit softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_of_prompt_chunks_and_trees(seed):
    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks, hq, hkv, d = 4, 64, 4, 2, 8
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    trees = [TreeSpec.load("tree-8"), None, TreeSpec.load("chain-3"), None]
    prefixes = [int(x) for x in torch.randint(0, 13, (4,), generator=g)]
    q_lens = [t.num_nodes if t else int(torch.randint(1, 9, (1,), generator=g)) for t in trees]
    tables, bits, causal = [], [], []
    for tree, prefix, q_len in zip(trees, prefixes, q_lens):
        n_blocks = -(-(prefix + q_len) // block_size)
        tables.append([free.pop() for _ in range(n_blocks)])
        causal.append(tree is None)
        bits.append(tree.ancestor_bits if tree else torch.zeros(q_len, dtype=torch.long))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv_lens = torch.tensor([p + q for p, q in zip(prefixes, q_lens)])
    query_start = torch.tensor([0] + q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    out = paged_attention_reference(q, k_cache, v_cache, block_tables, kv_lens, query_start,
                                    torch.tensor(causal), torch.cat(bits), block_size)
    for b, (tree, prefix, q_len) in enumerate(zip(trees, prefixes, q_lens)):
        slots = torch.tensor([tables[b][i // block_size] * block_size + i % block_size for i in range(prefix + q_len)])
        own = tree.attention_mask if tree else torch.ones(q_len, q_len, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool), own], 1)
        s = query_start[b]
        expected = naive(q[s:s + q_len], k_cache[slots], v_cache[slots], mask)
        assert torch.allclose(out[s:s + q_len], expected, atol=1e-5)


def test_write_and_move_kv():
    k_cache, v_cache = torch.zeros(16, 1, 2), torch.zeros(16, 1, 2)
    k = torch.arange(8.0).view(4, 1, 2)
    write_kv_reference(k_cache, v_cache, k, -k, torch.tensor([5, -1, 9, 10]))
    assert k_cache[5].tolist() == [[0.0, 1.0]] and k_cache[9].tolist() == [[4.0, 5.0]]
    assert k_cache[0].abs().sum() == 0  # the padded token wrote nothing
    move_kv_reference(k_cache, v_cache, torch.tensor([9, 10]), torch.tensor([8, 9]))  # overlapping move
    assert k_cache[8].tolist() == [[4.0, 5.0]] and k_cache[9].tolist() == [[6.0, 7.0]]
    assert v_cache[8].tolist() == [[-4.0, -5.0]]
