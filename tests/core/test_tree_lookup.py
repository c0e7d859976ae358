"""TreeSpec's prompt-lookup chain: tensors, identity, serialisation, trimming to 64 nodes."""

from __future__ import annotations

import pytest
import torch

from medusa.tree import MAX_NODES, TreeSpec

# root 0; head nodes 1 (0,), 2 (1,), 3 (0, 0) from two heads; lookup nodes 4, 5, 6 at depths 1, 2, 3
SMALL = TreeSpec.from_paths([(0,), (1,), (0, 0)], name="small")


def test_chain_nodes_follow_the_head_nodes_and_go_deeper_than_the_heads():
    tree = SMALL.with_lookup(3)
    assert tree.num_nodes == 7 and tree.first_lookup_node == 4
    assert tree.head_depth == 2 and tree.max_depth == 3
    assert tree.parents.tolist() == [-1, 0, 0, 1, 0, 4, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 1, 2, 3]
    assert tree.head_index.tolist() == [-1, 0, 0, 1, -1, -1, -1]  # no head proposes a lookup node
    assert tree.topk_per_depth == SMALL.topk_per_depth == (2, 1)
    assert tree.is_leaf.tolist() == [False, False, True, True, False, False, True]
    assert tree.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 3, -1], [0, 4, 5, 6]]
    mask = torch.zeros(7, 7, dtype=torch.bool)
    for node, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 4], [0, 4, 5], [0, 4, 5, 6]]):
        mask[node, ancestors] = True
    assert torch.equal(tree.attention_mask, mask)
    assert tree.ancestor_bits.tolist() == [sum(1 << j for j in range(7) if mask[i, j]) for i in range(7)]


def test_plain_tensors_are_unchanged_and_the_prior_ignores_the_chain():
    tree = SMALL.with_lookup(3)
    n = SMALL.num_nodes
    assert torch.equal(tree.attention_mask[:n, :n], SMALL.attention_mask)
    assert torch.equal(tree.parents[:n], SMALL.parents) and torch.equal(tree.depths[:n], SMALL.depths)
    accuracies = [[0.5, 0.2], [0.4, 0.1]]
    assert tree.expected_accept_length(accuracies) == SMALL.expected_accept_length(accuracies)
    tree.check_heads(2)  # the chain is deeper than two heads, but needs none


def test_lookup_variants_are_distinct_keys():
    a, b = SMALL.with_lookup(3), SMALL.with_lookup(2)
    assert a != SMALL and a != b and hash(a) != hash(SMALL)
    assert a == TreeSpec(SMALL.paths, lookup=3)  # names are labels, as for plain trees
    assert hash(a) == hash(TreeSpec(SMALL.paths, name="other", lookup=3))  # the cached hash ignores them too
    assert len({SMALL, a, b, SMALL.with_lookup(3)}) == 3
    assert a.name == "small+lookup3" and a.with_lookup(2).name == "small+lookup2"
    assert a.with_lookup(0) == SMALL and a.with_lookup(0).name == "small"
    assert repr(a) == "TreeSpec(name='small+lookup3', nodes=7, depth=3, lookup=3)"


def test_round_trip_through_dict_and_file(tmp_path):
    tree = SMALL.with_lookup(3)
    back = TreeSpec.from_dict(tree.to_dict())
    assert back == tree and back.lookup == 3 and back.name == tree.name
    assert torch.equal(back.attention_mask, tree.attention_mask)
    tree.save(tmp_path / "t.json")
    assert TreeSpec.load(tmp_path / "t.json") == tree
    assert "lookup" not in SMALL.to_dict()  # plain trees keep their files as they were


def test_too_many_nodes_keep_a_prefix_closed_head_prefix():
    big = TreeSpec.load("tree-64")
    tree = big.with_lookup(5)
    assert tree.num_nodes == MAX_NODES and tree.lookup == 5
    assert tree.paths == big.paths[: MAX_NODES - 1 - 5]
    TreeSpec(tree.paths)  # validation: still prefix-closed
    assert int(tree.ancestor_bits[-1]) < 0  # node 63 (the chain's last) sets the sign bit
    assert TreeSpec.chain(0).with_lookup(MAX_NODES - 1).num_nodes == MAX_NODES


@pytest.mark.parametrize("bad", [-1, MAX_NODES, 2.0, True])
def test_bad_lengths(bad):
    with pytest.raises(ValueError, match="lookup"):
        SMALL.with_lookup(bad)
    if bad != MAX_NODES:
        with pytest.raises(ValueError, match="lookup"):
            TreeSpec(SMALL.paths, lookup=bad)
